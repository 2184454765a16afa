//! The master client's connection: which master it talks to, opening the channel (signed with
//! the pool key), and one call with retries that follows the leader across master replicas.
//! I/O boundary: the gRPC channel to the current master (over TLS when the client has it).

use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use tonic::Code;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use super::MasterClient;
use super::error::ClientError;
use super::tls::{MasterTls, tls_failure};
use kvpool_proto::auth::Signer;
use kvpool_proto::master::LEADER_HEADER;
use kvpool_proto::master::master_client::MasterClient as Grpc;

pub(super) type GrpcClient = Grpc<InterceptedService<Channel, Signer>>;

/// Tunables of the client.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    /// Calls answered UNAVAILABLE (standby, restarting leader) are retried this long.
    pub failover_budget: Duration,
    /// A [fork](MasterClient::fork)'s fast-lane call polls for its answer this long before
    /// it sleeps on the socket (see `kvpool_transfer::wire::spin_until_readable`). Zero: no
    /// polling.
    pub spin_wait: Duration,
    /// TLS to the master (default: from the `KVPOOL_MASTER_*` environment variables of
    /// [`super::tls`]; none set: plaintext).
    pub tls: MasterTls,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(10),
            failover_budget: Duration::from_secs(15),
            spin_wait: Duration::ZERO,
            tls: MasterTls::from_env(),
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct Conn {
    /// Index into `endpoints` or an address learnt from a leader hint.
    addr: Option<String>,
    client: Option<GrpcClient>,
    next: usize,
}

/// The URI of a master given as `host:port` or as a URL; with `tls`, an `https` one (tonic
/// speaks TLS to `https` URIs only).
pub(super) fn uri(addr: &str, tls: bool) -> String {
    match (addr.split_once("://"), tls) {
        (Some(("http", rest)), true) => format!("https://{rest}"),
        (Some(_), _) => addr.to_owned(),
        (None, true) => format!("https://{addr}"),
        (None, false) => format!("http://{addr}"),
    }
}

/// The host part of a master address (`host:port` or a URL), brackets of an IPv6 host kept.
pub(super) fn host(addr: &str) -> &str {
    let rest = addr.split_once("://").map_or(addr, |(_, r)| r);
    let hostport = rest.split('/').next().unwrap_or(rest);
    hostport
        .rsplit_once(':')
        .filter(|(h, p)| !p.contains(']') && !h.is_empty())
        .map_or(hostport, |(h, _)| h)
}

impl MasterClient {
    async fn connection(&self) -> Result<(String, GrpcClient), ClientError> {
        let (addr, cached) = {
            let c = self.conn.lock();
            (self.target_of(&c), c.client.clone())
        };
        if let Some(client) = cached {
            return Ok((addr, client));
        }
        let endpoint_error = |source| ClientError::Endpoint {
            endpoint: addr.clone(),
            source,
        };
        let mut endpoint = Endpoint::from_shared(uri(&addr, self.tls.is_some()))
            .map_err(endpoint_error)?
            .connect_timeout(self.config.connect_timeout)
            .timeout(self.config.request_timeout)
            .tcp_nodelay(true);
        if let Some(tls) = &self.tls {
            endpoint = endpoint
                .tls_config(tls.tonic.clone())
                .map_err(endpoint_error)?;
        }
        let channel = endpoint.connect().await.map_err(|source| {
            match self.tls.as_ref().and(tls_failure(&source)) {
                Some(reason) => ClientError::TlsVerify {
                    server_name: self
                        .config
                        .tls
                        .server_name
                        .clone()
                        .unwrap_or_else(|| host(&addr).to_owned()),
                    endpoint: addr.clone(),
                    reason,
                    source,
                },
                None => ClientError::Connect {
                    endpoint: addr.clone(),
                    source,
                },
            }
        })?;
        let client = Grpc::with_interceptor(channel, self.signer.clone())
            .max_decoding_message_size(64 << 20);
        let mut c = self.conn.lock();
        c.addr = Some(addr.clone());
        c.client = Some(client.clone());
        Ok((addr, client))
    }

    /// Forget the connection to `failed`; go to `hint` if given, else the next endpoint.
    fn fail_over(&self, failed: &str, hint: Option<String>) {
        let mut c = self.conn.lock();
        if c.addr.as_deref() != Some(failed) {
            return; // another call already moved on
        }
        c.client = None;
        c.addr = hint;
        if c.addr.is_none() {
            c.next = c.next.wrapping_add(1);
        }
    }

    /// The endpoint the next call goes to: the connected one, else the next to try.
    pub(super) fn current_target(&self) -> String {
        self.target_of(&self.conn.lock())
    }

    fn target_of(&self, c: &Conn) -> String {
        c.addr.clone().unwrap_or_else(|| {
            self.endpoints
                .get(c.next % self.endpoints.len())
                .cloned()
                .unwrap_or_default()
        })
    }

    /// The address the client currently talks to, if connected.
    pub fn current_endpoint(&self) -> Option<String> {
        self.conn.lock().addr.clone()
    }

    /// One unary call (see the `rpc!` macro): retried on another connection while the master
    /// is unavailable, with delays from [`RETRY_FIRST`] doubling up to [`RETRY_MAX`], as long
    /// as the next try starts within the failover budget.
    pub(super) async fn call<T, F, Fut>(&self, method: &'static str, f: F) -> Result<T, ClientError>
    where
        F: Fn(GrpcClient) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let deadline = tokio::time::Instant::now() + self.config.failover_budget;
        let delays = ExponentialBuilder::default()
            .with_min_delay(RETRY_FIRST)
            .with_max_delay(RETRY_MAX)
            .without_max_times();
        (|| self.attempt(method, &f))
            .retry(delays)
            .sleep(tokio::time::sleep)
            .when(|failed| failed.retry)
            .adjust(|_, delay| delay.filter(|d| tokio::time::Instant::now() + *d <= deadline))
            .notify(|failed, _| {
                tracing::debug!(error = %failed.error, "master unavailable, retrying");
            })
            .await
            .map_err(|failed| failed.error)
    }

    /// One try of [`Self::call`]; a failure says whether another connection may succeed.
    async fn attempt<T, F, Fut>(&self, method: &'static str, f: &F) -> Result<T, Failed>
    where
        F: Fn(GrpcClient) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let retry = |error| Failed { error, retry: true };
        match self.connection().await {
            Ok((addr, client)) => match f(client).await {
                Ok(r) => Ok(r.into_inner()),
                Err(s) if retryable(&s) => {
                    let hint = s
                        .metadata()
                        .get(LEADER_HEADER)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned)
                        .filter(|h| *h != addr);
                    self.fail_over(&addr, hint);
                    Err(retry(ClientError::Rpc { method, source: s }))
                }
                Err(s) => Err(Failed {
                    error: ClientError::Rpc { method, source: s },
                    retry: false,
                }),
            },
            Err(e) => {
                let mut c = self.conn.lock();
                c.addr = None;
                c.client = None;
                c.next = c.next.wrapping_add(1);
                Err(retry(e))
            }
        }
    }
}

/// The first delay before a call is retried; each next one doubles, up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(50);
/// The longest delay between two tries of a call.
const RETRY_MAX: Duration = Duration::from_millis(500);

/// A failed try of a call, and whether to try again.
struct Failed {
    error: ClientError,
    retry: bool,
}

/// Calls worth retrying on another connection: the master is a standby or going away, or the
/// connection broke (a crashed leader). A retried mutating call may find its first attempt
/// applied (`put_start` then answers PUT_IN_PROGRESS, `remove` UNKNOWN_KEY).
fn retryable(s: &tonic::Status) -> bool {
    use std::error::Error as _;
    match s.code() {
        Code::Unavailable | Code::Cancelled => true,
        Code::Unknown => s
            .source()
            .is_some_and(|e| e.is::<tonic::transport::Error>()),
        _ => false,
    }
}

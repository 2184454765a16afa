//! Rust client of the master (agents, engines, the conductor): single and batched calls,
//! authenticated with the pool key, following the leader across master replicas, and nearest
//! replica choice. I/O boundary: gRPC channels to the masters.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tonic::Code;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use super::auth::{AuthKey, Signer};
use super::proto::{self, master_client::MasterClient as Grpc};
use super::service::LEADER_HEADER;
use super::types::{
    AdoptItem, PutOptions, PutStarted, ReplicaInfo, SegmentSpec, Spread, Task, Tier,
};

type GrpcClient = Grpc<InterceptedService<Channel, Signer>>;

/// Errors of the master client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("no master endpoint given")]
    NoEndpoints,
    #[error("invalid master endpoint {endpoint:?}")]
    Endpoint {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("cannot connect to master {endpoint}")]
    Connect {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("master call {method} failed")]
    Rpc {
        method: &'static str,
        #[source]
        source: tonic::Status,
    },
    #[error("master refused: {message} ({code:?})")]
    Refused {
        code: proto::ErrorCode,
        message: String,
    },
    #[error("malformed master answer: {0}")]
    Malformed(String),
}

impl ClientError {
    pub fn category(&self) -> &'static str {
        match self {
            ClientError::NoEndpoints => "no_endpoints",
            ClientError::Endpoint { .. } => "endpoint",
            ClientError::Connect { .. } => "connect",
            ClientError::Rpc { .. } => "rpc",
            ClientError::Refused { .. } => "refused",
            ClientError::Malformed(_) => "malformed",
        }
    }

    /// The master's error code when the master refused the item.
    pub fn code(&self) -> Option<proto::ErrorCode> {
        match self {
            ClientError::Refused { code, .. } => Some(*code),
            _ => None,
        }
    }
}

fn refused(e: proto::Error) -> ClientError {
    ClientError::Refused {
        code: proto::ErrorCode::try_from(e.code).unwrap_or(proto::ErrorCode::Unspecified),
        message: e.message,
    }
}

fn item(e: Option<proto::Error>) -> Result<(), ClientError> {
    e.map_or(Ok(()), |e| Err(refused(e)))
}

/// A read answer as the client sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Located {
    pub size: u64,
    pub replicas: Vec<ReplicaInfo>,
    pub lease_id: u64,
    /// Lease lifetime left when the master answered.
    pub lease_ttl: Duration,
}

/// Tunables of the client.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    /// Calls answered UNAVAILABLE (standby, restarting leader) are retried this long.
    pub failover_budget: Duration,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(10),
            failover_budget: Duration::from_secs(15),
        }
    }
}

#[derive(Debug, Default)]
struct Conn {
    /// Index into `endpoints` or an address learnt from a leader hint.
    addr: Option<String>,
    client: Option<GrpcClient>,
    next: usize,
}

/// Client of the master (cheap to clone; clones share the connection).
#[derive(Clone, Debug)]
pub struct MasterClient {
    endpoints: Arc<Vec<String>>,
    signer: Signer,
    config: ClientConfig,
    conn: Arc<Mutex<Conn>>,
}

fn uri(addr: &str) -> String {
    if addr.contains("://") {
        addr.to_owned()
    } else {
        format!("http://{addr}")
    }
}

impl MasterClient {
    /// A client for the given masters (`host:port` or URLs); connects on first use.
    pub fn new(
        endpoints: Vec<String>,
        key: AuthKey,
        config: ClientConfig,
    ) -> Result<Self, ClientError> {
        if endpoints.is_empty() {
            return Err(ClientError::NoEndpoints);
        }
        for e in &endpoints {
            Endpoint::from_shared(uri(e)).map_err(|source| ClientError::Endpoint {
                endpoint: e.clone(),
                source,
            })?;
        }
        Ok(Self {
            endpoints: Arc::new(endpoints),
            signer: Signer(key),
            config,
            conn: Arc::default(),
        })
    }

    async fn connection(&self) -> Result<(String, GrpcClient), ClientError> {
        let (addr, cached) = {
            let c = self.conn.lock();
            let addr = c.addr.clone().unwrap_or_else(|| {
                self.endpoints
                    .get(c.next % self.endpoints.len())
                    .cloned()
                    .unwrap_or_default()
            });
            (addr, c.client.clone())
        };
        if let Some(client) = cached {
            return Ok((addr, client));
        }
        let endpoint = Endpoint::from_shared(uri(&addr))
            .map_err(|source| ClientError::Endpoint {
                endpoint: addr.clone(),
                source,
            })?
            .connect_timeout(self.config.connect_timeout)
            .timeout(self.config.request_timeout)
            .tcp_nodelay(true);
        let channel = endpoint
            .connect()
            .await
            .map_err(|source| ClientError::Connect {
                endpoint: addr.clone(),
                source,
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

    /// The address the client currently talks to, if connected.
    pub fn current_endpoint(&self) -> Option<String> {
        self.conn.lock().addr.clone()
    }

    async fn call<T, F, Fut>(&self, method: &'static str, f: F) -> Result<T, ClientError>
    where
        F: Fn(GrpcClient) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let deadline = tokio::time::Instant::now() + self.config.failover_budget;
        let mut backoff = Duration::from_millis(50);
        loop {
            let attempt: Result<(), ClientError> = match self.connection().await {
                Ok((addr, client)) => match f(client).await {
                    Ok(r) => return Ok(r.into_inner()),
                    Err(s) if retryable(&s) => {
                        let hint = s
                            .metadata()
                            .get(LEADER_HEADER)
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_owned)
                            .filter(|h| *h != addr);
                        self.fail_over(&addr, hint);
                        Err(ClientError::Rpc { method, source: s })
                    }
                    Err(s) => return Err(ClientError::Rpc { method, source: s }),
                },
                Err(e) => {
                    let mut c = self.conn.lock();
                    c.addr = None;
                    c.client = None;
                    c.next = c.next.wrapping_add(1);
                    Err(e)
                }
            };
            if let Err(e) = attempt {
                if tokio::time::Instant::now() + backoff > deadline {
                    return Err(e);
                }
                tracing::debug!(error = %e, "master unavailable, retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
        }
    }

    // ----- agents ------------------------------------------------------------------------

    pub async fn mount_segment(&self, spec: &SegmentSpec) -> Result<u32, ClientError> {
        let req = proto::MountSegmentRequest {
            segment: Some(spec.into()),
        };
        let r = self
            .call("mount_segment", |mut c| {
                let req = req.clone();
                async move { c.mount_segment(req).await }
            })
            .await?;
        Ok(r.segment_id)
    }

    pub async fn unmount_segment(&self, node: &str, segment_id: u32) -> Result<(), ClientError> {
        let req = proto::UnmountSegmentRequest {
            node: node.to_owned(),
            segment_id,
        };
        self.call("unmount_segment", |mut c| {
            let req = req.clone();
            async move { c.unmount_segment(req).await }
        })
        .await?;
        Ok(())
    }

    /// Heartbeat; returns the tasks the master queued for this node.
    pub async fn heartbeat(&self, node: &str) -> Result<Vec<Task>, ClientError> {
        let req = proto::HeartbeatRequest {
            node: node.to_owned(),
            ..Default::default()
        };
        let r = self
            .call("heartbeat", |mut c| {
                let req = req.clone();
                async move { c.heartbeat(req).await }
            })
            .await?;
        tasks_of(&r)
    }

    pub async fn complete_task(
        &self,
        node: &str,
        task_id: u64,
        ok: bool,
    ) -> Result<(), ClientError> {
        let req = proto::CompleteTaskRequest {
            node: node.to_owned(),
            task_id,
            ok,
        };
        self.call("complete_task", |mut c| {
            let req = req.clone();
            async move { c.complete_task(req).await }
        })
        .await?;
        Ok(())
    }

    /// Announce replicas this node holds in its mounted segment `segment_id` (after a
    /// restart); one result per item, in order.
    pub async fn adopt_replicas(
        &self,
        node: &str,
        segment_id: u32,
        items: &[AdoptItem],
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        let req = proto::AdoptReplicasRequest {
            node: node.to_owned(),
            segment_id,
            items: items
                .iter()
                .map(|i| proto::AdoptItem {
                    key_digest: i.key.to_hex(),
                    offset: i.offset,
                    length: i.length,
                })
                .collect(),
        };
        let r = self
            .call("adopt_replicas", |mut c| {
                let req = req.clone();
                async move { c.adopt_replicas(req).await }
            })
            .await?;
        expect_len(r.results.len(), items.len())?;
        Ok(r.results.into_iter().map(|i| item(i.error)).collect())
    }

    // ----- objects -----------------------------------------------------------------------

    /// Start puts of `(key, size)` items; one result per item.
    pub async fn put_start_batch(
        &self,
        items: &[(&[u8], u64)],
        opts: &PutOptions,
    ) -> Result<Vec<Result<PutStarted, ClientError>>, ClientError> {
        let req = proto::PutStartRequest {
            items: items
                .iter()
                .map(|(k, size)| proto::PutItem {
                    key: k.to_vec(),
                    size: *size,
                })
                .collect(),
            replicas: u32::from(opts.replicas),
            writer_node: opts.writer_node.clone().unwrap_or_default(),
            numa_hint: opts.numa_hint,
            spread: match opts.spread {
                Spread::Node => proto::Spread::Node,
                Spread::FailureDomain => proto::Spread::FailureDomain,
            } as i32,
            tier: opts.tier.map(|t| proto::Tier::from(t) as i32),
        };
        let r = self
            .call("put_start", |mut c| {
                let req = req.clone();
                async move { c.put_start(req).await }
            })
            .await?;
        expect_len(r.results.len(), items.len())?;
        Ok(r.results
            .into_iter()
            .map(|res| {
                if let Some(e) = res.error {
                    return Err(refused(e));
                }
                if res.already_committed {
                    return Ok(PutStarted::AlreadyCommitted { size: 0 });
                }
                let replicas = res
                    .replicas
                    .iter()
                    .map(|r| {
                        r.to_info()
                            .ok_or_else(|| ClientError::Malformed("replica tier".into()))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(PutStarted::Allocated {
                    put_id: res.put_id,
                    replicas,
                })
            })
            .collect())
    }

    pub async fn put_start(
        &self,
        key: &[u8],
        size: u64,
        opts: &PutOptions,
    ) -> Result<PutStarted, ClientError> {
        let mut r = self.put_start_batch(&[(key, size)], opts).await?;
        match r.pop() {
            Some(Ok(PutStarted::AlreadyCommitted { .. })) => {
                Ok(PutStarted::AlreadyCommitted { size })
            }
            Some(other) => other,
            None => Err(ClientError::Malformed("empty answer".into())),
        }
    }

    async fn end_batch(
        &self,
        items: &[(&[u8], u64)],
        commit: bool,
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        let req = proto::PutEndRequest {
            items: items
                .iter()
                .map(|(k, id)| proto::PutEndItem {
                    key: k.to_vec(),
                    put_id: *id,
                })
                .collect(),
        };
        let method = if commit { "put_end" } else { "put_revoke" };
        let r = self
            .call(method, |mut c| {
                let req = req.clone();
                async move {
                    if commit {
                        c.put_end(req).await
                    } else {
                        c.put_revoke(req).await
                    }
                }
            })
            .await?;
        expect_len(r.results.len(), items.len())?;
        Ok(r.results.into_iter().map(|i| item(i.error)).collect())
    }

    /// Commit puts of `(key, put_id)` items.
    pub async fn put_end_batch(
        &self,
        items: &[(&[u8], u64)],
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        self.end_batch(items, true).await
    }

    pub async fn put_end(&self, key: &[u8], put_id: u64) -> Result<(), ClientError> {
        first(self.put_end_batch(&[(key, put_id)]).await?)
    }

    pub async fn put_revoke(&self, key: &[u8], put_id: u64) -> Result<(), ClientError> {
        first(self.end_batch(&[(key, put_id)], false).await?)
    }

    /// Locate keys, taking a read lease on each found one.
    pub async fn get_batch(
        &self,
        keys: &[&[u8]],
    ) -> Result<Vec<Result<Located, ClientError>>, ClientError> {
        let req = keys_req(keys);
        let r = self
            .call("get", |mut c| {
                let req = req.clone();
                async move { c.get(req).await }
            })
            .await?;
        expect_len(r.results.len(), keys.len())?;
        Ok(r.results
            .into_iter()
            .map(|g| {
                if let Some(e) = g.error {
                    return Err(refused(e));
                }
                let replicas = g
                    .replicas
                    .iter()
                    .map(|r| {
                        r.to_info()
                            .ok_or_else(|| ClientError::Malformed("replica tier".into()))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Located {
                    size: g.size,
                    replicas,
                    lease_id: g.lease_id,
                    lease_ttl: Duration::from_millis(g.lease_ttl_ms),
                })
            })
            .collect())
    }

    pub async fn get(&self, key: &[u8]) -> Result<Located, ClientError> {
        first(self.get_batch(&[key]).await?)
    }

    pub async fn release_leases(
        &self,
        ids: &[u64],
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        let req = proto::ReleaseLeasesRequest {
            lease_ids: ids.to_vec(),
        };
        let r = self
            .call("release_leases", |mut c| {
                let req = req.clone();
                async move { c.release_leases(req).await }
            })
            .await?;
        expect_len(r.results.len(), ids.len())?;
        Ok(r.results.into_iter().map(|i| item(i.error)).collect())
    }

    pub async fn release_lease(&self, id: u64) -> Result<(), ClientError> {
        first(self.release_leases(&[id]).await?)
    }

    pub async fn exists(&self, keys: &[&[u8]]) -> Result<Vec<bool>, ClientError> {
        let req = keys_req(keys);
        let r = self
            .call("exists", |mut c| {
                let req = req.clone();
                async move { c.exists(req).await }
            })
            .await?;
        expect_len(r.exists.len(), keys.len())?;
        Ok(r.exists)
    }

    /// Number of leading keys that are cached.
    pub async fn longest_prefix(&self, keys: &[&[u8]]) -> Result<usize, ClientError> {
        let req = keys_req(keys);
        let r = self
            .call("longest_prefix", |mut c| {
                let req = req.clone();
                async move { c.longest_prefix(req).await }
            })
            .await?;
        Ok(r.length as usize)
    }

    pub async fn remove_batch(
        &self,
        keys: &[&[u8]],
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        let req = keys_req(keys);
        let r = self
            .call("remove", |mut c| {
                let req = req.clone();
                async move { c.remove(req).await }
            })
            .await?;
        expect_len(r.results.len(), keys.len())?;
        Ok(r.results.into_iter().map(|i| item(i.error)).collect())
    }

    pub async fn remove(&self, key: &[u8]) -> Result<(), ClientError> {
        first(self.remove_batch(&[key]).await?)
    }

    /// Pin keys: `hard` never evicted; soft pins last `ttl` and are evicted last.
    pub async fn pin(
        &self,
        keys: &[&[u8]],
        hard: bool,
        ttl: Duration,
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        let req = proto::PinRequest {
            keys: keys.iter().map(|k| k.to_vec()).collect(),
            hard,
            ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
        };
        let r = self
            .call("pin", |mut c| {
                let req = req.clone();
                async move { c.pin(req).await }
            })
            .await?;
        expect_len(r.results.len(), keys.len())?;
        Ok(r.results.into_iter().map(|i| item(i.error)).collect())
    }

    pub async fn unpin(&self, keys: &[&[u8]]) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        let req = keys_req(keys);
        let r = self
            .call("unpin", |mut c| {
                let req = req.clone();
                async move { c.unpin(req).await }
            })
            .await?;
        expect_len(r.results.len(), keys.len())?;
        Ok(r.results.into_iter().map(|i| item(i.error)).collect())
    }

    pub async fn stats(&self) -> Result<proto::StatsResponse, ClientError> {
        self.call(
            "stats",
            |mut c| async move { c.stats(proto::Empty {}).await },
        )
        .await
    }

    /// Heartbeat with the segment-event feed (agent, issue 4): acknowledges the events applied
    /// up to `acked` under `epoch` and reports corrupt blocks; returns the queued tasks, the
    /// master's feed epoch and the pending events.
    pub async fn heartbeat_feed(
        &self,
        node: &str,
        epoch: u64,
        acked: u64,
        corrupt: &[crate::master::state::CorruptBlock],
    ) -> Result<crate::master::state::HeartbeatReply, ClientError> {
        // Other areas add their own heartbeat fields (transfer: 10 and up).
        #[allow(clippy::needless_update)]
        let req = proto::HeartbeatRequest {
            node: node.to_owned(),
            feed_epoch: epoch,
            feed_acked: acked,
            corrupt: corrupt
                .iter()
                .map(|c| proto::SegmentBlock {
                    segment_id: c.segment_id,
                    key_digest: c.key.to_hex(),
                    offset: c.offset,
                })
                .collect(),
            ..Default::default()
        };
        let r = self
            .call("heartbeat", |mut c| {
                let req = req.clone();
                async move { c.heartbeat(req).await }
            })
            .await?;
        let tasks = tasks_of(&r)?;
        let events = r
            .events
            .iter()
            .map(|e| {
                super::service::feed::event_from_proto(e)
                    .ok_or_else(|| ClientError::Malformed(format!("segment event {}", e.seq)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(crate::master::state::HeartbeatReply {
            tasks,
            feed_epoch: r.feed_epoch,
            events,
        })
    }
}

/// The tasks of a heartbeat answer; a malformed one fails the call.
fn tasks_of(r: &proto::HeartbeatResponse) -> Result<Vec<Task>, ClientError> {
    r.tasks
        .iter()
        .map(|t| {
            t.to_task()
                .ok_or_else(|| ClientError::Malformed(format!("task {}", t.id)))
        })
        .collect()
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

fn keys_req(keys: &[&[u8]]) -> proto::KeysRequest {
    proto::KeysRequest {
        keys: keys.iter().map(|k| k.to_vec()).collect(),
    }
}

fn expect_len(got: usize, want: usize) -> Result<(), ClientError> {
    if got == want {
        Ok(())
    } else {
        Err(ClientError::Malformed(format!(
            "{got} results for {want} items"
        )))
    }
}

fn first<T>(mut v: Vec<Result<T, ClientError>>) -> Result<T, ClientError> {
    v.pop()
        .unwrap_or_else(|| Err(ClientError::Malformed("empty answer".into())))
}

/// The replica to read: on `node` and `numa_node`, else on `node`, else the first DRAM one,
/// else the first.
pub fn pick_nearest<'a>(
    replicas: &'a [ReplicaInfo],
    node: &str,
    numa_node: Option<u32>,
) -> Option<&'a ReplicaInfo> {
    // `max_by_key` keeps the last of equal candidates; reversing keeps the master's order.
    replicas.iter().rev().max_by_key(|r| {
        let same_node = r.node == node;
        (
            same_node,
            same_node && numa_node == Some(r.numa_node),
            r.tier == Tier::Dram,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rep(node: &str, numa: u32, tier: Tier) -> ReplicaInfo {
        ReplicaInfo {
            node: node.into(),
            segment_id: 1,
            segment: "s".into(),
            tier,
            numa_node: numa,
            endpoints: vec![],
            offset: 0,
            length: 1,
        }
    }

    #[test]
    fn nearest_replica_prefers_node_then_numa_then_dram() {
        let reps = vec![
            rep("b", 0, Tier::Ssd),
            rep("c", 0, Tier::Dram),
            rep("a", 0, Tier::Dram),
            rep("a", 1, Tier::Dram),
        ];
        let pick =
            |n: &str, numa| pick_nearest(&reps, n, numa).map(|r| (r.node.clone(), r.numa_node));
        assert_eq!(pick("a", Some(1)), Some(("a".into(), 1)));
        assert_eq!(pick("a", Some(0)), Some(("a".into(), 0)));
        assert_eq!(pick("b", None), Some(("b".into(), 0)));
        assert_eq!(pick("z", None), Some(("c".into(), 0)), "DRAM before SSD");
        assert_eq!(pick_nearest(&[], "a", None), None);
    }

    #[test]
    fn bad_endpoints_are_refused_up_front() {
        let key = AuthKey::from_bytes(b"0123456789abcdef").expect("key");
        assert!(matches!(
            MasterClient::new(vec![], key.clone(), ClientConfig::default()),
            Err(ClientError::NoEndpoints)
        ));
        assert!(matches!(
            MasterClient::new(
                vec!["http://bad host:1".into()],
                key,
                ClientConfig::default()
            ),
            Err(ClientError::Endpoint { .. })
        ));
    }
}

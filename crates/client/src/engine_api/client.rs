//! Rust client of the agent's engine API, for engines written in Rust (the synthetic engine),
//! the agent's benchmark and the tests.
//! I/O boundary: the Unix socket connection and the mapped staging file.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

use super::shm::{ShmError, Staging};
use kvpool_proto::engine_api::engine_api_client::EngineApiClient;
use kvpool_proto::engine_api::{
    CloseSessionRequest, ExistsRequest, GetItem, GetRequest, OpenSessionRequest, PutItem,
    PutRequest, RemoveRequest, Status,
};

/// Errors of the client.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum ClientError {
    #[error("cannot connect to {path}")]
    Connect {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("engine API call {call} failed")]
    Call {
        call: &'static str,
        #[source]
        source: tonic::Status,
    },
    #[error("staging area")]
    Staging(#[source] ShmError),
    #[error("server answered {got} results for {sent} items")]
    Mismatch { sent: usize, got: usize },
}

impl ClientError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// Outcome of one get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GetOutcome {
    pub status: Status,
    pub length: u64,
}

fn status_of(code: i32) -> Status {
    Status::try_from(code).unwrap_or(Status::Unspecified)
}

/// The items of a batched request from `(key, offset, length or capacity)` triples.
fn blocks<T>(items: &[(&[u8], u64, u64)], item: impl Fn(Vec<u8>, u64, u64) -> T) -> Vec<T> {
    items
        .iter()
        .map(|(k, offset, len)| item(k.to_vec(), *offset, *len))
        .collect()
}

/// The item of a put: `length` bytes of the staging area at `offset`, stored under `key`.
fn put_item(key: Vec<u8>, offset: u64, length: u64) -> PutItem {
    PutItem {
        key,
        offset,
        length,
    }
}

/// The item of a get: the block of `key` into the staging area at `offset`, if it fits in
/// `capacity` bytes.
fn get_item(key: Vec<u8>, offset: u64, capacity: u64) -> GetItem {
    GetItem {
        key,
        offset,
        capacity,
    }
}

/// Keys as the request messages own them.
fn owned(keys: &[&[u8]]) -> Vec<Vec<u8>> {
    keys.iter().map(|k| k.to_vec()).collect()
}

/// A failed engine API call `call`.
/// The answer of the RPC `call`, or its failure.
async fn answer<T>(
    call: &'static str,
    rpc: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, ClientError> {
    rpc.await
        .map(tonic::Response::into_inner)
        .map_err(|source| ClientError::Call { call, source })
}

/// An answer must carry one result per item sent.
fn expect_len(sent: usize, got: usize) -> Result<(), ClientError> {
    if sent == got {
        Ok(())
    } else {
        Err(ClientError::Mismatch { sent, got })
    }
}

/// A gRPC channel to the agent's Unix socket (for callers that want the raw generated client).
pub async fn connect_channel(socket: &Path) -> Result<Channel, ClientError> {
    let path = socket.to_owned();
    // The URI is ignored: the connector always dials the Unix socket.
    Endpoint::from_static("http://agent.local")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
        .map_err(|source| ClientError::Connect {
            path: socket.to_owned(),
            source,
        })
}

/// Where an engine runs, told to the agent when its session opens so that the staging area
/// and the NICs are chosen near it. Default: nothing said (the agent chooses).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Locality {
    /// NUMA node of the engine's memory.
    pub numa_node: Option<u32>,
    /// PCI bus id of the engine's GPU (`0000:18:00.0`).
    pub gpu_pci_bus_id: Option<String>,
}

/// What the agent chose for a session.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionPlacement {
    /// NUMA node the staging area is bound to (verified); `None`: not bound.
    pub numa_node: Option<u32>,
    /// RDMA NICs on that node, best first.
    pub nics: Vec<String>,
}

/// A connected client with an open session.
#[derive(Debug)]
pub struct EngineClient {
    rpc: EngineApiClient<Channel>,
    session: u64,
    staging: Staging,
    placement: SessionPlacement,
}

impl EngineClient {
    /// Connect to the agent's socket and open a session with `staging_bytes` of shared memory.
    pub async fn connect(
        socket: &Path,
        staging_bytes: u64,
        client_name: &str,
    ) -> Result<Self, ClientError> {
        Self::connect_near(socket, staging_bytes, client_name, &Locality::default()).await
    }

    /// [`Self::connect`], telling the agent where the engine runs: it binds the staging area to
    /// that NUMA node and names the NICs there ([`Self::placement`]).
    pub async fn connect_near(
        socket: &Path,
        staging_bytes: u64,
        client_name: &str,
        locality: &Locality,
    ) -> Result<Self, ClientError> {
        let channel = connect_channel(socket).await?;
        let mut rpc = EngineApiClient::new(channel)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20);
        let open = OpenSessionRequest {
            staging_bytes,
            client_name: client_name.to_owned(),
            numa_node: locality.numa_node,
            gpu_pci_bus_id: locality.gpu_pci_bus_id.clone().unwrap_or_default(),
        };
        let opened = answer("open_session", rpc.open_session(open)).await?;
        let staging = Staging::open(Path::new(&opened.staging_path), opened.staging_bytes)
            .map_err(ClientError::Staging)?;
        Ok(Self {
            rpc,
            session: opened.session_id,
            staging,
            placement: SessionPlacement {
                numa_node: opened.numa_node,
                nics: opened.nics,
            },
        })
    }

    /// Where the agent put this session (NUMA node of the staging area, NICs there).
    pub fn placement(&self) -> &SessionPlacement {
        &self.placement
    }

    /// The shared staging area.
    pub fn staging(&self) -> &Staging {
        &self.staging
    }

    /// Store blocks already written into the staging area: `(key, offset, length)`.
    pub async fn put_batch(
        &mut self,
        items: &[(&[u8], u64, u64)],
        numa_hint: Option<u32>,
    ) -> Result<Vec<Status>, ClientError> {
        let req = PutRequest {
            session_id: self.session,
            items: blocks(items, put_item),
            numa_hint,
        };
        let resp = answer("put", self.rpc.put(req)).await?;
        expect_len(items.len(), resp.statuses.len())?;
        Ok(resp.statuses.into_iter().map(status_of).collect())
    }

    /// Fetch blocks into the staging area: `(key, offset, capacity)`.
    pub async fn get_batch(
        &mut self,
        items: &[(&[u8], u64, u64)],
    ) -> Result<Vec<GetOutcome>, ClientError> {
        let req = GetRequest {
            session_id: self.session,
            items: blocks(items, get_item),
        };
        let resp = answer("get", self.rpc.get(req)).await?;
        expect_len(items.len(), resp.results.len())?;
        Ok(resp
            .results
            .into_iter()
            .map(|r| GetOutcome {
                status: status_of(r.status),
                length: r.length,
            })
            .collect())
    }

    /// Store one block (copied through the start of the staging area).
    pub async fn put(&mut self, key: &[u8], data: &[u8]) -> Result<Status, ClientError> {
        self.staging
            .write_from(0, data)
            .map_err(ClientError::Staging)?;
        let statuses = self.put_batch(&[(key, 0, data.len() as u64)], None).await?;
        Ok(statuses.first().copied().unwrap_or(Status::Unspecified))
    }

    /// Fetch one block (through the start of the staging area); None when absent.
    pub async fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, ClientError> {
        let cap = self.staging.size();
        let out = self.get_batch(&[(key, 0, cap)]).await?;
        match out.first() {
            Some(GetOutcome {
                status: Status::Ok,
                length,
            }) => {
                let mut buf = vec![0u8; usize::try_from(*length).unwrap_or(0)];
                self.staging
                    .read_into(0, &mut buf)
                    .map_err(ClientError::Staging)?;
                Ok(Some(buf))
            }
            _ => Ok(None),
        }
    }

    pub async fn exists(&mut self, keys: &[&[u8]]) -> Result<Vec<bool>, ClientError> {
        let req = ExistsRequest { keys: owned(keys) };
        Ok(answer("exists", self.rpc.exists(req)).await?.present)
    }

    pub async fn remove(&mut self, keys: &[&[u8]]) -> Result<Vec<bool>, ClientError> {
        let req = RemoveRequest { keys: owned(keys) };
        Ok(answer("remove", self.rpc.remove(req)).await?.removed)
    }

    /// Close the session; the agent removes the staging file.
    pub async fn close(mut self) -> Result<(), ClientError> {
        let close = CloseSessionRequest {
            session_id: self.session,
        };
        answer("close_session", self.rpc.close_session(close)).await?;
        Ok(())
    }
}

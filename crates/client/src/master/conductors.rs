//! The conductors' call: a conductor replica reports the load it has booked on each engine and
//! gets back what the other replicas booked (`ShareLoad`, docs/adr/0010-conductor-replicas-share-bookings.md).
//! I/O boundary: the master's gRPC channel, through [`MasterClient::call`].

use std::time::Duration;

use super::MasterClient;
use super::error::ClientError;
use kvpool_proto::master as proto;

impl MasterClient {
    /// Reports `engines` as the bookings of conductor replica `conductor`, counted for `ttl`;
    /// answers the other live replicas' bookings, summed per engine.
    pub async fn share_load(
        &self,
        conductor: &str,
        engines: Vec<proto::EngineLoad>,
        ttl: Duration,
    ) -> Result<proto::ShareLoadResponse, ClientError> {
        let req = proto::ShareLoadRequest {
            conductor: conductor.to_owned(),
            engines,
            ttl_ms: u32::try_from(ttl.as_millis()).unwrap_or(u32::MAX),
        };
        rpc!(self, share_load, req)
    }

    /// Asks for at least `replicas` copies of each of `keys` for `ttl` (hot blocks); one
    /// result per key (an unknown key is an error of its own).
    pub async fn replicate_hot(
        &self,
        keys: &[&[u8]],
        replicas: u8,
        ttl: Duration,
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        let req = proto::ReplicateHotRequest {
            keys: keys.iter().map(|k| k.to_vec()).collect(),
            replicas: u32::from(replicas),
            ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
        };
        super::answers::item_results(rpc!(self, replicate_hot, req)?, keys.len())
    }
}

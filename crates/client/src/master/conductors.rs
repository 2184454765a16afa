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
}

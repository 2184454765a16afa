//! The calls about what the pool holds: existence, cached prefixes, removal, pins, and the
//! master's stats. I/O boundary: the master's gRPC channel, through [`MasterClient::call`].

use std::time::Duration;

use super::MasterClient;
use super::answers::{expect_len, first, item_results};
use super::error::ClientError;
use kvpool_proto::master as proto;

impl MasterClient {
    pub async fn exists(&self, keys: &[&[u8]]) -> Result<Vec<bool>, ClientError> {
        let r = rpc!(self, exists, keys_req(keys))?;
        expect_len(r.exists.len(), keys.len())?;
        Ok(r.exists)
    }

    /// Number of leading keys that are cached.
    pub async fn longest_prefix(&self, keys: &[&[u8]]) -> Result<usize, ClientError> {
        Ok(rpc!(self, longest_prefix, keys_req(keys))?.length as usize)
    }

    /// Remove keys. Leases this client released in the background are flushed first, so that
    /// its own finished reads never make the master refuse the remove.
    pub async fn remove_batch(
        &self,
        keys: &[&[u8]],
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        self.flush_releases().await;
        item_results(rpc!(self, remove, keys_req(keys))?, keys.len())
    }

    pub async fn remove(&self, key: &[u8]) -> Result<(), ClientError> {
        first(self.remove_batch(&[key]).await?)
    }

    /// Remove every object no reader holds a lease on; how many were removed.
    pub async fn remove_all(&self) -> Result<u64, ClientError> {
        self.flush_releases().await;
        Ok(rpc!(self, remove_all, proto::Empty {})?.removed)
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
        item_results(rpc!(self, pin, req)?, keys.len())
    }

    pub async fn unpin(&self, keys: &[&[u8]]) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        item_results(rpc!(self, unpin, keys_req(keys))?, keys.len())
    }

    pub async fn stats(&self) -> Result<proto::StatsResponse, ClientError> {
        rpc!(self, stats, proto::Empty {})
    }
}

fn keys_req(keys: &[&[u8]]) -> proto::KeysRequest {
    proto::KeysRequest {
        keys: keys.iter().map(|k| k.to_vec()).collect(),
    }
}

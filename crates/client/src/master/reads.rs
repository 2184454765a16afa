//! The calls of a read: `get` (locate keys, taking a read lease on each found one) and lease
//! releases, batched or single, the single ones coalesced (see `coalesce`), releases also left
//! to a background sender. I/O boundary: the master's gRPC channel, through
//! [`MasterClient::call`].

use std::time::Instant;

use super::MasterClient;
use super::answers::{Located, expect_len, item_results, located};
use super::coalesce::{BatchOp, Batchers, Coalescer};
use super::error::ClientError;
use super::fast;
use kvpool_proto::master as proto;

impl MasterClient {
    /// Locate keys in one call, taking a read lease on each found one.
    pub async fn get_batch(
        &self,
        keys: &[&[u8]],
    ) -> Result<Vec<Result<Located, ClientError>>, ClientError> {
        self.get_owned(keys.iter().map(|k| k.to_vec()).collect())
            .await
    }

    async fn get_owned(
        &self,
        keys: Vec<Vec<u8>>,
    ) -> Result<Vec<Result<Located, ClientError>>, ClientError> {
        let n = keys.len();
        // Taken before the call: the lease ends no earlier than this plus its TTL.
        let sent = Instant::now();
        let r = rpc!(self, get, proto::KeysRequest { keys })?;
        expect_len(r.results.len(), n)?;
        Ok(r.results.into_iter().map(|g| located(g, sent)).collect())
    }

    /// Locate one key with a read lease. Concurrent calls share one `get` call.
    pub async fn get(&self, key: &[u8]) -> Result<Located, ClientError> {
        self.coalesced::<GetOp>(key.to_vec()).await
    }

    /// Release leases in one call; one result per lease.
    pub async fn release_leases(
        &self,
        ids: &[u64],
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        let req = proto::ReleaseLeasesRequest {
            lease_ids: ids.to_vec(),
        };
        item_results(rpc!(self, release_leases, req)?, ids.len())
    }

    /// Release one lease and wait for the answer. Concurrent calls share one call.
    pub async fn release_lease(&self, id: u64) -> Result<(), ClientError> {
        self.coalesced::<ReleaseOp>(id).await
    }

    /// Release a lease in the background: queued releases go to the master in batches, one
    /// call at a time, and a failed release is left to the lease's TTL. The caller must not
    /// touch the leased replicas any more. [`Self::flush_releases`] waits for the queue. Called
    /// outside a tokio runtime, the release leaves with the next call made from one.
    pub fn release_lease_later(&self, id: u64) {
        if let (Some(lane), Some(p)) = (&self.fast, &self.parent)
            && lane.defer_release(id, p)
        {
            return;
        }
        self.release_via_parent(id);
    }

    /// A fork's release through its parent, on the parent's runtime; a root's into its own
    /// queue.
    pub(super) fn release_via_parent(&self, id: u64) {
        match &self.parent {
            Some(p) => {
                let (parent, runtime) = &**p;
                let _on = runtime.enter();
                parent.release_lease_later(id);
            }
            None => drop(self.enqueue::<ReleaseOp>(id, false)),
        }
    }

    /// Wait until every lease release queued so far (by this client, its clones and every fork
    /// of their root, whose lanes may still hold releases for their next call) was sent and
    /// answered: a remove after a read on another thread must not find that read's lease.
    pub async fn flush_releases(&self) {
        let root = self.parent.as_ref().map_or(self, |p| &p.0);
        for id in fast::take_all_pending(&root.batch.lanes) {
            self.release_via_parent(id);
        }
        ReleaseOp::queue(&root.batch).idle().await;
    }
}

struct GetOp;
struct ReleaseOp;

impl BatchOp for GetOp {
    type Item = Vec<u8>;
    type Out = Located;
    const METHOD: &'static str = "get";
    fn queue(b: &Batchers) -> &Coalescer<Vec<u8>, Located> {
        &b.get
    }
    async fn send(
        client: &MasterClient,
        keys: Vec<Vec<u8>>,
    ) -> Result<Vec<Result<Located, ClientError>>, ClientError> {
        client.get_owned(keys).await
    }
    /// Nobody will read: give the lease back.
    fn orphaned(client: &MasterClient, out: Located) {
        client.release_lease_later(out.lease_id);
    }
}

impl BatchOp for ReleaseOp {
    type Item = u64;
    type Out = ();
    const METHOD: &'static str = "release_leases";
    fn queue(b: &Batchers) -> &Coalescer<u64, ()> {
        &b.release
    }
    async fn send(
        client: &MasterClient,
        ids: Vec<u64>,
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        client.release_leases(&ids).await
    }
}

//! The calls of a put: `put_start` (allocate replicas), `put_end` (commit) and `put_revoke`,
//! batched or single, the single ones coalesced (see `coalesce`). I/O boundary: the master's
//! gRPC channel, through [`MasterClient::call`].

use super::MasterClient;
use super::answers::{expect_len, first, item_results, put_started};
use super::coalesce::{BatchOp, Batchers, Coalescer, Pending};
use super::error::ClientError;
use kvpool_core::master::types::{PutOptions, PutStarted, Spread};
use kvpool_proto::master::{self as proto, MAX_BATCH};

impl MasterClient {
    /// Start puts of `(key, size)` items in one call; one result per item.
    pub async fn put_start_batch(
        &self,
        items: &[(&[u8], u64)],
        opts: &PutOptions,
    ) -> Result<Vec<Result<PutStarted, ClientError>>, ClientError> {
        self.put_start_owned(
            items.iter().map(|(k, size)| (k.to_vec(), *size)),
            items.len(),
            opts,
        )
        .await
    }

    async fn put_start_owned(
        &self,
        items: impl Iterator<Item = (Vec<u8>, u64)>,
        n: usize,
        opts: &PutOptions,
    ) -> Result<Vec<Result<PutStarted, ClientError>>, ClientError> {
        let r = rpc!(self, put_start, put_start_request(items, opts))?;
        expect_len(r.results.len(), n)?;
        Ok(r.results.into_iter().map(put_started).collect())
    }

    /// Start one put. Concurrent calls with equal options share one `put_start` call.
    pub async fn put_start(
        &self,
        key: &[u8],
        size: u64,
        opts: &PutOptions,
    ) -> Result<PutStarted, ClientError> {
        match self
            .coalesced::<PutStartOp>((key.to_vec(), size, opts.clone()))
            .await?
        {
            PutStarted::AlreadyCommitted { .. } => Ok(PutStarted::AlreadyCommitted { size }),
            allocated => Ok(allocated),
        }
    }

    async fn end_batch(
        &self,
        items: Vec<proto::PutEndItem>,
        commit: bool,
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        let n = items.len();
        let req = proto::PutEndRequest { items };
        let r = if commit {
            rpc!(self, put_end, req)?
        } else {
            rpc!(self, put_revoke, req)?
        };
        item_results(r, n)
    }

    /// Commit puts of `(key, put_id)` items in one call.
    pub async fn put_end_batch(
        &self,
        items: &[(&[u8], u64)],
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        self.end_batch(
            end_items(items.iter().map(|(k, id)| (k.to_vec(), *id))),
            true,
        )
        .await
    }

    /// Commit one put. Concurrent calls share one `put_end` call.
    pub async fn put_end(&self, key: &[u8], put_id: u64) -> Result<(), ClientError> {
        self.coalesced::<PutEndOp>((key.to_vec(), put_id)).await
    }

    /// Abandon a put whose bytes may have been (partly) sent: the master holds its space back
    /// for its reuse delay, so that a write still on its way lands where no one reads.
    pub async fn put_revoke(&self, key: &[u8], put_id: u64) -> Result<(), ClientError> {
        first(
            self.end_batch(end_items([(key.to_vec(), put_id)]), false)
                .await?,
        )
    }

    /// Abandon puts of which no byte was sent anywhere (or only copied within this process,
    /// and finished): their space may be given out again at once.
    pub async fn put_revoke_unsent(
        &self,
        items: &[(&[u8], u64)],
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        let mut items = end_items(items.iter().map(|(k, id)| (k.to_vec(), *id)));
        for item in &mut items {
            item.unsent = true;
        }
        self.end_batch(items, false).await
    }
}

pub(super) struct PutStartOp;
struct PutEndOp;

impl BatchOp for PutStartOp {
    type Item = (Vec<u8>, u64, PutOptions);
    type Out = PutStarted;
    const METHOD: &'static str = "put_start";
    fn queue(b: &Batchers) -> &Coalescer<Self::Item, PutStarted> {
        &b.put_start
    }
    async fn send(
        client: &MasterClient,
        items: Vec<Self::Item>,
    ) -> Result<Vec<Result<PutStarted, ClientError>>, ClientError> {
        let n = items.len();
        let Some(opts) = items.first().map(|i| i.2.clone()) else {
            return Ok(Vec::new());
        };
        client
            .put_start_owned(items.into_iter().map(|(k, size, _)| (k, size)), n, &opts)
            .await
    }
    /// One call carries one set of options: the leading run of items that share them.
    fn take(
        items: &mut Vec<Pending<Self::Item, PutStarted>>,
    ) -> Vec<Pending<Self::Item, PutStarted>> {
        let same = match items.first() {
            Some(((_, _, opts), _)) => items
                .iter()
                .take(MAX_BATCH)
                .take_while(|((_, _, o), _)| o == opts)
                .count(),
            None => 0,
        };
        let rest = items.split_off(same);
        std::mem::replace(items, rest)
    }
}

impl BatchOp for PutEndOp {
    type Item = (Vec<u8>, u64);
    type Out = ();
    const METHOD: &'static str = "put_end";
    fn queue(b: &Batchers) -> &Coalescer<(Vec<u8>, u64), ()> {
        &b.put_end
    }
    async fn send(
        client: &MasterClient,
        items: Vec<(Vec<u8>, u64)>,
    ) -> Result<Vec<Result<(), ClientError>>, ClientError> {
        client.end_batch(end_items(items), true).await
    }
}

fn put_start_request(
    items: impl Iterator<Item = (Vec<u8>, u64)>,
    opts: &PutOptions,
) -> proto::PutStartRequest {
    proto::PutStartRequest {
        items: items
            .map(|(key, size)| proto::PutItem { key, size })
            .collect(),
        replicas: u32::from(opts.replicas),
        writer_node: opts.writer_node.clone().unwrap_or_default(),
        numa_hint: opts.numa_hint,
        spread: match opts.spread {
            Spread::Node => proto::Spread::Node,
            Spread::FailureDomain => proto::Spread::FailureDomain,
        } as i32,
        tier: opts.tier.map(|t| proto::Tier::from(t) as i32),
        avoid_nodes: opts.avoid_nodes.clone(),
        hard_pin: opts.hard_pin,
        soft_pin_ttl_ms: opts.soft_pin_ttl_ms,
    }
}

fn end_items(items: impl IntoIterator<Item = (Vec<u8>, u64)>) -> Vec<proto::PutEndItem> {
    items
        .into_iter()
        .map(|(key, put_id)| proto::PutEndItem {
            key,
            put_id,
            unsent: false,
        })
        .collect()
}

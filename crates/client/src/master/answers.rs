//! The master's answers as the client sees them: a located object with its read lease, started
//! puts, per-item results, and the checks every answer passes (one result per item, known
//! tiers). Pure.

use std::time::{Duration, Instant};

use super::error::{ClientError, refused};
use kvpool_core::master::types::{PutStarted, ReplicaInfo};
use kvpool_proto::master as proto;

/// Taken off a lease's lifetime as the client sees it: the master counts whole milliseconds.
pub const LEASE_MARGIN: Duration = Duration::from_millis(5);

/// A read answer as the client sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Located {
    pub size: u64,
    pub replicas: Vec<ReplicaInfo>,
    pub lease_id: u64,
    /// Lease lifetime left when the master answered.
    pub lease_ttl: Duration,
    /// Until when the lease surely holds (the call's start plus the TTL, less
    /// [`LEASE_MARGIN`]): a read that completes later may have raced eviction and must be
    /// discarded.
    pub lease_deadline: Instant,
}

impl Located {
    /// Whether the lease still surely holds.
    pub fn lease_held(&self) -> bool {
        Instant::now() < self.lease_deadline
    }
}

/// A get answer; `sent` is when the call left, so `sent + ttl` is no later than the master's
/// own expiry of the lease.
pub(super) fn located(g: proto::GetResult, sent: Instant) -> Result<Located, ClientError> {
    if let Some(e) = g.error {
        return Err(refused(e));
    }
    let ttl = Duration::from_millis(g.lease_ttl_ms);
    Ok(Located {
        size: g.size,
        replicas: replica_infos(&g.replicas)?,
        lease_id: g.lease_id,
        lease_ttl: ttl,
        lease_deadline: sent + ttl.saturating_sub(LEASE_MARGIN),
    })
}

pub(super) fn put_started(res: proto::PutStartResult) -> Result<PutStarted, ClientError> {
    if let Some(e) = res.error {
        return Err(refused(e));
    }
    if res.already_committed {
        return Ok(PutStarted::AlreadyCommitted { size: 0 });
    }
    Ok(PutStarted::Allocated {
        put_id: res.put_id,
        replicas: replica_infos(&res.replicas)?,
    })
}

fn replica_infos(replicas: &[proto::Replica]) -> Result<Vec<ReplicaInfo>, ClientError> {
    replicas
        .iter()
        .map(|r| {
            r.to_info()
                .ok_or_else(|| ClientError::Malformed("replica tier".into()))
        })
        .collect()
}

/// One result per item, in order; a refused item is [`ClientError::Refused`].
pub(super) fn item_results(
    r: proto::ItemResults,
    want: usize,
) -> Result<Vec<Result<(), ClientError>>, ClientError> {
    expect_len(r.results.len(), want)?;
    Ok(r.results
        .into_iter()
        .map(|i| i.error.map_or(Ok(()), |e| Err(refused(e))))
        .collect())
}

/// An answer with `got` results for `want` items is malformed unless they are equal.
pub(super) fn expect_len(got: usize, want: usize) -> Result<(), ClientError> {
    if got == want {
        Ok(())
    } else {
        Err(ClientError::Malformed(format!(
            "{got} results for {want} items"
        )))
    }
}

/// The result of a call made for one item.
pub(super) fn first<T>(mut v: Vec<Result<T, ClientError>>) -> Result<T, ClientError> {
    v.pop()
        .unwrap_or_else(|| Err(ClientError::Malformed("empty answer".into())))
}

//! Handlers of the object calls engines and agents make: puts (start, end, revoke), gets with
//! read leases and their release, existence and cached prefixes, removal and pins. I/O
//! boundary: none here (the state behind [`Core`]).

use tonic::Status;

use super::batch::{Answer, check_batch, err, invalid, item_results, keys_of};
use super::core::Core;
use crate::metrics::LookupCall;
use kvpool_core::master::state::{MasterError, MasterState};
use kvpool_core::master::types::{GetResult, ObjectKey, PutOptions, PutStarted, Spread};
use kvpool_proto::master as proto;

pub(super) async fn put_start(
    core: &Core,
    req: proto::PutStartRequest,
) -> Result<Answer<proto::PutStartResponse>, Status> {
    check_batch(req.items.len())?;
    let opts = put_options(&req)?;
    let keys: Vec<Vec<u8>> = req.items.iter().map(|i| i.key.clone()).collect();
    let keys = keys_of(&keys)?;
    let results = core
        .mutate(|st| {
            keys.iter()
                .zip(&req.items)
                .map(|(k, item)| {
                    let started = st.put_start(*k, item.size, &opts);
                    // The pool's block events name the object by its key.
                    st.name_object(*k, &item.key);
                    started
                })
                .collect::<Vec<_>>()
        })
        .await?;
    let message = proto::PutStartResponse {
        results: results.iter().map(put_start_result).collect(),
    };
    Ok(Answer::items(&results, message))
}

/// The options of a `put_start` request.
fn put_options(req: &proto::PutStartRequest) -> Result<PutOptions, Status> {
    let replicas = u8::try_from(req.replicas)
        .map_err(|_| invalid(format!("replicas {} out of range", req.replicas)))?;
    let spread = match proto::Spread::try_from(req.spread) {
        Ok(proto::Spread::Node) => Spread::Node,
        Ok(proto::Spread::FailureDomain) => Spread::FailureDomain,
        Err(_) => return Err(invalid(format!("unknown spread {}", req.spread))),
    };
    let tier = match req.tier {
        Some(t) => {
            Some(proto::tier_from_i32(t).ok_or_else(|| invalid(format!("unknown tier {t}")))?)
        }
        None => None,
    };
    Ok(PutOptions {
        replicas,
        writer_node: (!req.writer_node.is_empty()).then(|| req.writer_node.clone()),
        numa_hint: req.numa_hint,
        spread,
        tier,
        avoid_nodes: req.avoid_nodes.clone(),
        hard_pin: req.hard_pin,
        soft_pin_ttl_ms: req.soft_pin_ttl_ms,
    })
}

fn put_start_result(r: &Result<PutStarted, MasterError>) -> proto::PutStartResult {
    match r {
        Ok(PutStarted::Allocated { put_id, replicas }) => proto::PutStartResult {
            error: None,
            already_committed: false,
            put_id: *put_id,
            replicas: replicas.iter().map(Into::into).collect(),
        },
        Ok(PutStarted::AlreadyCommitted { .. }) => proto::PutStartResult {
            already_committed: true,
            ..Default::default()
        },
        Err(e) => proto::PutStartResult {
            error: err(e),
            ..Default::default()
        },
    }
}

pub(super) async fn put_end(
    core: &Core,
    req: proto::PutEndRequest,
) -> Result<Answer<proto::ItemResults>, Status> {
    end_or_revoke(core, req, true).await
}

pub(super) async fn put_revoke(
    core: &Core,
    req: proto::PutEndRequest,
) -> Result<Answer<proto::ItemResults>, Status> {
    end_or_revoke(core, req, false).await
}

/// `put_end` (`commit`) or `put_revoke` of every item of a batch, in one state mutation.
async fn end_or_revoke(
    core: &Core,
    req: proto::PutEndRequest,
    commit: bool,
) -> Result<Answer<proto::ItemResults>, Status> {
    let items = req.items;
    let raw: Vec<Vec<u8>> = items.iter().map(|i| i.key.clone()).collect();
    let keys = keys_of(&raw)?;
    let results = core
        .mutate(|st| {
            keys.iter()
                .zip(&items)
                .map(|(k, i)| {
                    if commit {
                        st.put_end(*k, i.put_id)
                    } else if i.unsent {
                        st.put_revoke_unsent(*k, i.put_id)
                    } else {
                        st.put_revoke(*k, i.put_id)
                    }
                })
                .collect::<Vec<_>>()
        })
        .await?;
    Ok(item_results(results))
}

pub(super) async fn get(
    core: &Core,
    req: proto::KeysRequest,
) -> Result<Answer<proto::GetResponse>, Status> {
    let keys = keys_of(&req.keys)?;
    // Leases and recency are not persisted: no need to wait for etcd.
    let (results, now) = core.mutate_unjournaled(|st| {
        let now = st.now_ms();
        (keys.iter().map(|k| st.get(*k)).collect::<Vec<_>>(), now)
    })?;
    let hits = results.iter().filter(|r| r.is_ok()).count() as u64;
    core.metrics
        .lookup(LookupCall::Get, hits, results.len() as u64 - hits);
    let message = proto::GetResponse {
        results: results.iter().map(|r| get_result(r, now)).collect(),
    };
    Ok(Answer::items(&results, message))
}

/// A get's answer for one key; the lease's TTL counts from `now` (the master's clock).
fn get_result(r: &Result<GetResult, MasterError>, now: u64) -> proto::GetResult {
    match r {
        Ok(g) => proto::GetResult {
            error: None,
            size: g.size,
            replicas: g.replicas.iter().map(Into::into).collect(),
            lease_id: g.lease.id,
            lease_ttl_ms: g.lease.expires_ms.saturating_sub(now),
        },
        Err(e) => proto::GetResult {
            error: err(e),
            ..Default::default()
        },
    }
}

pub(super) async fn release_leases(
    core: &Core,
    req: proto::ReleaseLeasesRequest,
) -> Result<Answer<proto::ItemResults>, Status> {
    let ids = req.lease_ids;
    check_batch(ids.len())?;
    let results: Vec<Result<u64, MasterError>> =
        core.mutate_unjournaled(|st| ids.iter().map(|id| st.release_lease(*id)).collect())?;
    core.metrics.lease_holds(
        results.iter().filter_map(|r| r.as_ref().ok().copied()),
        false,
    );
    Ok(item_results(
        results.into_iter().map(|r| r.map(|_| ())).collect(),
    ))
}

pub(super) async fn exists(
    core: &Core,
    req: proto::KeysRequest,
) -> Result<Answer<proto::ExistsResponse>, Status> {
    let keys = keys_of(&req.keys)?;
    let exists = core.read(|st| st.exists(&keys))?;
    let hits = exists.iter().filter(|e| **e).count() as u64;
    core.metrics
        .lookup(LookupCall::Exists, hits, exists.len() as u64 - hits);
    Ok(Answer::plain(proto::ExistsResponse { exists }))
}

pub(super) async fn longest_prefix(
    core: &Core,
    req: proto::KeysRequest,
) -> Result<Answer<proto::LongestPrefixResponse>, Status> {
    let keys = keys_of(&req.keys)?;
    let n = core.read(|st| st.longest_prefix(&keys))?;
    // The keys after the first missing one are of no use to a prefix cache: misses too.
    let asked = keys.len() as u64;
    let hits = (n as u64).min(asked);
    core.metrics
        .lookup(LookupCall::LongestPrefix, hits, asked - hits);
    Ok(Answer::plain(proto::LongestPrefixResponse {
        length: u32::try_from(n).unwrap_or(u32::MAX),
    }))
}

pub(super) async fn remove(
    core: &Core,
    req: proto::KeysRequest,
) -> Result<Answer<proto::ItemResults>, Status> {
    per_key(core, &req.keys, |st, k| st.remove(k)).await
}

pub(super) async fn remove_all(core: &Core) -> Result<Answer<proto::RemoveAllResponse>, Status> {
    let removed = core.mutate(|st| st.remove_all()).await?;
    Ok(Answer::plain(proto::RemoveAllResponse { removed }))
}

pub(super) async fn pin(
    core: &Core,
    req: proto::PinRequest,
) -> Result<Answer<proto::ItemResults>, Status> {
    let (hard, ttl_ms) = (req.hard, req.ttl_ms);
    per_key(core, &req.keys, move |st, k| st.pin(k, hard, ttl_ms)).await
}

/// Longest time one `ReplicateHot` may ask for.
const MAX_HOT_TTL_MS: u64 = 3_600_000;

pub(super) async fn replicate_hot(
    core: &Core,
    req: proto::ReplicateHotRequest,
) -> Result<Answer<proto::ItemResults>, Status> {
    let replicas = u8::try_from(req.replicas)
        .map_err(|_| invalid(format!("replicas {} out of range", req.replicas)))?;
    if req.ttl_ms > MAX_HOT_TTL_MS {
        return Err(invalid(format!(
            "ttl_ms {} is over an hour ({MAX_HOT_TTL_MS})",
            req.ttl_ms
        )));
    }
    let ttl_ms = req.ttl_ms;
    per_key(core, &req.keys, move |st, k| {
        st.replicate_hot(k, replicas, ttl_ms).map(|_| ())
    })
    .await
}

pub(super) async fn unpin(
    core: &Core,
    req: proto::KeysRequest,
) -> Result<Answer<proto::ItemResults>, Status> {
    per_key(core, &req.keys, |st, k| st.unpin(k)).await
}

/// Apply `op` to every key of a batch in one state mutation and answer per key: the shared
/// shape of `remove`, `pin` and `unpin`.
async fn per_key(
    core: &Core,
    raw_keys: &[Vec<u8>],
    op: impl Fn(&mut MasterState, ObjectKey) -> Result<(), MasterError> + Send,
) -> Result<Answer<proto::ItemResults>, Status> {
    let keys = keys_of(raw_keys)?;
    let results = core
        .mutate(|st| keys.iter().map(|k| op(st, *k)).collect::<Vec<_>>())
        .await?;
    Ok(item_results(results))
}

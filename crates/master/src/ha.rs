//! High availability through etcd: leader election on an etcd lease and write-through of the
//! metadata (segments, committed objects, reservations) so that a new leader rebuilds the
//! exact allocation state. I/O boundary: the etcd client.
//!
//! Writes are group-committed: each mutating call hands its journal to one writer task
//! through a bounded channel (in lock order) and waits for its batch; the writer packs
//! consecutive batches into etcd transactions fenced on the leader key's creation revision,
//! so a deposed leader can never write. Leases and recency are not persisted: a new leader
//! holds eviction for one lease TTL instead.

use kvpool_runtime::telemetry::chain;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, LeaderKey, ResignOptions, Txn, TxnOp,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::service::{Core, PersistBatch};
use kvpool_core::master::state::{JournalOp, ObjectRecord};
use kvpool_core::master::types::SegmentSpec;
use kvpool_runtime::admin::Readiness;

/// etcd transactions carry at most this many operations (etcd's default limit is 128).
const OPS_PER_TXN: usize = 120;
/// Persist batches queued at most (backpressure on mutating calls beyond this).
const QUEUE: usize = 1024;

/// HA settings.
#[derive(Debug, Clone)]
pub struct HaConfig {
    pub endpoints: Vec<String>,
    /// Key prefix of the pool, e.g. `/kvpool/default`.
    pub prefix: String,
    /// gRPC address of this master, published as the election value.
    pub advertise: String,
    pub election_ttl_secs: i64,
}

/// Errors of the HA layer.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum HaError {
    #[error("cannot grant an etcd lease")]
    Lease(#[source] etcd_client::Error),
    #[error("etcd answered the campaign without a leader key")]
    NoLeaderKey,
    #[error("loading state from etcd failed")]
    Load(#[source] etcd_client::Error),
    #[error("corrupt record {key:?} in etcd: {reason}")]
    Corrupt { key: String, reason: String },
    #[error("leadership lost (etcd lease expired, fenced write or etcd unreachable)")]
    LeadershipLost,
}

kvpool_runtime::error_category!(HaError);

fn seg_key(prefix: &str, id: u32) -> String {
    format!("{prefix}/seg/{id:010}")
}

fn obj_key(prefix: &str, key: &kvpool_core::master::types::ObjectKey) -> String {
    format!("{prefix}/obj/{}", key.to_hex())
}

fn rsv_key(prefix: &str, seg: u32, offset: u64) -> String {
    format!("{prefix}/rsv/{seg:010}/{offset:020}")
}

/// The etcd write for one journal entry: key and value (`None` deletes).
pub fn journal_write(prefix: &str, op: &JournalOp) -> (String, Option<Vec<u8>>) {
    match op {
        JournalOp::PutSegment(id, spec) => (
            seg_key(prefix, *id),
            Some(serde_json::to_vec(spec).unwrap_or_default()),
        ),
        JournalOp::DelSegment(id) => (seg_key(prefix, *id), None),
        JournalOp::PutObject(rec) => (
            obj_key(prefix, &rec.key),
            Some(serde_json::to_vec(rec).unwrap_or_default()),
        ),
        JournalOp::DelObject(key) => (obj_key(prefix, key), None),
        JournalOp::Reserve {
            seg,
            offset,
            length,
        } => (
            rsv_key(prefix, *seg, *offset),
            Some(length.to_string().into_bytes()),
        ),
        JournalOp::Unreserve { seg, offset } => (rsv_key(prefix, *seg, *offset), None),
        JournalOp::SegmentIdsUsed(n) => (
            format!("{prefix}/meta/segment-ids-used"),
            Some(n.to_string().into_bytes()),
        ),
    }
}

/// Everything a new leader loads.
#[derive(Debug, Default)]
pub struct Persisted {
    pub segments: Vec<(u32, SegmentSpec)>,
    pub objects: Vec<ObjectRecord>,
    pub reservations: Vec<(u32, u64, u64)>,
    /// Segment ids below this were handed out by earlier leaders.
    pub segment_ids_used: u32,
}

/// Parse the records under `prefix` (key, value pairs as etcd returns them).
pub fn parse_records(
    prefix: &str,
    kvs: impl IntoIterator<Item = (String, Vec<u8>)>,
) -> Result<Persisted, HaError> {
    let mut out = Persisted::default();
    for (key, value) in kvs {
        let corrupt = |reason: String| HaError::Corrupt {
            key: key.clone(),
            reason,
        };
        let Some(rest) = key.strip_prefix(prefix) else {
            continue;
        };
        if let Some(id) = rest.strip_prefix("/seg/") {
            let id: u32 = id.parse().map_err(|_| corrupt("segment id".into()))?;
            let spec: SegmentSpec =
                serde_json::from_slice(&value).map_err(|e| corrupt(e.to_string()))?;
            out.segments.push((id, spec));
        } else if rest.starts_with("/obj/") {
            let rec: ObjectRecord =
                serde_json::from_slice(&value).map_err(|e| corrupt(e.to_string()))?;
            out.objects.push(rec);
        } else if let Some(r) = rest.strip_prefix("/rsv/") {
            let (seg, offset) = r
                .split_once('/')
                .ok_or_else(|| corrupt("reservation key".into()))?;
            let seg: u32 = seg.parse().map_err(|_| corrupt("segment id".into()))?;
            let offset: u64 = offset.parse().map_err(|_| corrupt("offset".into()))?;
            let length: u64 = std::str::from_utf8(&value)
                .ok()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| corrupt("reservation length".into()))?;
            out.reservations.push((seg, offset, length));
        } else if rest == "/meta/segment-ids-used" {
            out.segment_ids_used = std::str::from_utf8(&value)
                .ok()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| corrupt("segment id high-water mark".into()))?;
        }
    }
    Ok(out)
}

fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

async fn load(client: &mut Client, prefix: &str) -> Result<Persisted, HaError> {
    let scan_prefix = format!("{prefix}/");
    let end = prefix_end(scan_prefix.as_bytes());
    let mut start = scan_prefix.as_bytes().to_vec();
    let mut kvs = Vec::new();
    loop {
        let r = client
            .get(
                start.clone(),
                Some(GetOptions::new().with_range(end.clone()).with_limit(2000)),
            )
            .await
            .map_err(HaError::Load)?;
        for kv in r.kvs() {
            kvs.push((
                String::from_utf8_lossy(kv.key()).into_owned(),
                kv.value().to_vec(),
            ));
        }
        match r.kvs().last() {
            Some(last) if r.more() => {
                start = last.key().to_vec();
                start.push(0);
            }
            _ => break,
        }
    }
    parse_records(prefix, kvs)
}

/// Deadline of every etcd request but the campaign.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// A client of `cfg`'s etcd, retried every second until `stop`. `request_timeout` bounds each
/// request; None leaves requests unbounded (the campaign, which blocks for as long as another
/// master leads), with HTTP/2 keep-alive pings so that a dead connection still ends them.
async fn connect(
    cfg: &HaConfig,
    stop: &CancellationToken,
    request_timeout: Option<Duration>,
) -> Option<Client> {
    let mut opts = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_keep_alive(Duration::from_secs(2), Duration::from_secs(4))
        .with_keep_alive_while_idle(true);
    if let Some(t) = request_timeout {
        opts = opts.with_timeout(t);
    }
    loop {
        match Client::connect(&cfg.endpoints, Some(opts.clone())).await {
            Ok(c) => return Some(c),
            Err(e) => {
                tracing::warn!(error = %chain(&e), endpoints = ?cfg.endpoints, "etcd unreachable, retrying")
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return None,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// Run the election until `stop`: campaign, take over as leader (load state, start the
/// writer), serve until stopped (resign) or leadership is lost (error: the process restarts).
pub async fn run(
    core: Arc<Core>,
    cfg: HaConfig,
    readiness: Readiness,
    stop: CancellationToken,
) -> Result<(), HaError> {
    let Some(mut client) = connect(&cfg, &stop, Some(REQUEST_TIMEOUT)).await else {
        return Ok(());
    };
    // Campaigning waits for as long as another master leads: its own client, no deadline.
    let Some(campaigner) = connect(&cfg, &stop, None).await else {
        return Ok(());
    };
    let lease = client
        .lease_grant(cfg.election_ttl_secs, None)
        .await
        .map_err(HaError::Lease)?
        .id();
    let lost = CancellationToken::new();
    let keepalive = {
        let mut client = client.clone();
        let lost = lost.clone();
        let every =
            Duration::from_millis(u64::try_from(cfg.election_ttl_secs).unwrap_or(2) * 1000 / 3);
        tokio::spawn(async move {
            let Ok((mut keeper, mut stream)) = client.lease_keep_alive(lease).await else {
                lost.cancel();
                return;
            };
            loop {
                if keeper.keep_alive().await.is_err() {
                    break;
                }
                match stream.message().await {
                    Ok(Some(r)) if r.ttl() > 0 => {}
                    _ => break,
                }
                tokio::select! {
                    _ = lost.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
            }
            tracing::error!("etcd lease keep-alive failed");
            lost.cancel();
        })
    };
    let election = format!("{}/election", cfg.prefix);
    let watcher = {
        let mut client = client.clone();
        let core = core.clone();
        let election = election.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            loop {
                if let Ok(r) = client.leader(election.clone()).await {
                    let addr = r
                        .kv()
                        .and_then(|kv| std::str::from_utf8(kv.value()).ok().map(str::to_owned));
                    core.role.set_leader_addr(addr);
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                }
            }
        })
    };
    let result = lead(
        &core,
        &cfg,
        &readiness,
        &stop,
        &lost,
        (&mut client, campaigner),
        lease,
        &election,
    )
    .await;
    core.role.set_leader(false);
    core.metrics.set_leader(false);
    core.set_persist(None);
    readiness.set_ready(false);
    watcher.abort();
    lost.cancel();
    keepalive.abort();
    let _ = client.lease_revoke(lease).await;
    result
}

#[allow(clippy::too_many_arguments)]
async fn lead(
    core: &Arc<Core>,
    cfg: &HaConfig,
    readiness: &Readiness,
    stop: &CancellationToken,
    lost: &CancellationToken,
    (client, mut campaigner): (&mut Client, Client),
    lease: i64,
    election: &str,
) -> Result<(), HaError> {
    tracing::info!(advertise = %cfg.advertise, "campaigning for master leadership");
    // A standby waits here while another master leads. A failed campaign (the connection to
    // etcd lost or reset) is tried again on the same lease: only losing the lease itself, or
    // being stopped, ends the wait.
    let won = loop {
        let failed = tokio::select! {
            r = campaigner.campaign(election, cfg.advertise.clone(), lease) => match r {
                Ok(won) => break won,
                Err(e) => e,
            },
            _ = stop.cancelled() => return Ok(()),
            _ = lost.cancelled() => return Err(HaError::LeadershipLost),
        };
        tracing::warn!(error = %chain(&failed), "campaign interrupted, campaigning again");
        tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            _ = lost.cancelled() => return Err(HaError::LeadershipLost),
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    };
    let leader_key = won.leader().cloned().ok_or(HaError::NoLeaderKey)?;
    let started = Instant::now();
    let persisted = load(client, &cfg.prefix).await?;
    let (segments, objects) = (persisted.segments.len(), persisted.objects.len());
    {
        let mut st = core.state.lock();
        let mut fresh = st.fresh();
        fresh.reserve_segment_ids(persisted.segment_ids_used);
        let skipped = fresh.restore(
            persisted.segments,
            persisted.objects,
            persisted.reservations,
        );
        fresh.enable_journal();
        *st = fresh;
        if skipped > 0 {
            tracing::warn!(skipped, "persisted records that no longer fit were skipped");
        }
    }
    let (tx, rx) = mpsc::channel(QUEUE);
    let writer = tokio::spawn(writer(
        client.clone(),
        cfg.prefix.clone(),
        leader_key.clone(),
        rx,
        core.clone(),
        lost.clone(),
    ));
    core.set_persist(Some(tx));
    core.role.set_leader_addr(Some(cfg.advertise.clone()));
    core.role.set_leader(true);
    core.metrics.set_leader(true);
    readiness.set_ready(true);
    tracing::info!(
        segments,
        objects,
        load_ms = started.elapsed().as_millis() as u64,
        "became master leader"
    );
    let result = tokio::select! {
        _ = stop.cancelled() => Ok(()),
        _ = lost.cancelled() => Err(HaError::LeadershipLost),
    };
    core.role.set_leader(false);
    core.set_persist(None);
    readiness.set_ready(false);
    let _ = writer.await;
    if result.is_ok() {
        let _ = client
            .resign(Some(ResignOptions::new().with_leader(leader_key)))
            .await;
        tracing::info!("resigned master leadership");
    }
    result
}

/// Pack queued batches into fenced etcd transactions, in order; answer each batch once its
/// writes are durable. Any failure ends leadership (the callers get an error).
async fn writer(
    mut client: Client,
    prefix: String,
    leader: LeaderKey,
    mut rx: mpsc::Receiver<PersistBatch>,
    core: Arc<Core>,
    lost: CancellationToken,
) {
    loop {
        let first = tokio::select! {
            b = rx.recv() => b,
            _ = lost.cancelled() => None,
        };
        let Some(first) = first else { break };
        let mut batches = vec![first];
        while batches.len() < 512 {
            match rx.try_recv() {
                Ok(b) => batches.push(b),
                Err(_) => break,
            }
        }
        // Last write per key wins inside one group; order of first appearance is kept.
        let mut order: Vec<String> = Vec::new();
        let mut latest: HashMap<String, Option<Vec<u8>>> = HashMap::new();
        for b in &batches {
            for op in &b.ops {
                let (k, v) = journal_write(&prefix, op);
                if latest.insert(k.clone(), v).is_none() {
                    order.push(k);
                }
            }
        }
        let started = Instant::now();
        let mut failure = None;
        for chunk in order.chunks(OPS_PER_TXN) {
            let ops: Vec<TxnOp> = chunk
                .iter()
                .map(|k| match latest.get(k).cloned().flatten() {
                    Some(v) => TxnOp::put(k.clone(), v, None),
                    None => TxnOp::delete(k.clone(), None),
                })
                .collect();
            let txn = Txn::new()
                .when(vec![Compare::create_revision(
                    leader.key().to_vec(),
                    CompareOp::Equal,
                    leader.rev(),
                )])
                .and_then(ops);
            match client.txn(txn).await {
                Ok(r) if r.succeeded() => {}
                Ok(_) => {
                    failure = Some("fenced: this master is no longer the leader".to_owned());
                    break;
                }
                Err(e) => {
                    failure = Some(format!("etcd write failed: {e}"));
                    break;
                }
            }
        }
        if !order.is_empty() {
            core.metrics
                .observe_persist(started.elapsed().as_secs_f64());
        }
        let failed = failure.is_some();
        for b in batches {
            if let Some(done) = b.done {
                let _ = done.send(match &failure {
                    None => Ok(()),
                    Some(f) => Err(f.clone()),
                });
            }
        }
        if let Some(f) = failure {
            tracing::error!(error = %f, "persisting master state failed; stepping down");
        }
        if failed {
            core.role.set_leader(false);
            lost.cancel();
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_core::master::types::{ObjectKey, Tier};

    #[test]
    fn journal_writes_parse_back() {
        let spec = SegmentSpec {
            node: "a".into(),
            name: "s".into(),
            tier: Tier::Ssd,
            capacity_bytes: 1 << 30,
            numa_node: 1,
            failure_domain: "z".into(),
            endpoints: vec!["tcp://a:1".into()],
            persistent: false,
        };
        let rec = ObjectRecord {
            key: ObjectKey::from_bytes(b"k"),
            size: 10,
            desired: 2,
            hard_pinned: true,
            spread_failure_domain: false,
            replicas: vec![(7, 4096)],
            event_name: None,
        };
        let ops = [
            JournalOp::PutSegment(7, spec.clone()),
            JournalOp::PutObject(rec.clone()),
            JournalOp::Reserve {
                seg: 7,
                offset: 8192,
                length: 4096,
            },
            JournalOp::SegmentIdsUsed(9),
        ];
        let kvs: Vec<(String, Vec<u8>)> = ops
            .iter()
            .map(|op| journal_write("/p", op))
            .map(|(k, v)| (k, v.unwrap_or_default()))
            .collect();
        let p = parse_records("/p", kvs).expect("parse");
        assert_eq!(p.segments, vec![(7, spec)]);
        assert_eq!(p.objects, vec![rec.clone()]);
        assert_eq!(p.reservations, vec![(7, 8192, 4096)]);
        assert_eq!(p.segment_ids_used, 9);
        assert_eq!(journal_write("/p", &JournalOp::DelObject(rec.key)).1, None);
        let bad = parse_records("/p", vec![("/p/obj/x".to_owned(), b"{".to_vec())]);
        assert!(matches!(bad, Err(HaError::Corrupt { .. })));
        let bad = parse_records("/p", vec![("/p/rsv/1/2".to_owned(), b"x".to_vec())]);
        assert!(matches!(bad, Err(HaError::Corrupt { .. })));
    }

    #[test]
    fn prefix_end_increments_the_last_byte() {
        assert_eq!(prefix_end(b"/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end(&[b'a', 0xff]), b"b".to_vec());
    }
}

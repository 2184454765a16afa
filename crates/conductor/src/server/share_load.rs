//! Bookings shared between conductor replicas (docs/adr/0010-conductor-replicas-share-bookings.md):
//! every `period`, this replica reports what it has booked on each engine to the master
//! (`ShareLoad`) and takes the other replicas' bookings from the answer into its state, so that
//! admission and placement count every replica's requests. A master that does not answer
//! leaves the last answer in use until its time to live, then none. I/O boundary: the
//! master's gRPC client, the monotonic clock.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use kvpool_proto::master::{EngineLoad, ShareLoadResponse};
use kvpool_runtime::telemetry::chain;
use tokio_util::sync::CancellationToken;

use super::shared::Shared;
use crate::config::{PoolLookup, ShareLoad};
use crate::peer_load::{DecodeBooking, PeerLoad};

/// Starts sharing this replica's bookings through the master, until `shutdown` fires, when
/// the conductor has a master and sharing is on.
pub(super) fn start(shared: &Arc<Shared>, shutdown: &CancellationToken) {
    let Some(pool) = shared.config.pool.clone() else {
        return;
    };
    let Some(share) = pool.share else {
        return;
    };
    let id = format!("conductor-{:032x}", rand::random::<u128>());
    tracing::info!(%id, period = ?share.period, "sharing bookings with the other conductor replicas");
    tokio::spawn(run(
        Arc::downgrade(shared),
        pool,
        share,
        id,
        shutdown.clone(),
    ));
}

async fn run(
    shared: Weak<Shared>,
    pool: PoolLookup,
    share: ShareLoad,
    id: String,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(share.period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_answer: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = shutdown.cancelled() => break,
        }
        let Some(shared) = shared.upgrade() else {
            break;
        };
        let (epoch, report) = own_report(&shared);
        // A report is worth nothing once the next is due several times over.
        let wait = (share.period * 4).max(Duration::from_millis(100));
        let outcome =
            tokio::time::timeout(wait, pool.client.share_load(&id, report, share.ttl)).await;
        let counter = &shared.metrics.share_load;
        match outcome {
            Ok(Ok(answer)) => {
                counter.with_label_values(&["ok"]).inc();
                shared
                    .metrics
                    .peer_conductors
                    .set(i64::from(answer.conductors));
                apply(&shared, epoch, &answer);
                last_answer = Some(Instant::now());
                continue;
            }
            Ok(Err(e)) => {
                counter.with_label_values(&["error"]).inc();
                tracing::debug!(error = %chain(&e), "sharing bookings failed");
            }
            Err(_) => {
                counter.with_label_values(&["timeout"]).inc();
            }
        }
        // The peers' bookings are as old as the last answer: past their time to live they
        // are forgotten, as the master forgets a replica that stopped reporting.
        if last_answer.is_none_or(|t| t.elapsed() >= share.ttl) {
            last_answer = None;
            apply(&shared, epoch, &ShareLoadResponse::default());
        }
    }
}

/// This replica's bookings by engine URL (an engine in both roles in one entry), with the
/// engine-set epoch they are numbered in.
fn own_report(shared: &Shared) -> (u64, Vec<EngineLoad>) {
    let m = shared.members.lock();
    let Some(state) = m.state.as_ref() else {
        return (m.epoch, Vec::new());
    };
    let (prefill, decode) = state.own_load();
    let mut by_url: BTreeMap<&str, EngineLoad> = BTreeMap::new();
    let entry = |map: &mut BTreeMap<&str, EngineLoad>, url: &str| -> EngineLoad {
        map.remove(url).unwrap_or_else(|| EngineLoad {
            engine: url.to_owned(),
            ..EngineLoad::default()
        })
    };
    for (url, busy) in m.engines.prefill.iter().zip(prefill) {
        let mut e = entry(&mut by_url, url);
        e.prefill_busy_s += busy;
        by_url.insert(url, e);
    }
    for (url, d) in m.engines.decode.iter().zip(decode) {
        let mut e = entry(&mut by_url, url);
        e.decode_requests += d.requests;
        e.decode_context_tokens += d.context_tokens;
        e.decode_remaining_tokens += d.remaining_tokens;
        by_url.insert(url, e);
    }
    let report = by_url.into_values().filter(|e| !is_idle(e)).collect();
    (m.epoch, report)
}

fn is_idle(e: &EngineLoad) -> bool {
    e.prefill_busy_s <= 0.0 && e.decode_requests == 0
}

/// The peers' bookings of `answer`, numbered as this replica's engines were at `epoch`, into
/// the state (skipped when the engine set changed since: the next round numbers them again).
fn apply(shared: &Shared, epoch: u64, answer: &ShareLoadResponse) {
    let mut m = shared.members.lock();
    if m.epoch != epoch {
        return;
    }
    let by_url: BTreeMap<&str, &EngineLoad> = answer
        .peers
        .iter()
        .map(|e| (e.engine.as_str(), e))
        .collect();
    let peers = PeerLoad {
        prefill_busy_s: m
            .engines
            .prefill
            .iter()
            .map(|u| {
                by_url
                    .get(u.as_str())
                    .map_or(0.0, |e| e.prefill_busy_s.max(0.0))
            })
            .collect(),
        decode: m
            .engines
            .decode
            .iter()
            .map(|u| {
                by_url
                    .get(u.as_str())
                    .map_or_else(DecodeBooking::default, |e| DecodeBooking {
                        requests: e.decode_requests,
                        context_tokens: e.decode_context_tokens,
                        remaining_tokens: e.decode_remaining_tokens,
                    })
            })
            .collect(),
    };
    if let Some(state) = m.state.as_mut() {
        state.set_peer_load(peers);
    }
}

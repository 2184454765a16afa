//! One prefill engine's KV event stream into the conductor's index: a ZMQ SUB socket on the
//! engine's publisher, each batch checked against the last sequence number. A gap is repaired
//! through the engine's replay socket (DEALER to its ROUTER) when it has one and the replay
//! covers it; otherwise, and on an engine restart (the sequence starts again), the engine's
//! entries are cleared and rebuilt from the events that follow. A payload that does not
//! decode is counted and skipped. I/O boundary: the ZMQ sockets.

use kvpool_runtime::telemetry::chain;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvpool_proto::kv_events::{END_SEQUENCE, EventBatch, decode_batch, decode_sequence};
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use super::shared::Shared;
use crate::config::KvEventSource;
use crate::kv_events::{Delta, Step, step};

/// Longest wait for a replay to finish.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// Wait between connection attempts.
const RECONNECT: Duration = Duration::from_millis(500);

/// Starts a subscription for every current prefill engine that has a stream and none yet, and
/// stops those of engines that left (their holdings go with them). Before
/// `EngineSet::follow_kv_events`, nothing runs.
pub(super) fn sync(shared: &Arc<Shared>) {
    let prefill = shared.members.lock().engines.prefill.clone();
    let mut feeds = shared.feeds.lock();
    let Some(stop) = feeds.stop.clone() else {
        return;
    };
    let left: Vec<String> = feeds
        .running
        .keys()
        .filter(|u| !prefill.contains(u))
        .cloned()
        .collect();
    for url in left {
        if let Some(t) = feeds.running.remove(&url) {
            t.cancel();
        }
        shared.members.lock().holdings.remove(&url);
        let _ = shared
            .metrics
            .engine_cached_blocks
            .remove_label_values(&[&url, "events"]);
    }
    for url in &prefill {
        if feeds.running.contains_key(url) {
            continue;
        }
        let Some(source) =
            KvEventSource::of(url, &shared.config.kv_events, shared.config.kv_events_port)
        else {
            continue;
        };
        let token = stop.child_token();
        feeds.running.insert(url.clone(), token.clone());
        tokio::spawn(follow(shared.clone(), source, token));
    }
}

/// Follows `source` until `stop` fires, reconnecting after failures.
async fn follow(shared: Arc<Shared>, source: KvEventSource, stop: CancellationToken) {
    let mut last: Option<u64> = None;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            ended = stream(&shared, &source, &mut last) => {
                if let Err(e) = ended {
                    shared.metrics.kv_event_connections.with_label_values(&["error"]).inc();
                    tracing::warn!(engine = %source.engine, endpoint = %source.endpoint,
                        error = %chain(&e), "KV event stream failed; reconnecting");
                }
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(RECONNECT) => {}
        }
    }
}

/// One connection's life: subscribe, then apply every batch as it comes.
async fn stream(
    shared: &Shared,
    source: &KvEventSource,
    last: &mut Option<u64>,
) -> Result<(), zeromq::ZmqError> {
    let mut sub = zeromq::SubSocket::new();
    sub.connect(&source.endpoint).await?;
    sub.subscribe("").await?;
    shared
        .metrics
        .kv_event_connections
        .with_label_values(&["connected"])
        .inc();
    tracing::info!(engine = %source.engine, endpoint = %source.endpoint, "following KV events");
    loop {
        let msg = sub.recv().await?;
        let Some((seq, payload)) = frames(&msg) else {
            count_batch(shared, "bad_frames");
            continue;
        };
        let batch = match decode_batch(&payload) {
            Ok(b) => b,
            Err(e) => {
                count_batch(shared, "bad_payload");
                tracing::debug!(engine = %source.engine, seq, error = %chain(&e), "KV event batch skipped");
                *last = Some(seq);
                continue;
            }
        };
        match step(*last, seq) {
            Step::Next => {}
            Step::Gap { from, to } => recover(shared, source, from, to).await,
            Step::Restart => {
                shared
                    .metrics
                    .kv_event_gaps
                    .with_label_values(&["restart"])
                    .inc();
                tracing::info!(engine = %source.engine, seq, "KV event sequence restarted; \
                    clearing the engine's entries");
                clear(shared, &source.engine);
            }
        }
        apply(shared, &source.engine, &batch);
        *last = Some(seq);
    }
}

/// `[topic, sequence, payload]` (vLLM) or `[sequence, payload]`.
fn frames(msg: &ZmqMessage) -> Option<(u64, Bytes)> {
    let (seq, payload) = match msg.len() {
        3 => (msg.get(1)?, msg.get(2)?),
        2 => (msg.get(0)?, msg.get(1)?),
        _ => return None,
    };
    Some((decode_sequence(seq).ok()?, payload.clone()))
}

fn count_batch(shared: &Shared, result: &str) {
    shared
        .metrics
        .kv_event_batches
        .with_label_values(&[result])
        .inc();
}

/// Batches `from..to` were missed: replay them, or clear the engine's entries.
async fn recover(shared: &Shared, source: &KvEventSource, from: u64, to: u64) {
    let replayed = match &source.replay {
        Some(endpoint) => {
            match tokio::time::timeout(REPLAY_TIMEOUT, replay(endpoint, from, to)).await {
                Ok(Ok(batches)) => Some(batches),
                Ok(Err(e)) => {
                    tracing::warn!(engine = %source.engine, error = %e, "KV event replay failed");
                    None
                }
                Err(_) => {
                    tracing::warn!(engine = %source.engine, "KV event replay timed out");
                    None
                }
            }
        }
        None => None,
    };
    match replayed {
        // Complete: every missed sequence came back.
        Some(batches) if batches.len() as u64 == to - from => {
            shared
                .metrics
                .kv_event_gaps
                .with_label_values(&["replayed"])
                .inc();
            for b in &batches {
                apply(shared, &source.engine, b);
            }
        }
        _ => {
            shared
                .metrics
                .kv_event_gaps
                .with_label_values(&["cleared"])
                .inc();
            tracing::info!(engine = %source.engine, from, to,
                "KV events lost; clearing the engine's entries");
            clear(shared, &source.engine);
        }
    }
}

/// Asks the replay socket for batches from `from` on; keeps those below `to`, in order, and
/// stops at the first sequence that is not the next one (the engine's buffer no longer holds
/// it).
async fn replay(endpoint: &str, from: u64, to: u64) -> Result<Vec<EventBatch>, String> {
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(endpoint).await.map_err(|e| e.to_string())?;
    let mut req = ZmqMessage::from(Bytes::new());
    req.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
    dealer.send(req).await.map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    let mut want = from;
    loop {
        let msg = dealer.recv().await.map_err(|e| e.to_string())?;
        // ["", seq, payload]; a DEALER may also see [seq, payload].
        let Some((seq_frame, payload)) = (match msg.len() {
            3 => msg.get(1).zip(msg.get(2)),
            2 => msg.get(0).zip(msg.get(1)),
            _ => None,
        }) else {
            return Err(format!("replay reply of {} frames", msg.len()));
        };
        if seq_frame.as_ref() == END_SEQUENCE {
            return Ok(out);
        }
        let seq = decode_sequence(seq_frame).map_err(|e| e.to_string())?;
        if seq < want {
            continue;
        }
        if seq != want || seq >= to {
            // Past the gap, or the engine no longer holds `want`: what we have is all.
            return Ok(out);
        }
        out.push(decode_batch(payload).map_err(|e| e.to_string())?);
        want += 1;
    }
}

/// Applies `batch` to `engine`'s holdings and, when it is a current prefill engine, the index.
fn apply(shared: &Shared, engine: &str, batch: &EventBatch) {
    let mut deltas = Vec::new();
    let mut m = shared.members.lock();
    let applied = m
        .holdings
        .entry(engine.to_owned())
        .or_default()
        .apply(batch, &mut deltas);
    let held = m.holdings.get(engine).map_or(0, |h| h.len());
    if let (Some(i), Some(state)) = (
        m.engines.prefill.iter().position(|u| u == engine),
        m.state.as_mut(),
    ) {
        state.apply_event_deltas(i, &deltas);
    }
    drop(m);
    let metrics = &shared.metrics;
    count_batch(shared, "applied");
    for (kind, n) in [
        ("stored", applied.stored),
        ("removed", applied.removed),
        ("cleared", applied.cleared),
    ] {
        if n > 0 {
            metrics.kv_events.with_label_values(&[kind]).inc_by(n);
        }
    }
    metrics
        .engine_cached_blocks
        .with_label_values(&[engine, "events"])
        .set(held as i64);
}

/// Drops everything `engine` was known to hold.
fn clear(shared: &Shared, engine: &str) {
    let mut deltas = Vec::new();
    let mut m = shared.members.lock();
    if let Some(h) = m.holdings.get_mut(engine) {
        h.clear(&mut deltas);
    }
    if let (Some(i), Some(state)) = (
        m.engines.prefill.iter().position(|u| u == engine),
        m.state.as_mut(),
    ) {
        state.apply_event_deltas(i, &deltas);
    }
    drop(m);
    shared
        .metrics
        .engine_cached_blocks
        .with_label_values(&[engine, "events"])
        .set(0);
    let removed = deltas
        .iter()
        .filter(|d| matches!(d, Delta::Removed(_)))
        .count();
    tracing::debug!(engine, removed, "engine entries cleared");
}

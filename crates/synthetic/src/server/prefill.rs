//! The prefill half of one request: an SGLang decode engine first waits for its room's KV, then
//! the prompt's KV comes in from the pool, the modelled compute runs in the (serialised) prefill
//! lane, and the new blocks (and an SGLang prefill engine's room marker) go out to the pool.
//! The pool reads and writes happen outside the lane, as a real engine overlaps KV transfers
//! with other requests' compute. I/O boundary: the node agent and the timer of the compute.

use super::pool_io::{load_from_pool, store_in_pool};
use super::report::PrefillReport;
use super::sglang::{HandoffError, wait_for_room};
use super::shared::Shared;
use crate::kv;
use kvpool_core::sched::text_tokens;
use kvpool_proto::openai::{GenerateRequest, KvRole, Prompt};
use kvpool_runtime::telemetry::chain;

/// The token ids of one prompt as this engine sees them: stand-in chunks of a text, or the
/// ids given.
pub(super) fn prompt_tokens(shared: &Shared, prompt: &Prompt) -> Vec<u32> {
    match prompt {
        Prompt::Text(text) => text_tokens(text, shared.config.chunk_bytes),
        Prompt::Tokens(ids) => ids.clone(),
    }
}

/// Which SGLang room steps one prompt of a request takes: a decode engine waits for the room
/// before the first prompt, a prefill engine marks it done after the last.
#[derive(Clone, Copy, Debug)]
pub(super) struct RoomSteps {
    pub(super) wait: bool,
    pub(super) mark: bool,
}

/// Prefills `tokens` (one prompt of `req`) in `role`: returns what the client is told once the
/// prompt's KV is in place, or why it could not get it (an SGLang hand-off that failed;
/// counted and logged).
pub(super) async fn prefill(
    shared: &Shared,
    req: &GenerateRequest,
    tokens: &[u32],
    role: KvRole,
    steps: RoomSteps,
) -> Result<PrefillReport, HandoffError> {
    let m = &shared.metrics;
    let mut keys = shared.config.hashing.keys(tokens, shared.config.block_size);
    // Only full blocks go to the pool, as real engines do.
    keys.truncate(tokens.len() / shared.config.block_size.get() as usize);
    let room = req.bootstrap.as_ref().map(|b| b.room);
    let mut report = PrefillReport::default();
    let mut to_write = Vec::new();
    let mut loaded = 0;
    if let Some(kv) = &shared.kv {
        if let (Some(mode), KvRole::Decode, Some(room), true) =
            (shared.config.sglang, role, room, steps.wait)
        {
            let timer = m
                .kv_seconds
                .with_label_values(&["handoff_wait"])
                .start_timer();
            let waited = wait_for_room(kv, room, mode.bootstrap_timeout).await;
            timer.observe_duration();
            if let Err(e) = waited {
                m.handoffs.with_label_values(&[e.category()]).inc();
                tracing::warn!(error = %chain(&e), "KV hand-off failed");
                return Err(e);
            }
            m.handoffs.with_label_values(&["ok"]).inc();
        }
        let started = std::time::Instant::now();
        let local = shared.core.lock().local_prefix(&keys);
        (loaded, to_write) = load_from_pool(shared, kv, role, &keys).await;
        report.loaded_blocks = loaded.saturating_sub(local);
        report.load_seconds = started.elapsed().as_secs_f64();
    }
    let plan = {
        let timer = m.lane_wait_seconds.start_timer();
        let _lane = shared.prefill_lane.lock().await;
        timer.observe_duration();
        let plan = shared.core.lock().prefill_with(tokens, loaded);
        shared.work(plan.seconds).await;
        plan
    };
    if let Some(kv) = &shared.kv {
        store_in_pool(shared, kv, &to_write).await;
        if let (Some(_), KvRole::Prefill, Some(room), true) =
            (shared.config.sglang, role, room, steps.mark)
        {
            // The room's blocks are all in the pool: tell its decode engine.
            store_in_pool(shared, kv, &[kv::room_key(room)]).await;
        }
    }
    m.prompt_tokens.inc_by(plan.prompt_tokens);
    m.cached_tokens.inc_by(plan.cached_tokens);
    report.prompt_tokens = plan.prompt_tokens;
    Ok(report)
}

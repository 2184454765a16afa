//! SGLang's bootstrap on the engine side: the role a request plays (this engine's own in SGLang
//! mode, the one `kv_transfer_params` names in vLLM mode), the `bootstrap_room` SGLang mode
//! requires, and the KV hand-off through the pool: the prefill engine marks the room done, the
//! decode engine waits for the marker ([`HandoffError`] when it cannot). I/O boundary: the node
//! agent (through `AgentKv`) and the timer of the wait.

use kvpool_runtime::telemetry::chain;
use std::time::Duration;

use crate::agent::{AgentKv, AgentKvError};
use crate::{EngineConfig, SglangRole, kv};
use kvpool_proto::openai::{ApiError, GenerateRequest, KvRole};

/// Why a request could not get its KV cache.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum HandoffError {
    #[error(
        "the KV cache of bootstrap_room {room} did not arrive from the prefill engine within \
         {waited_s:.1} s"
    )]
    Timeout { room: u64, waited_s: f64 },
    #[error("cannot look for the KV cache of bootstrap_room {room} in the node agent")]
    Agent {
        room: u64,
        #[source]
        source: AgentKvError,
    },
}

kvpool_runtime::error_category!(HandoffError);

/// The request's role in disaggregated serving: the engine's own in SGLang mode, the one its
/// `kv_transfer_params` name in vLLM mode.
pub(super) fn effective_role(config: &EngineConfig, req: &GenerateRequest) -> KvRole {
    match config.sglang.map(|m| m.role) {
        Some(SglangRole::Prefill) => KvRole::Prefill,
        Some(SglangRole::Decode) => KvRole::Decode,
        None => req.kv_role,
    }
}

/// Tokens the request generates here: an SGLang prefill engine stops after the first token
/// (its decode engine generates the rest).
pub(super) fn output_tokens(config: &EngineConfig, role: KvRole, req: &GenerateRequest) -> u32 {
    match (config.sglang, role) {
        (Some(_), KvRole::Prefill) => 1,
        _ => req.max_tokens,
    }
}

/// In SGLang mode a request without a `bootstrap_room` cannot be paired: the error saying so.
pub(super) fn missing_bootstrap(config: &EngineConfig, req: &GenerateRequest) -> Option<ApiError> {
    let (Some(mode), None) = (config.sglang, &req.bootstrap) else {
        return None;
    };
    Some(ApiError::Invalid {
        field: "bootstrap_room",
        problem: format!(
            "is required: this engine serves the {} half of SGLang disaggregation",
            match mode.role {
                SglangRole::Prefill => "prefill",
                SglangRole::Decode => "decode",
            }
        ),
    })
}

/// For this long a decode engine asks its agent for the room's marker again as soon as the
/// last answer came (one call in flight, a fraction of a millisecond each), as a real SGLang
/// decode engine's scheduler checks its KV receivers every iteration: a prefill engine that
/// answers a moment after its decode engine started waiting costs that moment, not a timer
/// tick.
const EAGER_POLLING: Duration = Duration::from_millis(2);
/// Until then it asks every millisecond (the timer's resolution); after, the pause doubles up
/// to [`SLOW_POLL`], so that a long prefill costs the agent few calls.
const FAST_POLLING: Duration = Duration::from_millis(10);
/// The longest pause between two looks for a room's marker.
const SLOW_POLL: Duration = Duration::from_millis(20);

/// Waits (polling the agent, bounded by `timeout`) until the prefill engine of `room` has
/// marked its KV hand-off done, then removes the marker.
pub(super) async fn wait_for_room(
    kv: &AgentKv,
    room: u64,
    timeout: Duration,
) -> Result<(), HandoffError> {
    let marker = [kv::room_key(room)];
    let started = std::time::Instant::now();
    let mut pause = Duration::from_millis(1);
    loop {
        let present = kv
            .present(&marker)
            .await
            .map_err(|source| HandoffError::Agent { room, source })?;
        if present.first().copied().unwrap_or(false) {
            // Best effort: a marker left behind is evicted like any other object.
            if let Err(e) = kv.remove(&marker).await {
                tracing::debug!(error = %chain(&e), room, "cannot remove the hand-off marker");
            }
            return Ok(());
        }
        let waited = started.elapsed();
        if waited >= timeout {
            return Err(HandoffError::Timeout {
                room,
                waited_s: waited.as_secs_f64(),
            });
        }
        if waited < EAGER_POLLING {
            tokio::task::yield_now().await;
            continue;
        }
        tokio::time::sleep(pause.min(timeout - waited)).await;
        if waited >= FAST_POLLING {
            pause = (pause * 2).min(SLOW_POLL);
        }
    }
}

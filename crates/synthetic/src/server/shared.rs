//! What every handler of one synthetic engine shares ([`Shared`]): its configuration, the node
//! agent's session, the prefix cache, the prefill lane and the decode batch's size, the
//! response ids and the metrics. I/O boundary: none (the timers are the callers').

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use super::metrics::Metrics;
use crate::agent::AgentKv;
use crate::{EngineConfig, EngineCore};

pub(super) struct Shared {
    pub(super) config: EngineConfig,
    pub(super) kv: Option<AgentKv>,
    pub(super) core: parking_lot::Mutex<EngineCore>,
    /// Prefills run one at a time, in arrival order (tokio's mutex is fair).
    pub(super) prefill_lane: tokio::sync::Mutex<()>,
    pub(super) decoding: AtomicU64,
    pub(super) decode_tokens: AtomicU64,
    pub(super) next_id: AtomicU64,
    pub(super) metrics: Metrics,
}

impl Shared {
    /// `seconds` of modelled work as wall time (times the time scale, at most an hour).
    pub(super) fn scaled(&self, seconds: f64) -> Duration {
        Duration::from_secs_f64((seconds * self.config.time_scale).clamp(0.0, 3600.0))
    }
}

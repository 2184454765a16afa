//! What every handler of one synthetic engine shares ([`Shared`]): its configuration, the node
//! agent's session, the prefix cache, the prefill lane, the decode batch's size and the
//! metrics. I/O boundary: the timer of the modelled work ([`Shared::work`]).

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
    pub(super) metrics: Metrics,
}

impl Shared {
    /// `seconds` of modelled work as wall time (times the time scale, at most an hour).
    pub(super) fn scaled(&self, seconds: f64) -> Duration {
        Duration::from_secs_f64((seconds * self.config.time_scale).clamp(0.0, 3600.0))
    }

    /// Waits out `seconds` of modelled work at the time scale. With nothing to wait (time
    /// scale 0) it returns at once: a zero-length Tokio timer still waits for the timer's next
    /// millisecond tick, which would make "no compute" cost a millisecond per step.
    pub(super) async fn work(&self, seconds: f64) {
        let wall = self.scaled(seconds);
        if !wall.is_zero() {
            tokio::time::sleep(wall).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;
    use std::time::Instant;

    use axum::body::Body;
    use axum::http::Request;
    use kvpool_core::sched::{DecodeCost, PrefillCost};
    use prometheus::Registry;
    use tower::ServiceExt;

    use crate::EngineConfig;

    #[tokio::test]
    async fn at_time_scale_zero_no_step_waits_for_a_timer_tick() {
        // 1000 decode steps: a zero-length timer per step would wait for ~1000 millisecond
        // ticks (half a second at least); with no timer they take a few milliseconds.
        let config = EngineConfig {
            model: "m".into(),
            prefill_cost: PrefillCost::default(),
            decode_cost: DecodeCost::default(),
            block_size: NonZeroU32::new(16).unwrap(),
            cache_blocks: 10,
            chunk_bytes: 4,
            time_scale: 0.0,
            sglang: None,
            hashing: kvpool_core::sched::BlockHashing::Kvpool,
        };
        let router = super::super::router(config, &Registry::new()).unwrap();
        let started = Instant::now();
        let resp = router
            .oneshot(
                Request::post("/v1/completions")
                    .header("content-type", "application/json")
                    .body(Body::from(
                        r#"{"model":"m","prompt":"hello","max_tokens":1000}"#,
                    ))
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        let elapsed = started.elapsed();
        assert!(String::from_utf8_lossy(&body).contains("tok999"));
        assert!(
            elapsed < std::time::Duration::from_millis(250),
            "1000 steps of no modelled work took {elapsed:?}"
        );
    }
}

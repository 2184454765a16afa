//! What every handler of one conductor shares ([`Shared`]): its configuration, the engine set
//! and bookkeeping behind one lock, the HTTP client, the metrics, the bounds and back-offs of
//! the pool lookups and prefetches, and the learnt pool fetch estimate; plus [`Finish`], which
//! releases a request's bookings and ends its timing however it ends. I/O boundary: the monotonic clock.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use super::latency::RequestTimer;
use super::members::{Members, Placed};
use super::metrics::Metrics;
use super::upstream::Upstream;
use crate::config::ConductorConfig;
use crate::fetch_estimate::FetchEstimate;

pub(super) struct Shared {
    pub(super) config: ConductorConfig,
    pub(super) members: parking_lot::Mutex<Members>,
    pub(super) upstream: Upstream,
    pub(super) started: Instant,
    pub(super) metrics: Metrics,
    /// Bounds the prefetch requests in flight; a task finding none free is dropped.
    pub(super) prefetch_slots: Arc<tokio::sync::Semaphore>,
    /// After a failed or slow pool lookup, no lookups until then (requests go local-only).
    pub(super) pool_backoff_until: parking_lot::Mutex<Option<Instant>>,
    /// Prefill engines that answered a prefetch with 404: not asked again.
    pub(super) no_prefetch: parking_lot::Mutex<HashSet<String>>,
    /// The pool fetch term, learnt from the prefill engines' measured reads.
    pub(super) fetch: parking_lot::Mutex<FetchEstimate>,
    /// The KV event subscriptions running, by prefill engine URL, and the token they stop
    /// with (`None` until `EngineSet::follow_kv_events` started them).
    pub(super) feeds: parking_lot::Mutex<Feeds>,
    /// The model names served (flags, or learnt from the engines).
    pub(super) models: super::models::ServedModels,
    /// The load signal's windows (`load`).
    pub(super) load: parking_lot::Mutex<super::load::LoadWindows>,
    /// The prefill engines' bootstrap servers' answers (vLLM's `MooncakeConnector`).
    pub(super) bootstraps: super::bootstrap::BootstrapCache,
}

/// The KV event subscriptions running (`kv_feed`), by prefill engine URL, and the token they
/// all stop with.
#[derive(Default)]
pub(super) struct Feeds {
    pub(super) stop: Option<tokio_util::sync::CancellationToken>,
    pub(super) running: std::collections::HashMap<String, tokio_util::sync::CancellationToken>,
}

impl Shared {
    /// A slot for one background call to an engine or the master (a prefetch, hot copies),
    /// within the bound on those in flight; `None`, counted as `busy` in `counter`, when every
    /// slot is taken.
    pub(super) fn background_slot(
        &self,
        counter: &prometheus::IntCounterVec,
    ) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let slot = self.prefetch_slots.clone().try_acquire_owned().ok();
        if slot.is_none() {
            counter.with_label_values(&["busy"]).inc();
        }
        slot
    }

    /// Base URLs of every engine served now, prefill then decode.
    pub(super) fn engine_urls(&self) -> Vec<String> {
        let m = self.members.lock();
        m.engines
            .prefill
            .iter()
            .chain(&m.engines.decode)
            .cloned()
            .collect()
    }

    /// Wall seconds since start (the load signal's clock).
    pub(super) fn wall_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// The load endpoint's body now (`load`).
    pub(super) fn load_report(&self) -> kvpool_core::autoscale::LoadReport {
        let (instances, queues) = {
            let m = self.members.lock();
            (
                (m.engines.prefill.len(), m.engines.decode.len()),
                m.state
                    .as_ref()
                    .map(crate::state::State::queue_depths)
                    .unwrap_or_default(),
            )
        };
        let now = self.wall_s();
        self.load
            .lock()
            .report(now, instances, queues, self.config.scheduler.slo)
    }

    /// Cost-model seconds since start: wall time divided by the engines' time scale.
    pub(super) fn now_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64() / self.config.time_scale
    }
}

/// Leaves the decode bookkeeping when the response body is done or dropped, and ends the
/// request's timing (its [`RequestTimer`] drops with it).
pub(super) struct Finish {
    pub(super) shared: Arc<Shared>,
    pub(super) placed: Placed,
    pub(super) timer: RequestTimer,
    /// The prefill call's wall seconds, once it answered.
    pub(super) prefill_call_s: Option<f64>,
}

impl Drop for Finish {
    fn drop(&mut self) {
        self.shared
            .members
            .lock()
            .with_ticket(&self.placed, |s, t| s.finished(t));
    }
}

//! Per-engine load as the conductor books it, read when Prometheus scrapes (nothing on the
//! request path): `kvpool_conductor_engine_requests{role, engine}`, the requests booked on each
//! prefill engine and not yet prefilled and on each decode engine and not yet finished, and
//! `kvpool_conductor_prefill_queue_seconds{engine}`, the work booked ahead on each prefill
//! engine (wall seconds). Engines that left the set leave the metrics with it. I/O boundary:
//! none (a collector over the shared bookkeeping).

use std::sync::Weak;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{GaugeVec, IntGaugeVec, Opts};

use super::shared::Shared;

/// The collector; holds the conductor weakly, so a dropped conductor exports nothing.
pub(super) struct EngineLoad {
    shared: Weak<Shared>,
    requests: IntGaugeVec,
    queue: GaugeVec,
}

impl EngineLoad {
    pub(super) fn new(shared: Weak<Shared>) -> Result<Self, prometheus::Error> {
        Ok(Self {
            shared,
            requests: IntGaugeVec::new(
                Opts::new(
                    "kvpool_conductor_engine_requests",
                    "Requests booked on an engine, by role and engine URL (prefill: sent and not \
                     yet prefilled; decode: placed and not yet finished)",
                ),
                &["role", "engine"],
            )?,
            queue: GaugeVec::new(
                Opts::new(
                    "kvpool_conductor_prefill_queue_seconds",
                    "Work the conductor has booked ahead on a prefill engine, by engine URL \
                     (estimated wall seconds until it is free)",
                ),
                &["engine"],
            )?,
        })
    }
}

impl Collector for EngineLoad {
    fn desc(&self) -> Vec<&Desc> {
        self.requests
            .desc()
            .into_iter()
            .chain(self.queue.desc())
            .collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.requests.reset();
        self.queue.reset();
        if let Some(shared) = self.shared.upgrade() {
            let now = shared.now_s();
            let scale = shared.config.time_scale;
            let m = shared.members.lock();
            if let Some(state) = &m.state {
                let prefill = m.engines.prefill.iter();
                for ((url, booked), free_at) in prefill
                    .zip(state.prefill_booked())
                    .zip(state.prefill_free_at())
                {
                    self.requests
                        .with_label_values(&["prefill", url.as_str()])
                        .set(i64::try_from(booked).unwrap_or(i64::MAX));
                    self.queue
                        .with_label_values(&[url.as_str()])
                        .set((free_at - now).max(0.0) * scale);
                }
                for (url, n) in m.engines.decode.iter().zip(state.decode_counts()) {
                    self.requests
                        .with_label_values(&["decode", url.as_str()])
                        .set(i64::try_from(n).unwrap_or(i64::MAX));
                }
            }
        }
        let mut out = self.requests.collect();
        out.extend(self.queue.collect());
        out
    }
}

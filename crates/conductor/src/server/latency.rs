//! What a client sees of the conductor, per request: time to first token, time per output
//! token, end-to-end duration, the conductor's own wait before the prefill call, the requests
//! in flight, and whether each request met the pool's TTFT and TPOT objectives. A
//! [`RequestTimer`] follows one request from arrival to the end of its response body; every
//! histogram is observed at most once per request, through handles created at start-up (no
//! label lookup and no allocation on the request path). I/O boundary: the monotonic clock.

use std::sync::Arc;
use std::time::Instant;

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

use kvpool_core::sched::Slo;

/// The latency metrics of one conductor and the objectives they are judged by (wall seconds).
pub(super) struct Latency {
    ttft: Histogram,
    tpot: Histogram,
    duration: Histogram,
    queue_wait: Histogram,
    in_flight: IntGauge,
    /// `[ttft met, ttft missed, tpot met, tpot missed]`.
    slo: [IntCounter; 4],
    /// The objectives in wall seconds: `(ttft, tpot)`.
    objective_s: (f64, f64),
}

/// Bucket bounds of the time-to-first-token and end-to-end histograms, seconds.
const TTFT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
];
const TPOT_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];
const DURATION_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
const QUEUE_BUCKETS: &[f64] = &[
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0,
];

impl Latency {
    /// Creates and registers the metrics; `slo` in cost-model seconds, `time_scale` the
    /// engines' speed-up (wall = cost-model seconds × `time_scale`).
    pub(super) fn register(
        registry: &Registry,
        slo: Slo,
        time_scale: f64,
    ) -> Result<Self, prometheus::Error> {
        let histogram = |name: &str, help: &str, buckets: &[f64]| {
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
        };
        let ttft = histogram(
            "kvpool_conductor_ttft_seconds",
            "Time to first token as the client sees it: from the request's arrival to the first \
             bytes of the decode engine's answer (served requests)",
            TTFT_BUCKETS,
        )?;
        let tpot = histogram(
            "kvpool_conductor_tpot_seconds",
            "Time per output token after the first: the decode answer's remaining time over its \
             remaining tokens (served requests that streamed more than one chunk of tokens)",
            TPOT_BUCKETS,
        )?;
        let duration = histogram(
            "kvpool_conductor_request_duration_seconds",
            "End to end: from the request's arrival to the end of its response body (every \
             completion request, whatever its outcome)",
            DURATION_BUCKETS,
        )?;
        let queue_wait = histogram(
            "kvpool_conductor_queue_wait_seconds",
            "The conductor's own part before the prefill call: from arrival to placement \
             (tokenizing, pool lookup, waiting for the placement lock)",
            QUEUE_BUCKETS,
        )?;
        let in_flight = IntGauge::new(
            "kvpool_conductor_in_flight_requests",
            "Completion requests arrived and not yet answered to the end of their body",
        )?;
        let slo_requests = IntCounterVec::new(
            Opts::new(
                "kvpool_conductor_slo_requests_total",
                "Served requests judged against the pool's objectives, by objective (ttft, tpot) \
                 and result (met, missed)",
            ),
            &["objective", "result"],
        )?;
        let objective = prometheus::GaugeVec::new(
            Opts::new(
                "kvpool_conductor_slo_objective_seconds",
                "The pool's objectives in wall seconds, by objective (ttft, tpot)",
            ),
            &["objective"],
        )?;
        let objective_s = (slo.ttft_s * time_scale, slo.tpot_s * time_scale);
        objective.with_label_values(&["ttft"]).set(objective_s.0);
        objective.with_label_values(&["tpot"]).set(objective_s.1);
        for c in [
            Box::new(ttft.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(tpot.clone()),
            Box::new(duration.clone()),
            Box::new(queue_wait.clone()),
            Box::new(in_flight.clone()),
            Box::new(slo_requests.clone()),
            Box::new(objective),
        ] {
            registry.register(c)?;
        }
        let slo = [
            slo_requests.with_label_values(&["ttft", "met"]),
            slo_requests.with_label_values(&["ttft", "missed"]),
            slo_requests.with_label_values(&["tpot", "met"]),
            slo_requests.with_label_values(&["tpot", "missed"]),
        ];
        Ok(Self {
            ttft,
            tpot,
            duration,
            queue_wait,
            in_flight,
            slo,
            objective_s,
        })
    }
}

/// One request's timing, from its arrival (`start`) to the end of its response body (drop).
/// Dropping it ends the request: the in-flight gauge goes down and the end-to-end duration is
/// observed, whatever the outcome.
pub(super) struct RequestTimer {
    latency: Arc<Latency>,
    arrived: Instant,
    /// When the prefill engine's answer was read (the hand-off starts).
    prefilled: Option<Instant>,
    /// When the first bytes of a served answer came and the tokens they carried.
    first: Option<(Instant, u32)>,
}

/// The first bytes of a served answer: the request's TTFT and, when its prefill answer came
/// before, the hand-off (prefill answer to first token), both wall seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct FirstToken {
    pub(super) ttft_s: f64,
    pub(super) handoff_s: Option<f64>,
}

impl RequestTimer {
    /// A request arrived (one reference count on `latency`, no allocation).
    pub(super) fn start(latency: &Arc<Latency>) -> Self {
        latency.in_flight.inc();
        Self {
            latency: latency.clone(),
            arrived: Instant::now(),
            prefilled: None,
            first: None,
        }
    }

    /// The request was placed and is about to be sent to its prefill engine.
    pub(super) fn placed(&self) {
        self.latency
            .queue_wait
            .observe(self.arrived.elapsed().as_secs_f64());
    }

    /// The prefill engine's answer was read at `at`.
    pub(super) fn prefilled(&mut self, at: Instant) {
        self.prefilled = Some(at);
    }

    /// A chunk of the served (2xx) decode answer passed, with `tokens` counted in the answer
    /// so far: the first one is the time to first token, returned with the hand-off.
    pub(super) fn chunk(&mut self, tokens: u32) -> Option<FirstToken> {
        if self.first.is_some() {
            return None;
        }
        let now = Instant::now();
        let ttft = now.duration_since(self.arrived).as_secs_f64();
        self.latency.ttft.observe(ttft);
        let l = &self.latency;
        l.slo[if ttft <= l.objective_s.0 { 0 } else { 1 }].inc();
        self.first = Some((now, tokens));
        Some(FirstToken {
            ttft_s: ttft,
            handoff_s: self
                .prefilled
                .map(|at| now.saturating_duration_since(at).as_secs_f64()),
        })
    }

    /// The served answer ended with `tokens` counted in all: the tokens after the first chunk
    /// over the time they took is the time per output token (none when the first chunk
    /// carried them all, as a whole JSON answer does), returned in wall seconds.
    pub(super) fn ended(&mut self, tokens: u32) -> Option<f64> {
        let (first_at, first_tokens) = self.first.take()?;
        let later = tokens.saturating_sub(first_tokens.max(1));
        if later == 0 {
            return None;
        }
        let tpot = first_at.elapsed().as_secs_f64() / f64::from(later);
        self.latency.tpot.observe(tpot);
        let l = &self.latency;
        l.slo[if tpot <= l.objective_s.1 { 2 } else { 3 }].inc();
        Some(tpot)
    }
}

impl Drop for RequestTimer {
    fn drop(&mut self) {
        self.latency.in_flight.dec();
        self.latency
            .duration
            .observe(self.arrived.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn latency(registry: &Registry) -> Arc<Latency> {
        let slo = Slo {
            ttft_s: 1000.0,
            tpot_s: 0.0,
        };
        Arc::new(Latency::register(registry, slo, 1.0).expect("register"))
    }

    /// The sample of `name` with `labels` (in registration order) in the text exposition;
    /// for a histogram, its count.
    fn value(registry: &Registry, name: &str, labels: &[(&str, &str)]) -> f64 {
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&registry.gather())
            .expect("encode");
        let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
        let series = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{}}}", labels.join(","))
        };
        [format!("{name}{series} "), format!("{name}_count{series} ")]
            .iter()
            .find_map(|prefix| text.lines().find_map(|l| l.strip_prefix(prefix.as_str())))
            .unwrap_or_else(|| panic!("{name}{series} not in\n{text}"))
            .parse()
            .expect("number")
    }

    #[test]
    fn a_streamed_request_is_timed_once_and_judged_against_each_objective() {
        let registry = Registry::new();
        let l = latency(&registry);
        {
            let mut t = RequestTimer::start(&l);
            assert_eq!(
                value(&registry, "kvpool_conductor_in_flight_requests", &[]),
                1.0
            );
            t.placed();
            t.chunk(1);
            t.chunk(2);
            t.chunk(5);
            t.ended(5);
        }
        assert_eq!(
            value(&registry, "kvpool_conductor_in_flight_requests", &[]),
            0.0
        );
        for name in [
            "kvpool_conductor_ttft_seconds",
            "kvpool_conductor_tpot_seconds",
            "kvpool_conductor_request_duration_seconds",
            "kvpool_conductor_queue_wait_seconds",
        ] {
            assert_eq!(value(&registry, name, &[]), 1.0, "{name}");
        }
        let slo = "kvpool_conductor_slo_requests_total";
        // A 1000 s TTFT objective is met; a 0 s TPOT objective cannot be.
        assert_eq!(
            value(&registry, slo, &[("objective", "ttft"), ("result", "met")]),
            1.0
        );
        assert_eq!(
            value(
                &registry,
                slo,
                &[("objective", "tpot"), ("result", "missed")]
            ),
            1.0
        );
        assert_eq!(
            value(&registry, slo, &[("objective", "tpot"), ("result", "met")]),
            0.0
        );
        let objective = "kvpool_conductor_slo_objective_seconds";
        assert_eq!(
            value(&registry, objective, &[("objective", "ttft")]),
            1000.0
        );
    }

    #[test]
    fn a_whole_answer_has_no_tpot_and_a_refused_request_only_a_duration() {
        let registry = Registry::new();
        let l = latency(&registry);
        {
            let mut t = RequestTimer::start(&l);
            t.chunk(7);
            t.ended(7);
        }
        drop(RequestTimer::start(&l));
        assert_eq!(value(&registry, "kvpool_conductor_ttft_seconds", &[]), 1.0);
        assert_eq!(value(&registry, "kvpool_conductor_tpot_seconds", &[]), 0.0);
        assert_eq!(
            value(&registry, "kvpool_conductor_request_duration_seconds", &[]),
            2.0
        );
        assert_eq!(
            value(&registry, "kvpool_conductor_queue_wait_seconds", &[]),
            0.0
        );
        assert_eq!(
            value(&registry, "kvpool_conductor_in_flight_requests", &[]),
            0.0
        );
    }
}

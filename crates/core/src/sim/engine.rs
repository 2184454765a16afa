//! Discrete-event replay of a trace through the scheduling policy core, with simulated prefill
//! instances (one request at a time, FIFO, local LRU cache), a global LRU pool and decode
//! instances (continuous batching, one token per running request per step, bounded KV memory).
//! Pure: takes parsed records and a configuration, returns a report; no I/O, no clock.
//!
//! Time is in seconds of trace time (trace milliseconds / 1000, divided by `time_scale`).
//! Blocks enter a prefill instance's cache and the pool when the request is scheduled, so a
//! later request already sees them (the instance runs requests in order; see docs/scheduling.md).

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, VecDeque};

use crate::sched::{
    Decision, DecodeLoad, DecodeMember, Inserted, LruSet, PrefillLoad, PrefixIndex, RejectReason,
    Rejection, Request, Scheduler,
};

pub use super::config::{SimConfig, UNLIMITED};
pub use super::outcome::{Outcome, Totals};
use super::report::{Report, summarize};
use super::scaling::PrefillScaler;
use super::trace::TraceRecord;

/// Errors of a simulation run.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum SimError {
    #[error("invalid scheduler configuration")]
    Config(#[source] crate::sched::ConfigError),
    #[error("invalid prefix index configuration")]
    Index(#[source] crate::sched::IndexError),
    #[error("time scale must be a finite number > 0, got {0}")]
    TimeScale(f64),
}

impl SimError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    DecodeArrive { instance: usize, request: u64 },
    StepEnd { instance: usize },
}

#[derive(Debug)]
struct Event {
    at_s: f64,
    seq: u64,
    kind: Kind,
}

impl PartialEq for Event {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Event {
    fn cmp(&self, other: &Self) -> Ordering {
        self.at_s
            .total_cmp(&other.at_s)
            .then(self.seq.cmp(&other.seq))
    }
}

struct State {
    sched: Scheduler,
    index: PrefixIndex,
    local: Vec<LruSet>,
    pool: Option<LruSet>,
    prefill: Vec<PrefillLoad>,
    decode: Vec<DecodeLoad>,
    stepping: Vec<bool>,
    /// Per decode instance, ids of requests that arrived and wait for KV memory, in order.
    waiting: Vec<VecDeque<u64>>,
    events: BinaryHeap<Reverse<Event>>,
    seq: u64,
    outcomes: Vec<Outcome>,
    totals: Totals,
    kv_capacity: u64,
    scaler: Option<PrefillScaler>,
}

/// Replays `records` (sorted by timestamp) under `config`.
pub fn simulate(records: &[TraceRecord], config: &SimConfig) -> Result<Report, SimError> {
    let (outcomes, totals) = run(records, config)?;
    Ok(summarize(config, &outcomes, &totals))
}

/// Replays `records` and returns every request's outcome (for tests and custom reports).
pub fn run(
    records: &[TraceRecord],
    config: &SimConfig,
) -> Result<(Vec<Outcome>, Totals), SimError> {
    if !(config.time_scale.is_finite() && config.time_scale > 0.0) {
        return Err(SimError::TimeScale(config.time_scale));
    }
    let sched = Scheduler::new(config.scheduler.clone(), config.decode_instances)
        .map_err(SimError::Config)?;
    let n = sched.prefill_instances();
    let index = PrefixIndex::new(n).map_err(SimError::Index)?;
    let pool = (config.scheduler.policy.uses_pool() && config.pool_blocks > 0)
        .then(|| LruSet::new(config.pool_blocks));
    let mut prefill = vec![PrefillLoad::default(); n];
    let slo_s = config.scheduler.slo.ttft_s;
    let scaler = config
        .autoscale
        .map(|a| PrefillScaler::new(a, slo_s, &mut prefill));
    let mut st = State {
        index,
        local: (0..n)
            .map(|_| LruSet::new(config.local_cache_blocks))
            .collect(),
        pool,
        prefill,
        decode: vec![DecodeLoad::default(); config.decode_instances],
        stepping: vec![false; config.decode_instances],
        waiting: vec![VecDeque::new(); config.decode_instances],
        events: BinaryHeap::new(),
        seq: 0,
        outcomes: Vec::with_capacity(records.len()),
        totals: Totals::default(),
        kv_capacity: config.scheduler.decode_kv_capacity_tokens,
        sched,
        scaler,
    };
    for (id, rec) in records.iter().enumerate() {
        let now = rec.timestamp_ms as f64 / 1000.0 / config.time_scale;
        while st.events.peek().is_some_and(|Reverse(e)| e.at_s <= now) {
            st.handle_next();
        }
        if let Some(s) = st.scaler.as_mut() {
            s.advance(now, &mut st.prefill, &mut st.local, &mut st.index);
        }
        st.arrive(id, rec, now);
    }
    while !st.events.is_empty() {
        st.handle_next();
    }
    // Instance-seconds from the first arrival to the last completion (or arrival).
    let first = st.outcomes.first().map_or(0.0, |o| o.arrival_s);
    let end = st
        .outcomes
        .iter()
        .map(|o| o.finish_s.max(o.arrival_s))
        .fold(first, f64::max);
    match st.scaler.take() {
        Some(s) => {
            let scaling = s.finish(end);
            st.totals.prefill_instance_s = scaling.instance_s;
            st.totals.scaling = Some(scaling);
        }
        None => st.totals.prefill_instance_s = n as f64 * (end - first),
    }
    Ok((st.outcomes, st.totals))
}

impl State {
    fn push(&mut self, at_s: f64, kind: Kind) {
        self.seq += 1;
        self.events.push(Reverse(Event {
            at_s,
            seq: self.seq,
            kind,
        }));
    }

    fn handle_next(&mut self) {
        let Some(Reverse(ev)) = self.events.pop() else {
            return;
        };
        match ev.kind {
            Kind::DecodeArrive { instance, request } => {
                if self.sched.config().rejection == Rejection::AtDecode
                    && let Some(reason) = self.refused_at_decode(instance, ev.at_s)
                {
                    self.decode[instance]
                        .pending
                        .retain(|m| m.request != request);
                    if let Some(o) = self.outcomes.get_mut(request as usize) {
                        o.rejected = Some(reason);
                    }
                    return;
                }
                self.waiting[instance].push_back(request);
                if !self.stepping[instance] {
                    self.admit(instance);
                    self.start_step(instance, ev.at_s);
                }
            }
            Kind::StepEnd { instance } => self.step_end(instance, ev.at_s),
        }
    }

    fn arrive(&mut self, id: usize, rec: &TraceRecord, now: f64) {
        let req = Request {
            keys: &rec.hash_ids,
            input_tokens: rec.input_length,
            output_tokens: rec.output_length,
        };
        let mut out = Outcome {
            arrival_s: now,
            blocks: rec.hash_ids.len() as u32,
            input_tokens: rec.input_length,
            decode_tokens: rec.output_length.saturating_sub(1).max(1),
            ..Outcome::default()
        };
        let placement = match self
            .sched
            .decide(now, &req, &self.index, &self.prefill, &self.decode)
        {
            Decision::Reject(reason) => {
                if let (Some(s), RejectReason::Ttft { .. } | RejectReason::NoInstance) =
                    (self.scaler.as_mut(), reason)
                {
                    s.rejected(now);
                }
                out.rejected = Some(reason);
                self.outcomes.push(out);
                return;
            }
            Decision::Accept(p) => p,
        };
        out.matched_blocks = placement.prefix.matched_blocks;
        out.local_blocks = placement.prefix.local_blocks;
        out.cached_tokens = placement.cached_tokens;
        out.expected_ttft_s = placement.ttft.total_s();
        out.expected_tpot_s = placement.tpot_s;

        // Hot-block replication, then the request's own blocks into its instance and the pool.
        if let Some(rep) = self.sched.record_hits(
            &mut self.index,
            &rec.hash_ids,
            &placement,
            &self.prefill,
            now,
        ) {
            for &t in &rep.targets {
                self.cache_locally(t, &rec.hash_ids[..rep.blocks]);
                self.totals.replicated_blocks += rep.blocks as u64;
            }
        }
        self.cache_locally(placement.prefill, &rec.hash_ids);
        self.cache_in_pool(&rec.hash_ids);

        // Prefill runs after the instance's queue; its first token ends it.
        let p = &mut self.prefill[placement.prefill];
        let start = p.free_at_s.max(now);
        let work = placement.ttft.fetch_s + placement.ttft.prefill_s;
        p.free_at_s = start + work;
        self.totals.prefill_busy_s += work;
        if let Some(s) = self.scaler.as_mut() {
            s.admitted(now, placement.prefill, start, placement.ttft.total_s());
        }
        out.ttft_s = p.free_at_s - now;
        out.decode_arrival_s = p.free_at_s + placement.kv_transfer_s;
        self.decode[placement.decode].pending.push(DecodeMember {
            request: id as u64,
            context_tokens: rec.input_length,
            remaining_tokens: out.decode_tokens,
            joins_at_s: out.decode_arrival_s,
        });
        self.push(
            out.decode_arrival_s,
            Kind::DecodeArrive {
                instance: placement.decode,
                request: id as u64,
            },
        );
        self.outcomes.push(out);
    }

    /// Inserts `keys` last block first, so the leading blocks are the most recently used and
    /// are evicted last: a prefix stays usable as long as possible.
    fn cache_locally(&mut self, instance: usize, keys: &[u64]) {
        let Some(cache) = self.local.get_mut(instance) else {
            return;
        };
        for &k in keys.iter().rev() {
            if let Inserted::Added { evicted } = cache.insert(k) {
                self.index.add_local(k, instance);
                if let Some(e) = evicted {
                    self.index.remove_local(e, instance);
                    self.totals.local_evictions += 1;
                }
            }
        }
    }

    fn cache_in_pool(&mut self, keys: &[u64]) {
        let Some(pool) = self.pool.as_mut() else {
            return;
        };
        for &k in keys.iter().rev() {
            if let Inserted::Added { evicted } = pool.insert(k) {
                self.index.add_pool_replica(k);
                if let Some(e) = evicted {
                    self.index.remove_pool_replica(e);
                    self.totals.pool_evictions += 1;
                }
            }
        }
    }

    /// Whether decode instance `instance` refuses `request` arriving at `now` (only with
    /// `Rejection::AtDecode`): judged on the instance's load at that moment, running requests
    /// plus those waiting there, as early rejection judges it at arrival. An idle instance takes
    /// anything.
    fn refused_at_decode(&self, instance: usize, now: f64) -> Option<RejectReason> {
        let d = self.decode.get(instance)?;
        // `current` counts this request too: it is pending with `joins_at_s == now`.
        let v = d.current(now);
        if v.batch <= 1 {
            return None;
        }
        if v.context_tokens > self.kv_capacity {
            return Some(RejectReason::DecodeMemory);
        }
        let step = self
            .sched
            .config()
            .decode_cost
            .step_seconds(v.batch, v.context_tokens);
        (step > self.sched.config().slo.tpot_s).then_some(RejectReason::Tpot { estimate_s: step })
    }

    /// Moves requests that have arrived from `pending` into the running batch, in arrival
    /// order, while KV memory allows (an idle instance always takes the first one).
    fn admit(&mut self, instance: usize) {
        let d = &mut self.decode[instance];
        let waiting = &mut self.waiting[instance];
        let mut ctx: u64 = d.running.iter().map(|m| m.context_tokens).sum();
        while let Some(&request) = waiting.front() {
            let Some(pos) = d.pending.iter().position(|m| m.request == request) else {
                waiting.pop_front();
                continue;
            };
            let m = d.pending[pos];
            if !d.running.is_empty() && ctx + m.context_tokens > self.kv_capacity {
                break;
            }
            ctx += m.context_tokens;
            waiting.pop_front();
            d.pending.swap_remove(pos);
            d.running.push(m);
        }
    }

    fn start_step(&mut self, instance: usize, now: f64) {
        let d = &self.decode[instance];
        if d.running.is_empty() {
            self.stepping[instance] = false;
            return;
        }
        let ctx: u64 = d.running.iter().map(|m| m.context_tokens).sum();
        let step = self
            .sched
            .config()
            .decode_cost
            .step_seconds(d.running.len() as u64, ctx);
        self.stepping[instance] = true;
        self.totals.decode_steps += 1;
        self.push(now + step, Kind::StepEnd { instance });
    }

    fn step_end(&mut self, instance: usize, now: f64) {
        let outcomes = &mut self.outcomes;
        self.decode[instance].running.retain_mut(|m| {
            m.remaining_tokens = m.remaining_tokens.saturating_sub(1);
            m.context_tokens += 1;
            if m.remaining_tokens == 0 {
                if let Some(o) = outcomes.get_mut(m.request as usize) {
                    o.finish_s = now;
                }
                false
            } else {
                true
            }
        });
        self.admit(instance);
        self.start_step(instance, now);
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use crate::sched::{
        DecodeCost, HotConfig, Policy, PrefillCost, Rejection, SchedulerConfig, Slo,
    };

    fn config(decode_capacity: u64) -> SimConfig {
        SimConfig {
            scheduler: SchedulerConfig {
                policy: Policy::Conductor,
                rejection: Rejection::None,
                slo: Slo {
                    ttft_s: 10.0,
                    tpot_s: 1.0,
                },
                block_size: NonZeroU32::new(10).unwrap(),
                bytes_per_token: 1,
                // Transfers take no time (1e-307 s).
                pool_bandwidth_bps: f64::MAX,
                kv_bandwidth_bps: f64::MAX,
                // 0.1 s per token, nothing else
                prefill_costs: vec![
                    PrefillCost {
                        fixed_s: 0.0,
                        linear_s: 0.1,
                        quadratic_s: 0.0,
                    };
                    1
                ],
                // 1 s per step
                decode_cost: DecodeCost {
                    fixed_s: 1.0,
                    per_seq_s: 0.0,
                    per_ctx_token_s: 0.0,
                },
                decode_kv_capacity_tokens: decode_capacity,
                hot: HotConfig {
                    threshold: 0,
                    fanout: 0,
                },
                seed: 1,
            },
            decode_instances: 1,
            local_cache_blocks: UNLIMITED,
            pool_blocks: UNLIMITED,
            time_scale: 1.0,
            autoscale: None,
        }
    }

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-6, "{a} != {b}");
    }

    fn rec(ts: u64, input: u64, output: u32, ids: &[u64]) -> TraceRecord {
        TraceRecord {
            timestamp_ms: ts,
            input_length: input,
            output_length: output,
            hash_ids: ids.to_vec(),
        }
    }

    /// A load one instance cannot carry (a 2 s prefill every second) then a quiet tail:
    /// autoscaling adds instances while it lasts and gives them back after, and meets the SLO
    /// where the one fixed instance does not, with fewer instance-seconds than four fixed.
    #[test]
    fn autoscaling_follows_the_load_and_saves_instance_seconds() {
        use crate::autoscale::Signal;
        use crate::sim::scaling::AutoscaleConfig;
        let mut records: Vec<TraceRecord> = (0..240u64)
            .map(|i| rec(i * 1000, 20, 2, &[1_000 + 2 * i, 1_001 + 2 * i]))
            .collect();
        records.extend((0..12u64).map(|i| rec(300_000 + i * 60_000, 20, 2, &[9_000 + i])));
        let mut fixed = config(u64::MAX);
        fixed.scheduler.slo.ttft_s = 8.0;
        fixed.scheduler.slo.tpot_s = 100.0;
        let mut four = fixed.clone();
        four.scheduler.prefill_costs = vec![fixed.scheduler.prefill_costs[0]; 4];
        let mut scaled = four.clone();
        scaled.autoscale = Some(AutoscaleConfig {
            startup_s: 5.0,
            ..AutoscaleConfig::new(1, 4, Signal::PredictedLatency)
        });
        let one = simulate(&records, &fixed).unwrap();
        let four = simulate(&records, &four).unwrap();
        let auto = simulate(&records, &scaled).unwrap();
        let a = auto.autoscale.expect("autoscaled");
        assert!(a.most > 1 && a.scale_ups >= 1, "{a:?}");
        assert!(a.scale_downs >= 1 && a.fewest == 1, "{a:?}");
        assert!(
            auto.slo_attainment > one.slo_attainment + 0.3,
            "{} vs {}",
            auto.slo_attainment,
            one.slo_attainment
        );
        assert!(
            auto.prefill_instance_s < 0.7 * four.prefill_instance_s,
            "{} vs {}",
            auto.prefill_instance_s,
            four.prefill_instance_s
        );
        assert!(four.autoscale.is_none());
        close(one.prefill_instance_s, one.makespan_s);
    }

    #[test]
    fn hand_computed_timeline() {
        // A: 20 tokens at 0 s -> prefill 2 s (TTFT 2), decode 3 tokens at 1 s/step: 2..5 s.
        // B: same prefix + 10 more at 1 s -> waits for A's prefill until 2 s, prefills only
        //    its 10 new tokens (1 s): TTFT 2 s, decodes 1 token 3..4 s alongside A.
        let records = [rec(0, 20, 4, &[1, 2]), rec(1000, 30, 2, &[1, 2, 3])];
        let (o, totals) = run(&records, &config(1000)).unwrap();
        assert_eq!(
            (o[0].ttft_s, o[0].decode_arrival_s, o[0].finish_s),
            (2.0, 2.0, 5.0)
        );
        assert_eq!(o[0].tpot_s(), 1.0);
        assert_eq!((o[1].matched_blocks, o[1].cached_tokens), (2, 20));
        // B reaches decode at 3 s, just as A's step ends, and joins the next step.
        assert_eq!((o[1].ttft_s, o[1].finish_s), (2.0, 4.0));
        assert_eq!(totals.prefill_busy_s, 3.0);
    }

    #[test]
    fn decode_memory_makes_requests_wait_in_order() {
        // Memory for 25 tokens: B (20 tokens) must wait until A (20 tokens) has finished.
        let records = [rec(0, 20, 3, &[1, 2]), rec(0, 20, 3, &[5, 6])];
        let (o, _) = run(&records, &config(25)).unwrap();
        // A: prefill 0..2 s, decode 2 tokens 2..4 s. B: prefill 2..4 s, joins at 4 s, 4..6 s.
        close(o[0].finish_s, 4.0);
        close(o[1].decode_arrival_s, 4.0);
        close(o[1].finish_s, 6.0);
        // Here prefill serialises them anyway; now let B arrive while A decodes.
        let records = [rec(0, 20, 5, &[1, 2]), rec(0, 1, 3, &[9])];
        let (o, _) = run(&records, &config(20)).unwrap();
        // A decodes 4 tokens 2..6 s holding all 20 tokens (+ growth); B (prefill 0.1 s) arrives
        // at 2.1 s and waits for A to leave at 6 s, then takes 2 steps: 6..8 s.
        close(o[0].finish_s, 6.0);
        close(o[1].finish_s, 8.0);
        close(o[1].tpot_s(), (8.0 - 2.1) / 2.0);
    }

    #[test]
    fn at_decode_rejection_refuses_after_the_prefill_was_spent() {
        // As in the second case above, B arrives at decode at 2.1 s while A holds all memory:
        // with at-decode rejection the decode instance refuses B then, after its 0.1 s of
        // prefill; A is served as before. Early rejection would have refused B at arrival (0 s)
        // only if decode looked full then, which it did not (A was still in prefill).
        let records = [rec(0, 20, 5, &[1, 2]), rec(0, 1, 3, &[9])];
        let mut cfg = config(20);
        cfg.scheduler.rejection = Rejection::AtDecode;
        let (o, totals) = run(&records, &cfg).unwrap();
        close(o[0].finish_s, 6.0);
        assert_eq!(o[0].rejected, None);
        assert_eq!(o[1].rejected, Some(RejectReason::DecodeMemory));
        close(o[1].decode_arrival_s, 2.1);
        // Both prefills were spent: 2 s + 0.1 s.
        close(totals.prefill_busy_s, 2.1);
        let mut early = config(20);
        early.scheduler.rejection = Rejection::Early;
        let (o, _) = run(&records, &early).unwrap();
        assert_eq!(o[1].rejected, None);
        // An idle decode instance takes anything, even at-decode.
        let (o, _) = run(&[rec(0, 30, 3, &[1, 2, 3])], &cfg).unwrap();
        assert_eq!(o[0].rejected, None);
    }

    #[test]
    fn empty_prompts_and_single_token_outputs_are_served() {
        let records = [rec(0, 0, 0, &[]), rec(0, 5, 1, &[4])];
        let (o, _) = run(&records, &config(100)).unwrap();
        assert!(
            o.iter()
                .all(|x| x.rejected.is_none() && x.finish_s > x.arrival_s)
        );
        assert_eq!(o[0].decode_tokens, 1);
        let mut bad = config(100);
        bad.time_scale = 0.0;
        assert_eq!(run(&records, &bad).unwrap_err().category(), "time_scale");
    }
}

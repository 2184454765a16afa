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
use super::decode_scaling::DecodeScaler;
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
    decode_scaler: Option<DecodeScaler>,
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
    let decode_scaler = config
        .autoscale_decode
        .map(|a| DecodeScaler::new(a, config.scheduler.slo.tpot_s, config.decode_instances));
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
        decode_scaler,
    };
    for (id, rec) in records.iter().enumerate() {
        let now = rec.timestamp_ms as f64 / 1000.0 / config.time_scale;
        while st.events.peek().is_some_and(|Reverse(e)| e.at_s <= now) {
            st.handle_next();
        }
        if let Some(s) = st.scaler.as_mut() {
            s.advance(now, &mut st.prefill, &mut st.local, &mut st.index);
        }
        st.advance_decode_scaler(now);
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
    match st.decode_scaler.take() {
        Some(s) => {
            let scaling = s.finish(end);
            st.totals.decode_instance_s = scaling.instance_s;
            st.totals.decode_scaling = Some(scaling);
        }
        None => st.totals.decode_instance_s = config.decode_instances as f64 * (end - first),
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

    /// Runs the decode scaler's decisions due by `now` on the decode instances' queues.
    fn advance_decode_scaler(&mut self, now: f64) {
        let Some(s) = self.decode_scaler.as_mut() else {
            return;
        };
        let queue_depth = self.waiting.iter().map(|w| w.len() as u64).sum();
        let busy: Vec<bool> = self
            .decode
            .iter()
            .map(|d| !d.running.is_empty() || !d.pending.is_empty())
            .collect();
        s.advance(now, queue_depth, &busy);
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
                    if let Some(s) = self.decode_scaler.as_mut() {
                        s.rejected(ev.at_s);
                    }
                    if !self.stepping[instance] {
                        self.note_idle(instance, ev.at_s);
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
        // With decode autoscaling, only the instances on and ready take new requests.
        let decode_ready = self
            .decode_scaler
            .as_ref()
            .map_or(self.decode.len(), |s| s.available(now));
        let placement = match self.sched.decide(
            now,
            &req,
            &self.index,
            &self.prefill,
            &self.decode[..decode_ready],
        ) {
            Decision::Reject(reason) => {
                if let (Some(s), RejectReason::Ttft { .. } | RejectReason::NoInstance) =
                    (self.scaler.as_mut(), reason)
                {
                    s.rejected(now);
                }
                if let (Some(s), RejectReason::Tpot { .. } | RejectReason::DecodeMemory) =
                    (self.decode_scaler.as_mut(), reason)
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
        if let Some(s) = self.decode_scaler.as_mut() {
            s.admitted(now, placement.tpot_s);
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
            self.note_idle(instance, now);
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

    /// Tells the decode scaler when an instance holds nothing any more (a drain ends).
    fn note_idle(&mut self, instance: usize, now: f64) {
        if let (Some(s), Some(d)) = (self.decode_scaler.as_mut(), self.decode.get(instance))
            && d.running.is_empty()
            && d.pending.is_empty()
        {
            s.idle(instance, now);
        }
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
mod tests;

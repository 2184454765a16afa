//! The conductor's bookkeeping between the scheduling policy and the engines ([`State`]): the
//! prefix index, a mirror of every prefill engine's cache, the prefill queues and decode loads
//! the policy reads, and the replication it plans; carried over engine-set changes by
//! [`State::regrouped`]. Pure: time is passed in, the server does the I/O.

use std::collections::VecDeque;
use std::num::NonZeroU32;

use kvpool_core::sched::{
    BlockKey, Decision, DecodeLoad, DecodeMember, Inserted, LruSet, PrefillLoad, PrefixIndex,
    RejectReason, Request, Scheduler, TtftEstimate,
};

use crate::config::ConductorConfig;
use crate::peer_load::{DecodeBooking, PeerLoad};

/// Errors of building the conductor's state.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum StateError {
    #[error("invalid scheduler configuration")]
    Config(#[source] kvpool_core::sched::ConfigError),
    #[error("invalid prefix index configuration")]
    Index(#[source] kvpool_core::sched::IndexError),
}

kvpool_runtime::error_category!(StateError);

/// The conductor's view of the cluster: the policy, the prefix index, a mirror of every prefill
/// engine's LRU cache, and the loads the policy reads. Time is passed in (seconds since start).
#[derive(Debug)]
pub struct State {
    scheduler: Scheduler,
    index: PrefixIndex,
    caches: Vec<LruSet>,
    prefill: Vec<PrefillLoad>,
    /// Per prefill instance, the requests sent to it and not yet prefilled, in order, with
    /// their estimated work in seconds.
    booked: Vec<VecDeque<(u64, f64)>>,
    decode: Vec<DecodeLoad>,
    /// Per running request: when it started decoding, its prompt, its output length and the
    /// tokens counted in its response so far (`None` before the first).
    started: std::collections::HashMap<u64, (f64, u64, u32, Option<u32>)>,
    block_size: NonZeroU32,
    next_request: u64,
    /// The replication planned by the last `place`, until `take_replication` collects it.
    replication: Option<ReplicationTask>,
    /// Per prefill instance: indexed from its own KV events (the routing mirror is skipped).
    fed: Vec<bool>,
    /// The other conductor replicas' bookings on these engines (empty when booking alone).
    peers: PeerLoad,
}

/// A hot prefix to copy into more prefill engines' caches. The server executes it by asking each
/// target engine to prefetch the blocks from the pool; the cache mirror assumes the copy only
/// once an engine reports it done ([`State::adopted`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicationTask {
    /// Keys of the prefix blocks to copy, first block first.
    pub keys: Vec<BlockKey>,
    /// Prefill instances that should receive them (indices into the prefill URLs).
    pub targets: Vec<usize>,
}

/// A request placed on instances; hand it back to `State` as it progresses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ticket {
    pub request: u64,
    pub prefill: usize,
    pub decode: usize,
    /// Estimated TTFT, seconds (`estimate.total_s()`).
    pub ttft_s: f64,
    /// Its parts: the queue, pool fetch and prefill on the prefill engine, then the hand-off.
    pub estimate: TtftEstimate,
    /// The prompt's tokens.
    pub prompt_tokens: u64,
    /// Estimated TPOT on the decode instance chosen, seconds.
    pub tpot_s: f64,
    /// Of the prompt's leading blocks the prefill instance need not compute, those it holds in
    /// its local cache.
    pub local_blocks: u32,
    /// And those it fetches from the pool.
    pub pool_blocks: u32,
    /// Prompt tokens the prefill instance computes (those after the cached prefix).
    pub uncached_tokens: u64,
    /// Whether nothing else was booked on the prefill instance when this request was placed:
    /// its prefill time is then the engine's own compute, without queueing behind others.
    pub found_idle: bool,
}

/// Why a request was refused at arrival: the policy's reason, and the reason it would be
/// refused on an idle pool too (`None` when the load is to blame, so that a retry may succeed).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Refusal {
    pub reason: RejectReason,
    pub when_idle: Option<RejectReason>,
}

impl State {
    pub fn new(config: &ConductorConfig) -> Result<Self, StateError> {
        let scheduler = Scheduler::new(config.scheduler.clone(), config.decode.len())
            .map_err(StateError::Config)?;
        let n = scheduler.prefill_instances();
        Ok(Self {
            index: PrefixIndex::new(n).map_err(StateError::Index)?,
            caches: (0..n)
                .map(|_| LruSet::new(config.engine_cache_blocks))
                .collect(),
            prefill: vec![PrefillLoad::default(); n],
            booked: vec![VecDeque::new(); n],
            decode: vec![DecodeLoad::default(); config.decode.len()],
            started: Default::default(),
            block_size: config.scheduler.block_size,
            next_request: 1,
            replication: None,
            fed: vec![false; n],
            peers: PeerLoad::default(),
            scheduler,
        })
    }

    /// Decides where a request goes (or rejects it) and books it: the prefill instance's queue
    /// grows by the estimated work, its cache (and the index) gets the prompt's blocks, and the
    /// decode instance expects the request when prefill and transfer are done.
    pub fn place(
        &mut self,
        now_s: f64,
        keys: &[BlockKey],
        input_tokens: u64,
        output_tokens: u32,
    ) -> Result<Ticket, Refusal> {
        self.place_with_pool(now_s, keys, 0, input_tokens, output_tokens)
    }

    /// [`State::place`] knowing that the pool holds the first `pool_blocks` of `keys` (the
    /// master's answer for this request; 0 when unknown). Those blocks count as pool replicas in
    /// the prefix index for this decision only: the master's answer is fresh per request, so
    /// nothing stale stays behind. An instance then fetches them at the pool bandwidth instead of
    /// prefilling them, unless it holds them locally.
    pub fn place_with_pool(
        &mut self,
        now_s: f64,
        keys: &[BlockKey],
        pool_blocks: usize,
        input_tokens: u64,
        output_tokens: u32,
    ) -> Result<Ticket, Refusal> {
        let in_pool = keys.get(..pool_blocks).unwrap_or(keys);
        for &k in in_pool {
            self.index.add_pool_replica(k);
        }
        let req = Request {
            keys,
            input_tokens,
            output_tokens,
        };
        let placed = self.place_request(now_s, &req);
        for &k in in_pool {
            self.index.remove_pool_replica(k);
        }
        placed
    }

    fn place_request(&mut self, now_s: f64, req: &Request<'_>) -> Result<Ticket, Refusal> {
        let Request {
            keys,
            input_tokens,
            output_tokens,
        } = *req;
        self.advance_decode(now_s);
        // An engine is busy for at least the work booked behind its first unanswered request,
        // even when the queue model says it should be done (an engine slower than its fit).
        let own_busy = self.prefill_busy(now_s);
        let own_view: Vec<PrefillLoad> = own_busy
            .iter()
            .map(|b| PrefillLoad {
                free_at_s: now_s + b,
            })
            .collect();
        // With other replicas' bookings, the policy sees the engines as loaded by both.
        let shared_views = (!self.peers.is_empty()).then(|| {
            (
                self.peers.prefill_view(&own_view, &own_busy, now_s),
                self.peers.decode_view(&self.decode, now_s),
            )
        });
        let (prefill_view, decode_view) = match &shared_views {
            Some((p, d)) => (p.as_slice(), d.as_slice()),
            None => (own_view.as_slice(), self.decode.as_slice()),
        };
        let p = match self
            .scheduler
            .decide(now_s, req, &self.index, prefill_view, decode_view)
        {
            Decision::Accept(p) => p,
            Decision::Reject(reason) => {
                let when_idle =
                    self.scheduler
                        .refused_when_idle(now_s, req, &self.index, self.prefill.len());
                return Err(Refusal { reason, when_idle });
            }
        };
        // Hit counters of the matched blocks; a block reaching a multiple of the hot threshold
        // plans a copy of its prefix to the least loaded instances that lack it.
        self.replication = self
            .scheduler
            .record_hits(&mut self.index, keys, &p, prefill_view, now_s)
            .map(|r| ReplicationTask {
                keys: keys.get(..r.blocks).unwrap_or(keys).to_vec(),
                targets: r.targets,
            });
        let work = p.ttft.fetch_s + p.ttft.prefill_s;
        let busy = own_busy.get(p.prefill).copied().unwrap_or(0.0);
        let load = &mut self.prefill[p.prefill];
        load.free_at_s = now_s + busy + work;
        self.cache_blocks(p.prefill, keys);
        let request = self.next_request;
        self.next_request += 1;
        let found_idle = self.booked.get(p.prefill).is_none_or(VecDeque::is_empty);
        if let Some(q) = self.booked.get_mut(p.prefill) {
            q.push_back((request, work));
        }
        self.decode[p.decode].pending.push(DecodeMember {
            request,
            context_tokens: input_tokens,
            remaining_tokens: output_tokens,
            // The measured hand-off covers the KV transfer where it is fitted.
            joins_at_s: now_s + p.ttft.total_s() - p.ttft.handoff_s
                + p.ttft.handoff_s.max(p.kv_transfer_s),
        });
        Ok(Ticket {
            request,
            prefill: p.prefill,
            decode: p.decode,
            ttft_s: p.ttft.total_s(),
            estimate: p.ttft,
            prompt_tokens: input_tokens,
            tpot_s: p.tpot_s,
            local_blocks: p.prefix.local_blocks,
            pool_blocks: p.prefix.pool_blocks(),
            uncached_tokens: input_tokens.saturating_sub(
                u64::from(p.prefix.matched_blocks) * u64::from(self.block_size.get()),
            ),
            found_idle,
        })
    }

    /// Prefill instance `instance` now holds `keys` (a prompt's leading blocks, first first) in
    /// its cache: the mirror and the prefix index follow, the first block most recently used.
    fn cache_blocks(&mut self, instance: usize, keys: &[BlockKey]) {
        if self.fed.get(instance).copied().unwrap_or(false) {
            return;
        }
        if let Some(cache) = self.caches.get_mut(instance) {
            for &k in keys.iter().rev() {
                if let Inserted::Added { evicted } = cache.insert(k) {
                    self.index.add_local(k, instance);
                    if let Some(e) = evicted {
                        self.index.remove_local(e, instance);
                    }
                }
            }
        }
    }

    /// A prefetch (replication) into prefill instance `instance` succeeded: it loaded `keys`
    /// from the pool, so later placements count them as local there. Unknown instances are
    /// ignored.
    pub fn adopted(&mut self, instance: usize, keys: &[BlockKey]) {
        self.cache_blocks(instance, keys);
    }

    /// Prefill instance `instance` is indexed from its KV events from now on: its routing
    /// mirror is dropped (from the index too) and no longer updated. Unknown instances are
    /// ignored.
    pub fn feed_from_events(&mut self, instance: usize) {
        let Some(fed) = self.fed.get_mut(instance) else {
            return;
        };
        if std::mem::replace(fed, true) {
            return;
        }
        if let Some(cache) = self.caches.get_mut(instance) {
            let keys: Vec<BlockKey> = cache.iter().collect();
            *cache = LruSet::new(0);
            for k in keys {
                self.index.remove_local(k, instance);
            }
        }
    }

    /// Blocks the routing mirror of prefill instance `instance` holds; `None` when it is fed
    /// from KV events (or unknown).
    pub fn mirror_blocks(&self, instance: usize) -> Option<usize> {
        if self.fed.get(instance).copied().unwrap_or(true) {
            return None;
        }
        self.caches.get(instance).map(LruSet::len)
    }

    /// Applies the index changes of prefill instance `instance`'s KV events.
    pub fn apply_event_deltas(&mut self, instance: usize, deltas: &[crate::kv_events::Delta]) {
        use crate::kv_events::Delta;
        if instance >= self.fed.len() {
            return;
        }
        self.feed_from_events(instance);
        for d in deltas {
            match *d {
                Delta::Added(k) => self.index.add_local(k, instance),
                Delta::Removed(k) => self.index.remove_local(k, instance),
            }
        }
    }

    /// The pool -> prefill bandwidth the next placements assume (a measured figure).
    pub fn set_pool_bandwidth(&mut self, bps: f64) {
        self.scheduler.set_pool_bandwidth_bps(bps);
    }

    /// The prefill cost model the next placements assume for instance `instance` (a fitted
    /// one); unknown instances and invalid models are ignored.
    pub fn set_prefill_cost(&mut self, instance: usize, cost: kvpool_core::sched::PrefillCost) {
        self.scheduler.set_prefill_cost(instance, cost);
    }

    /// Restricts the next placements to the `eligible` instances (the engines that serve a
    /// request's model); `Eligible::default()` lifts it.
    pub fn set_eligible(&mut self, eligible: kvpool_core::sched::Eligible) {
        self.scheduler.set_eligible(eligible);
    }

    /// The decode cost model the next placements assume (a fitted one).
    pub fn set_decode_cost(&mut self, cost: kvpool_core::sched::DecodeCost) {
        self.scheduler.set_decode_cost(cost);
    }

    /// The hand-off model the next placements assume (a fitted one).
    pub fn set_handoff_cost(&mut self, cost: kvpool_core::sched::HandoffCost) {
        self.scheduler.set_handoff_cost(cost);
    }

    /// The prefill cost model placements assume for instance `instance`.
    pub fn prefill_cost(&self, instance: usize) -> Option<kvpool_core::sched::PrefillCost> {
        self.scheduler.config().prefill_costs.get(instance).copied()
    }

    /// What this replica has booked, for the others (`ShareLoad`): per prefill instance the
    /// seconds of work of the requests booked and not yet prefilled, in full (this replica
    /// cannot tell whether the engine has started any of them: the other replicas' requests
    /// may be ahead), per decode instance its booking.
    pub fn own_load(&self) -> (Vec<f64>, Vec<DecodeBooking>) {
        let prefill = self
            .booked
            .iter()
            .map(|q| q.iter().map(|&(_, w)| w).sum())
            .collect();
        (prefill, self.decode.iter().map(DecodeBooking::of).collect())
    }

    /// Per prefill instance, seconds of this replica's work still to do there: what its own
    /// queue model says, but never less than the work of the requests booked behind the first
    /// one. Those have not started as far as anyone knows: with other replicas' requests in
    /// the engine's queue, they start later than this replica's model assumes, and counting
    /// them done at their predicted time would let every replica book the engine again.
    fn prefill_busy(&self, now_s: f64) -> Vec<f64> {
        self.prefill
            .iter()
            .zip(&self.booked)
            .map(|(l, q)| {
                let waiting: f64 = q.iter().skip(1).map(|&(_, w)| w).sum();
                (l.free_at_s - now_s).max(waiting).max(0.0)
            })
            .collect()
    }

    /// The other replicas' bookings on these engines, by instance index, from now on.
    pub fn set_peer_load(&mut self, peers: PeerLoad) {
        self.peers = peers;
    }

    /// The replication planned by the last accepted `place`, if any (taken once).
    pub fn take_replication(&mut self) -> Option<ReplicationTask> {
        self.replication.take()
    }

    /// The request's prefill finished at `now_s`: it and everything booked before it on the
    /// instance are done; the instance is busy for the work booked after it.
    pub fn prefilled(&mut self, ticket: &Ticket, now_s: f64) {
        let (Some(q), Some(load)) = (
            self.booked.get_mut(ticket.prefill),
            self.prefill.get_mut(ticket.prefill),
        ) else {
            return;
        };
        if let Some(pos) = q.iter().position(|&(r, _)| r == ticket.request) {
            q.drain(..=pos);
        }
        load.free_at_s = now_s + q.iter().map(|&(_, w)| w).sum::<f64>();
    }

    /// The request started decoding.
    pub fn decoding(&mut self, ticket: &Ticket, now_s: f64) {
        if let Some(d) = self.decode.get_mut(ticket.decode)
            && let Some(pos) = d.pending.iter().position(|m| m.request == ticket.request)
        {
            let mut m = d.pending.swap_remove(pos);
            m.joins_at_s = now_s;
            self.started.insert(
                m.request,
                (now_s, m.context_tokens, m.remaining_tokens, None),
            );
            d.running.push(m);
        }
    }

    /// The decode engine's response has carried `generated` tokens of the request so far (counted
    /// by the relay): its remaining work and context follow them instead of the estimate. Never
    /// reaches zero remaining: a request stays until its response ends.
    pub fn decode_progress(&mut self, ticket: &Ticket, generated: u32) {
        let Some(entry) = self.started.get_mut(&ticket.request) else {
            return;
        };
        entry.3 = Some(generated);
        let (_, prompt, total, _) = *entry;
        if let Some(d) = self.decode.get_mut(ticket.decode)
            && let Some(m) = d.running.iter_mut().find(|m| m.request == ticket.request)
        {
            let done = generated.min(total.saturating_sub(1));
            m.remaining_tokens = total - done;
            m.context_tokens = prompt + u64::from(done);
        }
    }

    /// Requests waiting now: on prefill, booked and not yet prefilled; on decode, booked and
    /// not yet in a running batch. The conductor's load endpoint reports them.
    pub fn queue_depths(&self) -> (u64, u64) {
        let prefill = self.booked.iter().map(|q| q.len() as u64).sum();
        let decode = self.decode.iter().map(|d| d.pending.len() as u64).sum();
        (prefill, decode)
    }

    /// Per decode instance: the requests booked and the output tokens they still expect.
    pub fn decode_remaining(&self) -> Vec<(usize, u64)> {
        self.decode
            .iter()
            .map(|d| {
                let members = d.running.iter().chain(&d.pending);
                (
                    d.running.len() + d.pending.len(),
                    members.map(|m| u64::from(m.remaining_tokens)).sum(),
                )
            })
            .collect()
    }

    /// Estimates how far every running request has got since it started decoding: the tokens
    /// counted in its response when there are any ([`State::decode_progress`]), else at the
    /// instance's current step time, so the prediction sees shrinking remaining work and
    /// growing context. Never reaches zero: a request stays until its response ends.
    fn advance_decode(&mut self, now_s: f64) {
        let cost = self.scheduler.config().decode_cost;
        for d in &mut self.decode {
            let batch = d.running.len() as u64;
            let ctx: u64 = d.running.iter().map(|m| m.context_tokens).sum();
            let step = cost.step_seconds(batch, ctx);
            for m in &mut d.running {
                if let Some(&(start, prompt, total, seen)) = self.started.get(&m.request) {
                    let steps = if let Some(seen) = seen {
                        u64::from(seen)
                    } else if step > 0.0 {
                        ((now_s - start).max(0.0) / step).floor() as u64
                    } else {
                        0
                    };
                    let done = steps.min(u64::from(total.saturating_sub(1))) as u32;
                    m.remaining_tokens = total - done;
                    m.context_tokens = prompt + u64::from(done);
                }
            }
        }
    }

    /// The request is finished (or abandoned): it leaves decode, and its prefill booking if it
    /// never got there.
    pub fn finished(&mut self, ticket: &Ticket) {
        if let (Some(q), Some(load)) = (
            self.booked.get_mut(ticket.prefill),
            self.prefill.get_mut(ticket.prefill),
        ) && let Some(pos) = q.iter().position(|&(r, _)| r == ticket.request)
            && let Some((_, work)) = q.remove(pos)
        {
            load.free_at_s -= work;
        }
        if let Some(d) = self.decode.get_mut(ticket.decode) {
            d.pending.retain(|m| m.request != ticket.request);
            d.running.retain(|m| m.request != ticket.request);
        }
        self.started.remove(&ticket.request);
    }

    /// The state for a new engine set (`config` already serves it, see
    /// [`ConductorConfig::with_engines`]). `prefill_from[i]` / `decode_from[i]` name the index
    /// instance `i` had in `self`, or `None` for a new instance, which starts empty. Survivors
    /// keep their cache mirror (re-entered in a fresh prefix index), bookings and decode load;
    /// instances that left drop out of the index and the load tables. Hit counters restart.
    pub fn regrouped(
        mut self,
        config: &ConductorConfig,
        prefill_from: &[Option<usize>],
        decode_from: &[Option<usize>],
    ) -> Result<Self, StateError> {
        let mut next = State::new(config)?;
        for (i, from) in prefill_from.iter().enumerate() {
            let Some(old) = *from else { continue };
            if let (Some(cache), Some(slot)) = (self.caches.get_mut(old), next.caches.get_mut(i)) {
                std::mem::swap(cache, slot);
                // Least recently used first, so the index sees the same set either way.
                let keys: Vec<BlockKey> = slot.iter().collect();
                for k in keys.into_iter().rev() {
                    next.index.add_local(k, i);
                }
            }
            if let (Some(load), Some(slot)) = (self.prefill.get(old), next.prefill.get_mut(i)) {
                *slot = *load;
            }
            if let (Some(q), Some(slot)) = (self.booked.get_mut(old), next.booked.get_mut(i)) {
                std::mem::swap(q, slot);
            }
        }
        for (i, from) in decode_from.iter().enumerate() {
            let Some(old) = *from else { continue };
            if let (Some(d), Some(slot)) = (self.decode.get_mut(old), next.decode.get_mut(i)) {
                std::mem::swap(d, slot);
            }
        }
        // Requests on instances that left are gone with them; ids keep counting so that a
        // ticket issued before the change never names a newer request.
        let alive: std::collections::HashSet<u64> = next
            .decode
            .iter()
            .flat_map(|d| d.running.iter().chain(d.pending.iter()).map(|m| m.request))
            .collect();
        next.started = std::mem::take(&mut self.started);
        next.started.retain(|r, _| alive.contains(r));
        next.next_request = self.next_request;
        Ok(next)
    }

    pub fn block_size(&self) -> NonZeroU32 {
        self.block_size
    }

    /// When each prefill instance is expected to be free, seconds.
    pub fn prefill_free_at(&self) -> Vec<f64> {
        self.prefill.iter().map(|l| l.free_at_s).collect()
    }

    /// Requests booked on each prefill instance and not yet prefilled.
    pub fn prefill_booked(&self) -> Vec<usize> {
        self.booked.iter().map(|q| q.len()).collect()
    }

    /// Requests booked on each decode instance (running plus expected).
    pub fn decode_counts(&self) -> Vec<usize> {
        self.decode
            .iter()
            .map(|d| d.running.len() + d.pending.len())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use crate::engines::{Engines, RoutingProtocol};
    use crate::tokenize;
    use kvpool_core::sched::{HotConfig, Policy, Rejection, SchedulerConfig, Slo};

    fn config() -> ConductorConfig {
        ConductorConfig {
            models: vec!["m".into()],
            prefill: vec!["http://a".into(), "http://b".into()],
            decode: vec!["http://c".into()],
            scheduler: SchedulerConfig {
                policy: Policy::Conductor,
                rejection: Rejection::None,
                slo: Slo {
                    ttft_s: 30.0,
                    tpot_s: 0.1,
                },
                block_size: NonZeroU32::new(10).unwrap(),
                bytes_per_token: 1,
                pool_bandwidth_bps: 1e9,
                kv_bandwidth_bps: 1e9,
                // 10 ms per token
                prefill_costs: vec![
                    kvpool_core::sched::PrefillCost {
                        fixed_s: 0.0,
                        linear_s: 0.01,
                        quadratic_s: 0.0,
                    };
                    2
                ],
                decode_cost: kvpool_core::sched::DecodeCost::default(),
                handoff: Default::default(),
                decode_kv_capacity_tokens: 1_000_000,
                hot: HotConfig {
                    threshold: 0,
                    fanout: 0,
                },
                seed: 1,
            },
            engine_cache_blocks: 100,
            tokenizer: tokenize::PromptTokenizer::Chunks { bytes: 4 },
            chat_template: None,
            pool: None,
            protocol: RoutingProtocol::Vllm,
            time_scale: 1.0,
            hashing: kvpool_core::sched::BlockHashing::Kvpool,
            kv_events: Vec::new(),
            kv_events_port: None,
            fit_prefill_cost: false,
            upstream: Default::default(),
            max_prompts: crate::config::DEFAULT_MAX_PROMPTS,
            access: Default::default(),
        }
    }

    #[test]
    fn a_refusal_says_whether_an_idle_pool_would_refuse_too() {
        let mut cfg = config();
        cfg.scheduler.rejection = Rejection::Early;
        // 10 ms per token: 100 tokens take 1 s, within a 1.5 s objective on an idle instance.
        cfg.scheduler.slo.ttft_s = 1.5;
        let mut st = State::new(&cfg).unwrap();
        st.place(0.0, &[1], 100, 5).unwrap();
        st.place(0.0, &[2], 100, 5).unwrap();
        // Both instances are busy for 1 s: the third waits, 2 s > 1.5 s; load is to blame.
        let busy = st.place(0.0, &[3], 100, 5).unwrap_err();
        assert!(matches!(busy.reason, RejectReason::Ttft { .. }));
        assert_eq!(busy.when_idle, None);
        // 200 tokens take 2 s on any instance, idle or not.
        let never = st.place(0.0, &[4], 200, 5).unwrap_err();
        assert!(matches!(
            never.when_idle,
            Some(RejectReason::Ttft { estimate_s }) if (estimate_s - 2.0).abs() < 1e-9
        ));
    }

    #[test]
    fn an_engine_slower_than_its_model_stays_busy_for_the_work_booked_behind() {
        let mut cfg = config();
        cfg.prefill.truncate(1);
        cfg.scheduler.prefill_costs.truncate(1);
        let mut st = State::new(&cfg).unwrap();
        // Three prompts of 100 tokens (1 s each) booked at 0 s on the one engine.
        let a = st.place(0.0, &[1], 100, 5).unwrap();
        st.place(0.0, &[2], 100, 5).unwrap();
        st.place(0.0, &[3], 100, 5).unwrap();
        // At 10 s the model has them all done, but none has answered: the two behind the first
        // have not started as far as anyone knows, so a fourth still queues 2 s.
        let d = st.place(10.0, &[4], 100, 5).unwrap();
        assert!((d.estimate.queue_s - 2.0).abs() < 1e-9, "{:?}", d.estimate);
        assert!((d.ttft_s - 3.0).abs() < 1e-9, "{}", d.ttft_s);
        // Once the first answers, the others are still owed; the fourth's booking is kept.
        st.prefilled(&a, 10.5);
        let e = st.place(10.5, &[5], 100, 5).unwrap();
        assert!((e.estimate.queue_s - 3.0).abs() < 1e-9, "{:?}", e.estimate);
    }

    #[test]
    fn measured_pool_bandwidth_changes_the_fetch_term() {
        let mut st = State::new(&config()).unwrap();
        // As in the test below: 2 pool blocks of 10 bytes at 1 GB/s cost 2e-8 s...
        let a = st.place_with_pool(0.0, &[1, 2, 3], 2, 30, 5).unwrap();
        assert!((a.ttft_s - (0.1 + 2e-8)).abs() < 1e-12, "{}", a.ttft_s);
        // ...and 0.5 s at a measured 40 bytes per second (instance 1 is idle).
        st.set_pool_bandwidth(40.0);
        let b = st.place_with_pool(0.0, &[4, 5, 6], 2, 30, 5).unwrap();
        assert_eq!(b.prefill, 1);
        assert!((b.ttft_s - (0.1 + 0.5)).abs() < 1e-12, "{}", b.ttft_s);
        // Nonsense is ignored.
        st.set_pool_bandwidth(0.0);
        st.set_pool_bandwidth(f64::NAN);
        assert!((st.scheduler.config().pool_bandwidth_bps - 40.0).abs() < 1e-12);
    }

    #[test]
    fn hot_prefixes_become_replication_tasks() {
        let mut cfg = config();
        cfg.prefill.push("http://d".into());
        cfg.scheduler
            .prefill_costs
            .push(cfg.scheduler.prefill_costs[0]);
        cfg.scheduler.hot = HotConfig {
            threshold: 2,
            fanout: 1,
        };
        let mut st = State::new(&cfg).unwrap();
        let keys = [1, 2, 3];
        // First request: nothing cached, no hits, no task. It lands on instance 0 (0.3 s).
        let a = st.place(0.0, &keys, 30, 5).unwrap();
        assert_eq!(a.prefill, 0);
        assert_eq!(st.take_replication(), None);
        // Second, same prompt: instance 0 matches all 3 blocks (hit 1 each), still no task.
        let b = st.place(0.0, &keys, 30, 5).unwrap();
        assert_eq!(b.prefill, 0);
        assert_eq!(st.take_replication(), None);
        // Third: the blocks reach 2 hits, the threshold. The whole 3-block prefix is planned for
        // the least loaded instance that lacks it: 1 and 2 are both idle, ties by index -> 1.
        let c = st.place(0.0, &keys, 30, 5).unwrap();
        assert_eq!(c.prefill, 0);
        assert_eq!(
            st.take_replication(),
            Some(ReplicationTask {
                keys: vec![1, 2, 3],
                targets: vec![1],
            })
        );
        // Taken once; the mirror does not pretend instance 1 got the copy...
        assert_eq!(st.take_replication(), None);
        assert!(!st.index.holders(1).contains(1));
        // ...until the engine reports that it loaded the first two blocks.
        st.adopted(1, &[1, 2]);
        assert!(st.index.holders(1).contains(1));
        assert!(st.index.holders(2).contains(1));
        assert!(!st.index.holders(3).contains(1));
        st.adopted(99, &[1]);
        // A rejected or unrelated request plans nothing.
        st.place(0.0, &[9], 10, 5).unwrap();
        assert_eq!(st.take_replication(), None);
    }

    #[test]
    fn pool_blocks_are_fetched_instead_of_prefilled_for_this_decision_only() {
        let mut st = State::new(&config()).unwrap();
        let keys = [1, 2, 3];
        // The pool holds the first 2 of 3 blocks, no engine holds any: 20 bytes fetched at
        // 1 GB/s (2e-8 s) and 10 tokens prefilled (0.1 s), on the first idle instance.
        let a = st.place_with_pool(0.0, &keys, 2, 30, 5).unwrap();
        assert_eq!((a.prefill, a.local_blocks, a.pool_blocks), (0, 0, 2));
        assert!((a.ttft_s - (0.1 + 2e-8)).abs() < 1e-12, "{}", a.ttft_s);
        // The pool's answer is not remembered; instance 0 now mirrors all 3 blocks locally.
        assert_eq!(st.index.pool_replicas(1), 0);
        assert!(st.index.holders(3).contains(0));
        // A different prompt wholly in the pool: instance 1 (idle) fetches all 3 blocks and
        // prefills nothing; instance 0 would queue behind a's 0.1 s.
        let b = st.place_with_pool(0.0, &[4, 5, 6], 3, 30, 5).unwrap();
        assert_eq!((b.prefill, b.local_blocks, b.pool_blocks), (1, 0, 3));
        assert!((b.ttft_s - 3e-8).abs() < 1e-12, "{}", b.ttft_s);
        // More pool blocks than keys is clamped to the keys.
        let c = st.place_with_pool(0.0, &[7], 5, 10, 5).unwrap();
        assert_eq!(c.pool_blocks, 1);
        assert_eq!(st.index.pool_replicas(7), 0);
        // Without the pool the same unseen prompt is prefilled in full (0.3 s).
        let d = st.place(0.0, &[8, 9, 10], 30, 5).unwrap();
        assert_eq!(d.pool_blocks, 0);
        assert!(d.ttft_s >= 0.3 - 1e-12, "{}", d.ttft_s);
    }

    #[test]
    fn bookings_follow_placement_completion_and_abandonment() {
        let mut st = State::new(&config()).unwrap();
        let keys = [1, 2, 3];
        // 30 tokens, nothing cached: 0.3 s on instance 0 (ties go to the first).
        let a = st.place(0.0, &keys, 30, 5).unwrap();
        assert_eq!(a.prefill, 0);
        assert!((a.ttft_s - 0.3).abs() < 1e-12);
        assert!(a.found_idle);
        assert_eq!(a.uncached_tokens, 30);
        // The same prompt again: instance 0 has it cached (0 s of prefill) but is busy 0.3 s;
        // instance 1 would take 0.3 s. Tie -> instance 0, with nothing more to do.
        let b = st.place(0.0, &keys, 30, 5).unwrap();
        assert_eq!(b.prefill, 0);
        assert!((b.ttft_s - 0.3).abs() < 1e-12);
        assert!(!b.found_idle, "queued behind a");
        assert_eq!(b.uncached_tokens, 0);
        // A different prompt goes to the idle instance 1.
        let c = st.place(0.0, &[7, 8], 20, 5).unwrap();
        assert_eq!(c.prefill, 1);
        assert_eq!(st.decode_counts(), vec![3]);
        // a finishes prefill early, at 0.1 s: instance 0 is then only busy with b (0 s).
        st.prefilled(&a, 0.1);
        assert!((st.prefill_free_at()[0] - 0.1).abs() < 1e-12);
        st.decoding(&a, 0.1);
        // Decode step alone with 30 tokens: 0.015 + 0.0002 + 30 x 2e-8 = 0.0152006 s; by 0.13 s
        // a has made 1 step (0.03 / 0.0152 = 1.97): 4 tokens left, 31 tokens of context.
        st.advance_decode(0.13);
        let m = st.decode[0].running[0];
        assert_eq!((m.remaining_tokens, m.context_tokens), (4, 31));
        // Much later it is capped at one token left.
        st.advance_decode(100.0);
        assert_eq!(st.decode[0].running[0].remaining_tokens, 1);
        // Counted tokens replace the estimate, and stay over later estimates.
        st.decode_progress(&a, 2);
        st.advance_decode(200.0);
        let m = st.decode[0].running[0];
        assert_eq!((m.remaining_tokens, m.context_tokens), (3, 32));
        assert_eq!(st.decode_remaining()[0].0, 3);
        st.finished(&a);
        assert!(st.started.is_empty());
        // c is abandoned before its prefill: instance 1's booking goes away.
        st.finished(&c);
        assert!(st.prefill_free_at()[1].abs() < 1e-12);
        assert_eq!(st.decode_counts(), vec![1]);
    }

    #[test]
    fn regrouping_keeps_survivors_and_forgets_the_departed() {
        let cfg = config();
        let mut st = State::new(&cfg).unwrap();
        // a on instance 0 (caches 1,2,3), b on instance 1 (caches 7,8).
        let a = st.place(0.0, &[1, 2, 3], 30, 5).unwrap();
        let b = st.place(0.0, &[7, 8], 20, 5).unwrap();
        assert_eq!((a.prefill, b.prefill), (0, 1));
        let old = cfg.engines();
        // Instance "http://a" leaves, "http://e" joins; the decode engine stays.
        let next = old.stable_order(&Engines {
            prefill: vec!["http://e".into(), "http://b".into()],
            decode: vec!["http://c".into()],
            ..Engines::default()
        });
        assert_eq!(
            next.prefill,
            vec!["http://b".to_owned(), "http://e".to_owned()]
        );
        let cfg2 = cfg.with_engines(&next);
        assert_eq!(cfg2.scheduler.prefill_costs.len(), 2);
        let mut st = st.regrouped(&cfg2, &[Some(1), None], &[Some(0)]).unwrap();
        // b's instance is now 0, with its cache and its booking; the departed blocks are gone.
        assert!(st.index.holders(7).contains(0));
        assert!(st.index.holders(1).is_empty());
        assert!((st.prefill_free_at()[0] - 0.2).abs() < 1e-12);
        assert!(
            st.prefill_free_at()[1].abs() < 1e-12,
            "a new instance starts idle"
        );
        assert_eq!(st.decode_counts(), vec![2], "decode bookings stay");
        // Request ids keep counting past the change.
        let c = st.place(0.0, &[9], 10, 5).unwrap();
        assert!(c.request > b.request);
        // A request whose prefill instance left still leaves decode when it finishes.
        st.finished(&Ticket {
            prefill: usize::MAX,
            ..a
        });
        assert_eq!(st.decode_counts(), vec![2]);
    }
}

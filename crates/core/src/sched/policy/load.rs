//! Instance loads as the scheduler sees them: a prefill instance's queue, a decode instance's
//! running batch and assigned requests, and the decode load predicted for a later time
//! (requests finishing and arriving by then, and when KV memory admits a new request). Pure;
//! the caller passes the loads and the current time.

use crate::sched::cost::DecodeCost;

/// Load of a prefill instance: it runs requests one after another and is busy until `free_at_s`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefillLoad {
    pub free_at_s: f64,
}

/// A request assigned to a decode instance.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeMember {
    /// Caller's request id.
    pub request: u64,
    /// KV tokens the request holds now (prompt plus tokens generated so far).
    pub context_tokens: u64,
    /// Tokens still to generate.
    pub remaining_tokens: u32,
    /// When it arrives (or arrived) at the decode instance.
    pub joins_at_s: f64,
}

/// Load of a decode instance: the running batch and the requests assigned to it that are still
/// in prefill, in transfer, or waiting for KV memory.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DecodeLoad {
    pub running: Vec<DecodeMember>,
    pub pending: Vec<DecodeMember>,
}

/// Batch size and KV tokens of a decode instance at some time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeView {
    pub batch: u64,
    pub context_tokens: u64,
}

impl DecodeLoad {
    /// The load now: running requests plus those already waiting at the instance.
    pub fn current(&self, now_s: f64) -> DecodeView {
        let mut v = DecodeView::default();
        for m in self
            .running
            .iter()
            .chain(self.pending.iter().filter(|m| m.joins_at_s <= now_s))
        {
            v.batch += 1;
            v.context_tokens += m.context_tokens;
        }
        v
    }

    /// The requests predicted to be on the instance at `at_s`, as `(predicted finish, context
    /// tokens at at_s)`: running requests leave when their remaining tokens are done at the
    /// current step time; assigned requests join when they arrive.
    fn predicted_members(
        &self,
        now_s: f64,
        at_s: f64,
        cost: &DecodeCost,
        out: &mut Vec<(f64, u64)>,
    ) {
        out.clear();
        let mut batch = 0u64;
        let mut ctx = 0u64;
        for m in &self.running {
            batch += 1;
            ctx += m.context_tokens;
        }
        let step = cost.step_seconds(batch, ctx);
        let steps_ahead = if step > 0.0 {
            ((at_s - now_s).max(0.0) / step).floor()
        } else {
            f64::INFINITY
        };
        for m in &self.running {
            let remaining = f64::from(m.remaining_tokens);
            if remaining > steps_ahead {
                out.push((
                    now_s + remaining * step,
                    m.context_tokens + steps_ahead as u64,
                ));
            }
        }
        for m in self.pending.iter().filter(|m| m.joins_at_s <= at_s) {
            let finish = m.joins_at_s.max(now_s) + f64::from(m.remaining_tokens) * step;
            out.push((finish, m.context_tokens));
        }
    }

    /// The load predicted at `at_s` (see `predicted_members`).
    pub fn predicted(&self, now_s: f64, at_s: f64, cost: &DecodeCost) -> DecodeView {
        let mut members = Vec::new();
        self.predicted_members(now_s, at_s, cost, &mut members);
        DecodeView {
            batch: members.len() as u64,
            context_tokens: members.iter().map(|m| m.1).sum(),
        }
    }

    /// Predicts admitting a request of `tokens` context that arrives at `at_s` on an instance
    /// holding `capacity` KV tokens. Replays the instance's admission queue forward in time:
    /// running requests finish after their remaining tokens at the current step time; assigned
    /// requests arriving before this one are admitted first, in arrival order, each as soon as
    /// enough earlier ones have finished; the step time is that of the batch with the queue
    /// joined. Returns the load the request would join and how long
    /// it would wait for memory; `None` when it cannot fit even alone. `scratch` holds
    /// `(finish, tokens)` of admitted requests and is reused between calls.
    pub fn predicted_admission(
        &self,
        now_s: f64,
        at_s: f64,
        cost: &DecodeCost,
        capacity: u64,
        tokens: u64,
        scratch: &mut Vec<(f64, u64)>,
    ) -> Option<(DecodeView, f64)> {
        if tokens > capacity {
            return None;
        }
        let arrived = |m: &&DecodeMember| m.joins_at_s <= at_s;
        // One step time for the whole horizon: the batch once the queue has joined.
        let mut memory = 0u64;
        for m in &self.running {
            memory += m.context_tokens;
        }
        let (mut queued, mut queued_tokens) = (0u64, 0u64);
        for m in self.pending.iter().filter(arrived) {
            queued += 1;
            queued_tokens += m.context_tokens;
        }
        let step = cost.step_seconds(self.running.len() as u64 + queued, memory + queued_tokens);
        if memory + queued_tokens + tokens <= capacity {
            // Everyone fits at once: no waiting; count who is still there at `at_s`.
            let mut v = DecodeView::default();
            let running = self.running.iter().map(|m| (now_s, m));
            let joined = self
                .pending
                .iter()
                .filter(arrived)
                .map(|m| (m.joins_at_s, m));
            for (start, m) in running.chain(joined) {
                if start.max(now_s) + f64::from(m.remaining_tokens) * step > at_s {
                    v.batch += 1;
                    v.context_tokens += m.context_tokens;
                }
            }
            return Some((v, 0.0));
        }
        let mut queue: Vec<&DecodeMember> = self.pending.iter().filter(arrived).collect();
        queue.sort_by(|a, b| {
            a.joins_at_s
                .total_cmp(&b.joins_at_s)
                .then(a.request.cmp(&b.request))
        });
        let admitted = scratch;
        admitted.clear();
        for m in &self.running {
            admitted.push((
                now_s + f64::from(m.remaining_tokens) * step,
                m.context_tokens,
            ));
        }
        // Earliest finish last, so that departures pop from the end.
        admitted.sort_unstable_by(|a, b| b.0.total_cmp(&a.0));
        let mut t = now_s;
        let mut admit = |ctx: u64, joins: f64, admitted: &mut Vec<(f64, u64)>| -> f64 {
            t = t.max(joins);
            while memory + ctx > capacity {
                match admitted.pop() {
                    Some((finish, c)) => {
                        memory -= c;
                        t = t.max(finish);
                    }
                    None => break,
                }
            }
            memory += ctx;
            t
        };
        for m in queue {
            let start = admit(m.context_tokens, m.joins_at_s, admitted);
            let finish = start + f64::from(m.remaining_tokens) * step;
            let pos = admitted.partition_point(|a| a.0 > finish);
            admitted.insert(pos, (finish, m.context_tokens));
        }
        let start = admit(tokens, at_s, admitted);
        // Requests finished by the time this one starts are gone.
        while let Some(&(finish, c)) = admitted.last() {
            if finish > start {
                break;
            }
            admitted.pop();
            memory -= c;
        }
        let view = DecodeView {
            batch: admitted.len() as u64,
            context_tokens: memory - tokens,
        };
        Some((view, start - at_s))
    }
}

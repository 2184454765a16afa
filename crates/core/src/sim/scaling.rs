//! Autoscaling of the simulated prefill instances (`kvpool simulate --autoscale MIN:MAX`): the
//! operator's decision ([`crate::autoscale::Autoscaler`]) fed every `period_s` from the same
//! per-request window the conductor serves, switching instances on and off. The scheduler is
//! built for `max` instances; an instance that is off is never free (`free_at_s` infinite), so
//! no policy picks it, and its local cache is emptied (a new pod starts cold). One that comes
//! on is busy for `startup_s` first (the engine loading its model). Instance-seconds count
//! from switching on until the queued work of a switched-off instance drained. Pure.

use std::collections::VecDeque;

use crate::autoscale::{Autoscaler, Behavior, Bounds, LoadWindow, RoleLoad, Signal};
use crate::sched::{LruSet, PrefillLoad, PrefixIndex};

/// How the prefill count is scaled.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct AutoscaleConfig {
    /// Instances on at the start (clamped into `min..=max`).
    pub start: usize,
    pub min: usize,
    pub max: usize,
    pub signal: Signal,
    /// How often the decision runs (the operator's pass), seconds.
    pub period_s: f64,
    /// A new instance's start-up time, seconds.
    pub startup_s: f64,
    /// The signal's window (the conductor's), seconds.
    pub window_s: f64,
    pub behavior: Behavior,
}

impl AutoscaleConfig {
    /// `min..=max` on `signal`, starting at `min`, with the operator's period, window and
    /// behaviour and a 30 s start-up.
    pub fn new(min: usize, max: usize, signal: Signal) -> Self {
        Self {
            start: min,
            min,
            max,
            signal,
            period_s: 15.0,
            startup_s: 30.0,
            window_s: 30.0,
            behavior: Behavior::default(),
        }
    }
}

/// What autoscaling did over a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct ScalingTotals {
    /// Prefill instance-seconds from the first arrival to the end of the run.
    pub instance_s: f64,
    pub scale_ups: u32,
    pub scale_downs: u32,
    pub fewest: usize,
    pub most: usize,
}

/// The scaler's state.
#[derive(Debug)]
pub struct PrefillScaler {
    config: AutoscaleConfig,
    slo_s: f64,
    autoscaler: Autoscaler,
    window: LoadWindow,
    active: Vec<bool>,
    /// Per instance, start times of the requests booked on it (FIFO, so increasing).
    starts: Vec<VecDeque<f64>>,
    /// Per instance: when it was switched on (`None` while off).
    on_since: Vec<Option<f64>>,
    next_tick_s: Option<f64>,
    totals: ScalingTotals,
}

fn clear_local(cache: &mut LruSet, index: &mut PrefixIndex, instance: usize) {
    let keys: Vec<u64> = cache.iter().collect();
    for k in keys {
        cache.remove(k);
        index.remove_local(k, instance);
    }
}

impl PrefillScaler {
    /// `config.start` instances on (clamped into the bounds) out of `prefill.len()` (= `max`);
    /// the rest are switched off.
    pub fn new(config: AutoscaleConfig, slo_s: f64, prefill: &mut [PrefillLoad]) -> Self {
        let start = config
            .start
            .clamp(config.min.max(1), config.max.max(1))
            .min(prefill.len());
        let mut active = vec![false; prefill.len()];
        for (i, p) in prefill.iter_mut().enumerate() {
            if i < start {
                active[i] = true;
            } else {
                p.free_at_s = f64::INFINITY;
            }
        }
        Self {
            autoscaler: Autoscaler::new(config.behavior),
            window: LoadWindow::new(config.window_s, 1_000_000),
            starts: vec![VecDeque::new(); prefill.len()],
            on_since: active.iter().map(|_| None).collect(),
            active,
            next_tick_s: None,
            totals: ScalingTotals {
                fewest: start,
                most: start,
                ..ScalingTotals::default()
            },
            config,
            slo_s,
        }
    }

    fn count(&self) -> usize {
        self.active.iter().filter(|&&a| a).count()
    }

    /// A request admitted at `now_s` on `instance`, its prefill starting at `start_s`, with
    /// the TTFT the policy predicted.
    pub fn admitted(&mut self, now_s: f64, instance: usize, start_s: f64, predicted_ttft_s: f64) {
        self.window.admitted(now_s, predicted_ttft_s);
        if let Some(q) = self.starts.get_mut(instance) {
            q.push_back(start_s);
        }
    }

    /// A request rejected at `now_s` for its TTFT.
    pub fn rejected(&mut self, now_s: f64) {
        self.window.rejected(now_s);
    }

    /// Run every decision due up to `now_s`.
    pub fn advance(
        &mut self,
        now_s: f64,
        prefill: &mut [PrefillLoad],
        local: &mut [LruSet],
        index: &mut PrefixIndex,
    ) {
        let next = *self.next_tick_s.get_or_insert_with(|| {
            // The clock starts at the first arrival; so do the instances already on.
            for s in self.on_since.iter_mut().zip(&self.active) {
                if *s.1 {
                    *s.0 = Some(now_s);
                }
            }
            now_s + self.config.period_s
        });
        let mut tick = next;
        while tick <= now_s {
            self.decide(tick, prefill, local, index);
            tick += self.config.period_s;
        }
        self.next_tick_s = Some(tick);
    }

    fn decide(
        &mut self,
        t: f64,
        prefill: &mut [PrefillLoad],
        local: &mut [LruSet],
        index: &mut PrefixIndex,
    ) {
        let current = self.count();
        let queue_depth = self
            .starts
            .iter_mut()
            .map(|q| {
                while q.front().is_some_and(|&s| s <= t) {
                    q.pop_front();
                }
                q.len() as u64
            })
            .sum();
        let load = RoleLoad {
            instances: u32::try_from(current).unwrap_or(u32::MAX),
            queue_depth,
            slo_s: self.slo_s,
            figures: self.window.figures(t, self.slo_s),
        };
        let cur = u32::try_from(current).unwrap_or(u32::MAX);
        let value = load.signal_value(self.config.signal, self.slo_s, cur);
        let bounds = Bounds::new(
            u32::try_from(self.config.min.max(1)).unwrap_or(u32::MAX),
            u32::try_from(self.config.max).unwrap_or(u32::MAX),
        );
        let d = self
            .autoscaler
            .decide(t, self.config.signal, Some(value), cur, bounds);
        let desired = d.desired as usize;
        if desired > current {
            self.totals.scale_ups += 1;
            let mut missing = desired - current;
            let slots = self
                .active
                .iter_mut()
                .zip(self.on_since.iter_mut())
                .zip(prefill.iter_mut());
            for ((active, since), load) in slots {
                if missing == 0 {
                    break;
                }
                if !*active {
                    *active = true;
                    *since = Some(t);
                    load.free_at_s = t + self.config.startup_s;
                    missing -= 1;
                }
            }
        } else if desired < current {
            self.totals.scale_downs += 1;
            let mut extra = current - desired;
            // The highest-numbered instances go first; each drains what it has queued.
            for i in (0..self.active.len()).rev() {
                if extra == 0 {
                    break;
                }
                if self.active[i]
                    && let Some(load) = prefill.get_mut(i)
                {
                    self.active[i] = false;
                    let until = load.free_at_s.max(t);
                    if let Some(since) = self.on_since.get_mut(i).and_then(Option::take) {
                        self.totals.instance_s += until - since;
                    }
                    load.free_at_s = f64::INFINITY;
                    if let Some(cache) = local.get_mut(i) {
                        clear_local(cache, index, i);
                    }
                    if let Some(q) = self.starts.get_mut(i) {
                        q.clear();
                    }
                    extra -= 1;
                }
            }
        }
        let n = self.count();
        self.totals.fewest = self.totals.fewest.min(n);
        self.totals.most = self.totals.most.max(n);
    }

    /// The totals, with the instances still on counted until `end_s`.
    pub fn finish(mut self, end_s: f64) -> ScalingTotals {
        for since in self.on_since.iter().flatten() {
            self.totals.instance_s += (end_s - since).max(0.0);
        }
        self.totals
    }
}

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

/// The bookkeeping both scalers (prefill here, and the decode scaler) share: the
/// operator's decision fed every `period_s` from a window of predicted latencies, which
/// instances are on and since when, and the run's totals. Instances are switched on lowest
/// first and off highest first.
#[derive(Debug)]
pub(super) struct InstanceSet {
    config: AutoscaleConfig,
    /// The SLO the window's predictions are measured against, seconds.
    slo_s: f64,
    autoscaler: Autoscaler,
    window: LoadWindow,
    /// Per instance: switched on now.
    pub(super) active: Vec<bool>,
    /// Per instance: when it was switched on (`None` while off).
    on_since: Vec<Option<f64>>,
    next_tick_s: Option<f64>,
    pub(super) totals: ScalingTotals,
}

/// What one decision changed.
pub(super) enum Change {
    None,
    /// These instances were switched on, lowest first.
    On(Vec<usize>),
    /// These instances were switched off, highest first, each with when it had been switched
    /// on (`None` before the clock started).
    Off(Vec<(usize, Option<f64>)>),
}

impl InstanceSet {
    /// `config.start` of `instances` (= `max`) on, clamped into the bounds.
    pub(super) fn new(config: AutoscaleConfig, slo_s: f64, instances: usize) -> Self {
        let start = config
            .start
            .clamp(config.min.max(1), config.max.max(1))
            .min(instances);
        Self {
            autoscaler: Autoscaler::new(config.behavior),
            window: LoadWindow::new(config.window_s, 1_000_000),
            active: (0..instances).map(|i| i < start).collect(),
            on_since: vec![None; instances],
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

    pub(super) fn config(&self) -> &AutoscaleConfig {
        &self.config
    }

    /// Instances switched on now.
    pub(super) fn count(&self) -> usize {
        self.active.iter().filter(|&&a| a).count()
    }

    /// A request admitted at `now_s` with the latency the policy predicted for it.
    pub(super) fn admitted(&mut self, now_s: f64, predicted_s: f64) {
        self.window.admitted(now_s, predicted_s);
    }

    /// A request rejected at `now_s`.
    pub(super) fn rejected(&mut self, now_s: f64) {
        self.window.rejected(now_s);
    }

    /// The decision times due up to `now_s`, in order. The first call starts the clock, for
    /// the instances already on too.
    pub(super) fn due(&mut self, now_s: f64) -> Vec<f64> {
        let next = *self.next_tick_s.get_or_insert_with(|| {
            for (since, active) in self.on_since.iter_mut().zip(&self.active) {
                if *active {
                    *since = Some(now_s);
                }
            }
            now_s + self.config.period_s
        });
        let mut ticks = Vec::new();
        let mut tick = next;
        while tick <= now_s {
            ticks.push(tick);
            tick += self.config.period_s;
        }
        self.next_tick_s = Some(tick);
        ticks
    }

    /// Runs the decision at `t` with `queue_depth` requests waiting, and switches instances on
    /// or off to match it.
    pub(super) fn decide(&mut self, t: f64, queue_depth: u64) -> Change {
        let current = self.count();
        let cur = as_u32(current);
        let load = RoleLoad {
            instances: cur,
            queue_depth,
            slo_s: self.slo_s,
            figures: self.window.figures(t, self.slo_s),
        };
        let value = load.signal_value(self.config.signal, self.slo_s, cur);
        let bounds = Bounds::new(as_u32(self.config.min.max(1)), as_u32(self.config.max));
        let d = self
            .autoscaler
            .decide(t, self.config.signal, Some(value), cur, bounds);
        let desired = d.desired as usize;
        let change = if desired > current {
            self.totals.scale_ups += 1;
            let on: Vec<usize> = (0..self.active.len())
                .filter(|&i| !self.active[i])
                .take(desired - current)
                .collect();
            for &i in &on {
                self.active[i] = true;
                self.on_since[i] = Some(t);
            }
            Change::On(on)
        } else if desired < current {
            self.totals.scale_downs += 1;
            let off: Vec<usize> = (0..self.active.len())
                .rev()
                .filter(|&i| self.active[i])
                .take(current - desired)
                .collect();
            let off = off
                .into_iter()
                .map(|i| {
                    self.active[i] = false;
                    (i, self.on_since[i].take())
                })
                .collect();
            Change::Off(off)
        } else {
            Change::None
        };
        let n = self.count();
        self.totals.fewest = self.totals.fewest.min(n);
        self.totals.most = self.totals.most.max(n);
        change
    }

    /// The totals, with the instances still on, and those that started at `also` (draining
    /// ones), counted until `end_s`.
    pub(super) fn finish(mut self, end_s: f64, also: &[Option<f64>]) -> ScalingTotals {
        for since in self.on_since.iter().chain(also).flatten() {
            self.totals.instance_s += (end_s - since).max(0.0);
        }
        self.totals
    }
}

fn as_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The prefill scaler's state.
#[derive(Debug)]
pub struct PrefillScaler {
    set: InstanceSet,
    /// Per instance, start times of the requests booked on it (FIFO, so increasing).
    starts: Vec<VecDeque<f64>>,
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
        let set = InstanceSet::new(config, slo_s, prefill.len());
        for (p, on) in prefill.iter_mut().zip(&set.active) {
            if !on {
                p.free_at_s = f64::INFINITY;
            }
        }
        Self {
            starts: vec![VecDeque::new(); prefill.len()],
            set,
        }
    }

    /// A request admitted at `now_s` on `instance`, its prefill starting at `start_s`, with
    /// the TTFT the policy predicted.
    pub fn admitted(&mut self, now_s: f64, instance: usize, start_s: f64, predicted_ttft_s: f64) {
        self.set.admitted(now_s, predicted_ttft_s);
        if let Some(q) = self.starts.get_mut(instance) {
            q.push_back(start_s);
        }
    }

    /// A request rejected at `now_s` for its TTFT.
    pub fn rejected(&mut self, now_s: f64) {
        self.set.rejected(now_s);
    }

    /// Run every decision due up to `now_s`.
    pub fn advance(
        &mut self,
        now_s: f64,
        prefill: &mut [PrefillLoad],
        local: &mut [LruSet],
        index: &mut PrefixIndex,
    ) {
        for tick in self.set.due(now_s) {
            self.decide(tick, prefill, local, index);
        }
    }

    fn decide(
        &mut self,
        t: f64,
        prefill: &mut [PrefillLoad],
        local: &mut [LruSet],
        index: &mut PrefixIndex,
    ) {
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
        match self.set.decide(t, queue_depth) {
            Change::None => {}
            Change::On(on) => {
                for i in on {
                    prefill[i].free_at_s = t + self.set.config().startup_s;
                }
            }
            // Each instance switched off drains what it has queued.
            Change::Off(off) => {
                for (i, since) in off {
                    let load = &mut prefill[i];
                    let until = load.free_at_s.max(t);
                    if let Some(since) = since {
                        self.set.totals.instance_s += until - since;
                    }
                    load.free_at_s = f64::INFINITY;
                    if let Some(cache) = local.get_mut(i) {
                        clear_local(cache, index, i);
                    }
                    if let Some(q) = self.starts.get_mut(i) {
                        q.clear();
                    }
                }
            }
        }
    }

    /// The totals, with the instances still on counted until `end_s`.
    pub fn finish(self, end_s: f64) -> ScalingTotals {
        self.set.finish(end_s, &[])
    }
}

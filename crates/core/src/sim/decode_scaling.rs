//! Autoscaling of the simulated decode instances (`kvpool simulate --autoscale-decode MIN:MAX`):
//! the operator's decision ([`crate::autoscale::Autoscaler`], the same stabilization windows,
//! step limits and cool-down as for prefill) fed every `period_s` from the window of predicted
//! TPOTs the conductor serves for its decode role, plus the decode queue (requests prefilled and
//! waiting for KV memory). The engine is built for `max` decode instances; the scheduler only
//! sees the leading instances that are on and ready, so a switched-off instance takes no new
//! request but finishes (drains) what it already holds, and one switched on takes requests only
//! after `startup_s` (the engine loading its model). Instance-seconds count from switching on
//! until a switched-off instance has drained. Pure.

use super::scaling::{AutoscaleConfig, Change, InstanceSet, ScalingTotals};

/// The decode scaler's state, one slot per decode instance the engine was built for.
#[derive(Debug)]
pub struct DecodeScaler {
    /// Which instances are on, fed from the window of predicted TPOTs against the TPOT SLO.
    set: InstanceSet,
    /// When each instance takes requests (after its start-up); meaningful while active.
    ready_at_s: Vec<f64>,
    /// Per instance: switched off at this time and still holding requests.
    draining_since: Vec<Option<f64>>,
}

impl DecodeScaler {
    /// `config.start` of `instances` (= `max`) decode instances on and ready (clamped into the
    /// bounds); `slo_s` is the TPOT SLO.
    pub fn new(config: AutoscaleConfig, slo_s: f64, instances: usize) -> Self {
        Self {
            set: InstanceSet::new(config, slo_s, instances),
            ready_at_s: vec![f64::NEG_INFINITY; instances],
            draining_since: vec![None; instances],
        }
    }

    /// Instances switched on now.
    pub fn count(&self) -> usize {
        self.set.count()
    }

    /// How many leading instances take new requests at `now_s` (on, and past their start-up).
    /// Instances are switched on lowest first and off highest first, so these are a prefix.
    pub fn available(&self, now_s: f64) -> usize {
        self.set
            .active
            .iter()
            .zip(&self.ready_at_s)
            .take_while(|(a, r)| **a && **r <= now_s)
            .count()
    }

    /// A request admitted at `now_s` with the TPOT the policy predicted for it.
    pub fn admitted(&mut self, now_s: f64, predicted_tpot_s: f64) {
        self.set.admitted(now_s, predicted_tpot_s);
    }

    /// A request rejected at `now_s` for decode (its TPOT or the decode KV memory).
    pub fn rejected(&mut self, now_s: f64) {
        self.set.rejected(now_s);
    }

    /// Instance `instance` holds no request any more at `now_s`: if it was switched off, its
    /// drain ends here.
    pub fn idle(&mut self, instance: usize, now_s: f64) {
        if let Some(since) = self.draining_since.get_mut(instance).and_then(Option::take) {
            self.set.totals.instance_s += (now_s - since).max(0.0);
        }
    }

    /// Run every decision due up to `now_s`. `queue_depth` counts requests that reached a
    /// decode instance and wait for KV memory; `busy[i]` says instance `i` still holds
    /// requests (running, waiting, or on their way).
    pub fn advance(&mut self, now_s: f64, queue_depth: u64, busy: &[bool]) {
        for tick in self.set.due(now_s) {
            self.decide(tick, queue_depth, busy);
        }
    }

    fn decide(&mut self, t: f64, queue_depth: u64, busy: &[bool]) {
        match self.set.decide(t, queue_depth) {
            Change::None => {}
            Change::On(on) => {
                for i in on {
                    // An instance still draining never went away: it takes requests at once.
                    self.ready_at_s[i] = match self.draining_since[i].take() {
                        Some(since) => {
                            self.set.totals.instance_s += (t - since).max(0.0);
                            t
                        }
                        None => t + self.set.config().startup_s,
                    };
                }
            }
            Change::Off(off) => {
                for (i, since) in off {
                    if let Some(since) = since {
                        self.set.totals.instance_s += (t - since).max(0.0);
                    }
                    if busy.get(i).copied().unwrap_or(false) {
                        self.draining_since[i] = Some(t);
                    }
                }
            }
        }
    }

    /// The totals, with the instances still on (or still draining) counted until `end_s`.
    pub fn finish(self, end_s: f64) -> ScalingTotals {
        self.set.finish(end_s, &self.draining_since)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autoscale::Signal;

    fn config(min: usize, max: usize) -> AutoscaleConfig {
        AutoscaleConfig {
            start: min,
            startup_s: 10.0,
            ..AutoscaleConfig::new(min, max, Signal::PredictedLatency)
        }
    }

    /// `c` deciding every `period_s` on the latest figures alone: no stabilization windows
    /// and no cool-down.
    fn without_windows(mut c: AutoscaleConfig, period_s: f64) -> AutoscaleConfig {
        c.behavior.up_window_s = 0.0;
        c.behavior.down_window_s = 0.0;
        c.behavior.cooldown_s = 0.0;
        c.period_s = period_s;
        c
    }

    /// Drives the scaler second by second: each second `load(t)` requests arrive, each with
    /// the predicted TPOT `tpot(t)`; returns the count after each second.
    fn script(
        s: &mut DecodeScaler,
        seconds: std::ops::Range<u32>,
        tpot: impl Fn(f64) -> f64,
    ) -> Vec<usize> {
        let busy = vec![false; s.set.active.len()];
        seconds
            .map(|sec| {
                let t = f64::from(sec);
                s.admitted(t, tpot(t));
                s.advance(t, 0, &busy);
                s.count()
            })
            .collect()
    }

    #[test]
    fn a_tpot_burst_scales_up_and_the_quiet_after_it_scales_down_after_the_windows() {
        let slo = 0.1;
        let mut s = DecodeScaler::new(config(1, 6), slo, 6);
        assert_eq!((s.count(), s.available(0.0)), (1, 1));
        // 0..120 s at the target (predicted TPOT at half the SLO), then a burst at 3x the
        // SLO (6x the target) until 300 s.
        let up = script(&mut s, 0..300, |t| if t < 120.0 { 0.05 } else { 0.3 });
        assert!(up[..120].iter().all(|&n| n == 1), "{up:?}");
        let first_up = up.iter().position(|&n| n > 1).expect("scaled up");
        assert!(
            first_up >= 150,
            "scaled up at {first_up} s, before the burst filled the up window"
        );
        assert_eq!(*up.last().unwrap(), 6, "{up:?}");
        assert!(up.iter().all(|&n| n <= 6), "above max: {up:?}");
        // Changes never come closer together than the cool-down.
        let changes: Vec<usize> = (1..up.len()).filter(|&i| up[i] != up[i - 1]).collect();
        for w in changes.windows(2) {
            assert!(w[1] - w[0] >= 60, "changes at {w:?} inside the cool-down");
        }
        // 300..1500 s: TPOT far below target; the count comes down only once the down
        // window (300 s) holds no burst recommendation any more, and never below min.
        let down = script(&mut s, 300..1500, |_| 0.005);
        let first_down = down.iter().position(|&n| n < 6).expect("scaled down") + 300;
        assert!(first_down >= 600, "scaled down at {first_down} s");
        assert_eq!(*down.last().unwrap(), 1, "{down:?}");
        assert!(down.iter().all(|&n| n >= 1));
        let totals = s.finish(1500.0);
        assert!(
            totals.scale_ups >= 1 && totals.scale_downs >= 1,
            "{totals:?}"
        );
        assert_eq!((totals.fewest, totals.most), (1, 6));
    }

    #[test]
    fn a_load_at_the_target_changes_nothing_and_short_spikes_do_not_flap() {
        let mut s = DecodeScaler::new(config(2, 8), 0.1, 8);
        // Predicted TPOT at half the SLO: exactly the target ratio.
        let steady = script(&mut s, 0..600, |_| 0.05);
        assert!(steady.iter().all(|&n| n == 2), "{steady:?}");
        let t = s.finish(599.0);
        close(t.instance_s, 2.0 * 599.0);
        // Four instances at the target for two minutes, then a load that alone would need two
        // with a 10 s spike every two minutes that alone would need eight: neither lasts
        // through its window, so the count never moves either way.
        let mut s = DecodeScaler::new(
            AutoscaleConfig {
                start: 4,
                ..config(1, 8)
            },
            0.1,
            8,
        );
        let spiky = script(&mut s, 0..1800, |t| {
            if t < 120.0 {
                0.05
            } else if t % 120.0 < 10.0 {
                0.5
            } else {
                0.02
            }
        });
        assert!(spiky.iter().all(|&n| n == 4), "flapped: {spiky:?}");
        let t = s.finish(1800.0);
        assert_eq!((t.scale_ups, t.scale_downs), (0, 0));
    }

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-6, "{a} != {b}");
    }

    #[test]
    fn new_instances_wait_for_their_start_up_and_draining_ones_are_counted_until_idle() {
        let mut s = DecodeScaler::new(without_windows(config(1, 3), 20.0), 0.1, 3);
        s.advance(0.0, 0, &[false; 3]);
        // Predicted TPOT at twice the SLO: four times the target ratio, so up to 3 (max).
        s.admitted(0.5, 0.2);
        s.advance(20.0, 0, &[false; 3]);
        assert_eq!(s.count(), 3);
        assert_eq!(s.available(20.0), 1, "the new ones are starting");
        assert_eq!(s.available(29.9), 1);
        assert_eq!(s.available(30.0), 3);
        // At 40 s the window is empty: one step down (a quarter of 3, at least 1), the
        // highest instance first.
        s.advance(40.0, 0, &[true, false, true]);
        assert_eq!((s.count(), s.available(40.0)), (2, 2));
        // Instance 2 was switched off at 40 s holding requests; it drains until 50 s.
        s.idle(2, 50.0);
        s.idle(2, 60.0); // a second idle adds nothing
        let t = s.finish(40.0);
        // Instance 0 on 0..40 s, 1 on 20..40 s, 2 on 20..40 s and draining 40..50 s.
        close(t.instance_s, 40.0 + 20.0 + 20.0 + 10.0);
        assert_eq!((t.scale_ups, t.scale_downs, t.fewest, t.most), (1, 1, 1, 3));
    }

    #[test]
    fn a_draining_instance_switched_on_again_takes_requests_at_once() {
        let c = without_windows(config(1, 2), 1.0);
        let mut s = DecodeScaler::new(AutoscaleConfig { start: 2, ..c }, 0.1, 2);
        s.advance(0.0, 0, &[false; 2]);
        assert_eq!(s.available(0.0), 2);
        s.admitted(0.5, 0.001);
        s.advance(1.0, 0, &[true, true]);
        assert_eq!((s.count(), s.available(1.0)), (1, 1));
        s.admitted(1.5, 0.3);
        s.advance(2.0, 0, &[true, true]);
        assert_eq!(
            (s.count(), s.available(2.0)),
            (2, 2),
            "no start-up after a drain"
        );
        let t = s.finish(3.0);
        // 0: 0..3; 1: 0..1 on, 1..2 draining, 2..3 on again.
        close(t.instance_s, 3.0 + 1.0 + 1.0 + 1.0);
    }
}

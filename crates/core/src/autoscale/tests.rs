use proptest::prelude::*;

use super::*;

fn quick() -> Behavior {
    Behavior {
        up_window_s: 0.0,
        down_window_s: 0.0,
        cooldown_s: 0.0,
        ..Behavior::default()
    }
}

#[test]
fn predicted_latency_is_proportional_with_a_tolerance() {
    let b = Behavior::default();
    // p90 at the SLO with target 0.5: twice the instances.
    assert_eq!(recommend(Signal::PredictedLatency, 1.0, 4, &b), 8);
    // Within 10 % of the target: unchanged.
    assert_eq!(recommend(Signal::PredictedLatency, 0.52, 4, &b), 4);
    // Quarter of the target: a quarter of the instances.
    assert_eq!(recommend(Signal::PredictedLatency, 0.125, 8, &b), 2);
    // From zero, any load asks for one.
    assert_eq!(recommend(Signal::PredictedLatency, 0.2, 0, &b), 1);
    assert_eq!(recommend(Signal::QueueDepth, 3.0, 0, &b), 1);
    assert_eq!(recommend(Signal::QueueDepth, 0.0, 0, &b), 0);
    // Three waiting per instance against a target of one: three times the instances.
    assert_eq!(recommend(Signal::QueueDepth, 3.0, 2, &b), 6);
    // Garbage changes nothing.
    assert_eq!(recommend(Signal::PredictedLatency, f64::NAN, 3, &b), 3);
    assert_eq!(recommend(Signal::QueueDepth, -1.0, 3, &b), 3);
}

#[test]
fn shares_grow_by_the_missed_share_and_shrink_by_one() {
    let b = Behavior::default();
    assert_eq!(recommend(Signal::RejectionRate, 0.5, 4, &b), 8);
    assert_eq!(recommend(Signal::RejectionRate, 0.02, 4, &b), 5);
    assert_eq!(recommend(Signal::RejectionRate, 0.0, 4, &b), 3);
    assert_eq!(recommend(Signal::RejectionRate, 0.005, 4, &b), 4);
    assert_eq!(recommend(Signal::SloAttainment, 0.5, 4, &b), 8);
    assert_eq!(recommend(Signal::SloAttainment, 1.0, 4, &b), 3);
}

#[test]
fn scales_up_after_the_up_window_and_down_after_the_longer_one() {
    let mut a = Autoscaler::new(Behavior::default());
    let bounds = Bounds::new(1, 10);
    let d = a.decide(0.0, Signal::PredictedLatency, Some(1.0), 2, bounds);
    // The first high reading is the whole window: up at once.
    assert_eq!((d.desired, d.why), (4, Why::ScaledUp));
    // Cool-down: nothing for 60 s.
    let d = a.decide(30.0, Signal::PredictedLatency, Some(3.2), 4, bounds);
    assert_eq!((d.desired, d.why), (4, Why::CoolingDown));
    // Low readings: held until the down window holds only low ones.
    let mut t = 61.0;
    let mut n = 4;
    while t < 400.0 {
        let d = a.decide(t, Signal::PredictedLatency, Some(0.2), n, bounds);
        if d.desired != n {
            assert_eq!(d.why, Why::ScaledDown);
            // 30 s and 3.2 leave the down window 300 s after 30 s.
            assert!(t > 330.0, "scaled down at {t}");
            n = d.desired;
            break;
        }
        t += 10.0;
    }
    assert_eq!(n, 3, "one step of 25 % (at least one) down");
}

#[test]
fn a_short_spike_inside_the_up_window_does_not_scale() {
    let mut a = Autoscaler::new(Behavior::default());
    let bounds = Bounds::new(1, 10);
    for t in 0..10 {
        let d = a.decide(f64::from(t), Signal::QueueDepth, Some(1.0), 3, bounds);
        assert_eq!(d.desired, 3);
    }
    let d = a.decide(10.0, Signal::QueueDepth, Some(20.0), 3, bounds);
    assert_eq!((d.desired, d.why), (3, Why::Stable));
}

#[test]
fn missing_signal_holds_and_bounds_win() {
    let mut a = Autoscaler::new(quick());
    let d = a.decide(0.0, Signal::PredictedLatency, None, 3, Bounds::new(1, 5));
    assert_eq!((d.desired, d.why), (3, Why::NoSignal));
    let d = a.decide(1.0, Signal::PredictedLatency, None, 7, Bounds::new(1, 5));
    assert_eq!((d.desired, d.why), (5, Why::Bounds));
    let d = a.decide(
        1.0,
        Signal::PredictedLatency,
        Some(0.8),
        0,
        Bounds::new(2, 5),
    );
    assert_eq!((d.desired, d.why), (2, Why::Bounds));
}

#[test]
fn steps_are_limited() {
    let mut a = Autoscaler::new(quick());
    let d = a.decide(
        0.0,
        Signal::PredictedLatency,
        Some(80.0),
        2,
        Bounds::new(1, 100),
    );
    assert_eq!(d.desired, 2 + 4, "at most max(4, 100 %) up");
    let d = a.decide(
        1.0,
        Signal::PredictedLatency,
        Some(0.01),
        40,
        Bounds::new(1, 100),
    );
    assert_eq!(d.desired, 30, "at most 25 % down");
}

#[test]
fn remember_change_seeds_the_cool_down() {
    let mut a = Autoscaler::new(Behavior::default());
    a.remember_change(100.0);
    let d = a.decide(
        120.0,
        Signal::PredictedLatency,
        Some(3.0),
        2,
        Bounds::new(1, 9),
    );
    assert_eq!(d.why, Why::CoolingDown);
    let d = a.decide(
        161.0,
        Signal::PredictedLatency,
        Some(3.0),
        2,
        Bounds::new(1, 9),
    );
    assert_eq!(d.why, Why::ScaledUp);
}

fn signal() -> impl Strategy<Value = Signal> {
    prop_oneof![
        Just(Signal::SloAttainment),
        Just(Signal::QueueDepth),
        Just(Signal::PredictedLatency),
        Just(Signal::RejectionRate),
    ]
}

proptest! {
    #[test]
    fn never_outside_bounds_and_never_changes_inside_the_cool_down(
        sig in signal(),
        lo in 0u32..20,
        span in 0u32..20,
        start in 0u32..60,
        steps in proptest::collection::vec((1u32..40, proptest::option::of(0.0f64..5.0)), 1..80),
    ) {
        let bounds = Bounds::new(lo, lo + span);
        let mut a = Autoscaler::new(Behavior::default());
        let mut n = start;
        let mut t = 0.0;
        let mut last_change: Option<f64> = None;
        for (dt, v) in steps {
            t += f64::from(dt);
            let d = a.decide(t, sig, v, n, bounds);
            prop_assert!(d.desired >= bounds.min && d.desired <= bounds.max);
            if d.desired != n {
                let re_entering = bounds.clamp(n) != n;
                if !re_entering && let Some(c) = last_change {
                    prop_assert!(t - c >= a.behavior().cooldown_s, "changed at {} after {}", t, c);
                }
                last_change = Some(t);
            }
            n = d.desired;
        }
    }

    #[test]
    fn recommendation_is_monotone_in_the_signal(
        sig in signal(),
        current in 0u32..100,
        x in 0.0f64..10.0,
        y in 0.0f64..10.0,
    ) {
        let b = Behavior::default();
        let (lo, hi) = if x <= y { (x, y) } else { (y, x) };
        let (r_lo, r_hi) = (recommend(sig, lo, current, &b), recommend(sig, hi, current, &b));
        // Attainment is the one signal where more is better.
        if sig == Signal::SloAttainment {
            prop_assert!(r_lo >= r_hi, "{} -> {}, {} -> {}", lo, r_lo, hi, r_hi);
        } else {
            prop_assert!(r_lo <= r_hi, "{} -> {}, {} -> {}", lo, r_lo, hi, r_hi);
        }
    }

    #[test]
    fn first_decision_is_monotone_in_the_signal(
        sig in signal(),
        current in 1u32..50,
        x in 0.0f64..10.0,
        y in 0.0f64..10.0,
    ) {
        let bounds = Bounds::new(1, 64);
        let (lo, hi) = if x <= y { (x, y) } else { (y, x) };
        let d_lo = Autoscaler::new(quick()).decide(0.0, sig, Some(lo), current, bounds).desired;
        let d_hi = Autoscaler::new(quick()).decide(0.0, sig, Some(hi), current, bounds).desired;
        if sig == Signal::SloAttainment {
            prop_assert!(d_lo >= d_hi);
        } else {
            prop_assert!(d_lo <= d_hi);
        }
    }
}

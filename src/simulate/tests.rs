//! Tests of the `kvpool simulate` flags: defaults, autoscaling ranges, bad values named,
//! old spellings, prefill profiles.
use super::*;
use clap::Parser;

#[derive(Debug, Parser)]
struct T {
    #[command(flatten)]
    a: SimulateArgs,
}

/// The flags of `kvpool simulate --trace x.jsonl` followed by `extra` (flags split at spaces).
fn args(extra: &str) -> SimulateArgs {
    let mut v = vec!["t", "--trace", "x.jsonl"];
    v.extend(extra.split_whitespace());
    T::try_parse_from(v).unwrap().a
}

#[test]
fn defaults_validate() {
    let c = sim_config(&args("")).unwrap();
    assert_eq!(c.scheduler.prefill_costs.len(), 8);
    assert_eq!(c.local_cache_blocks, 5859);
    assert_eq!(c.scheduler.pool_bandwidth_bps, 25e9);
    let c = sim_config(&args("--pool-blocks unlimited")).unwrap();
    assert_eq!(c.pool_blocks, UNLIMITED);
}

#[test]
fn autoscale_builds_max_instances_and_checks_its_range() {
    let c = sim_config(&args("--autoscale 2:12 --prefill 4")).unwrap();
    assert_eq!(c.scheduler.prefill_costs.len(), 12);
    let a = c.autoscale.expect("autoscale");
    assert_eq!((a.start, a.min, a.max), (4, 2, 12));
    assert_eq!(a.signal, Signal::PredictedLatency);
    assert_eq!(a.startup_s, 30.0);
    let c = sim_config(&args(
        "--autoscale 1:4 --prefill 1 --autoscale-signal queue-depth --autoscale-startup 2m",
    ))
    .unwrap();
    let a = c.autoscale.expect("autoscale");
    assert_eq!((a.signal, a.startup_s), (Signal::QueueDepth, 120.0));
    let c = sim_config(&args("--autoscale 1:4 --prefill 1 --autoscale-target 0.3")).unwrap();
    assert_eq!(
        c.autoscale
            .expect("autoscale")
            .behavior
            .latency_target_ratio,
        0.3
    );
    let err = sim_config(&args("--autoscale 1:4 --prefill 1 --autoscale-target 0")).unwrap_err();
    assert!(err.to_string().starts_with("--autoscale-target"), "{err}");
    // The start count must lie in the range; MAX is bounded like --prefill.
    let err = sim_config(&args("--autoscale 2:4")).unwrap_err();
    assert!(err.to_string().starts_with("--prefill"), "{err}");
    let err = sim_config(&args("--autoscale 1:500 --prefill 1")).unwrap_err();
    assert!(err.to_string().starts_with("--autoscale"), "{err}");
    for bad in ["4", "0:3", "5:2", "a:3"] {
        assert!(
            T::try_parse_from(["t", "--trace", "x", "--autoscale", bad]).is_err(),
            "{bad}"
        );
    }
    assert!(
        T::try_parse_from(["t", "--trace", "x", "--autoscale-signal", "queue-depth"]).is_err(),
        "the signal needs --autoscale"
    );
    assert!(sim_config(&args("")).unwrap().autoscale.is_none());
}

#[test]
fn bad_flags_are_named() {
    for (extra, want) in [
        ("--prefill 0", "--prefill"),
        ("--prefill 200", "--prefill"),
        ("--decode 0", "--decode"),
        ("--time-scale 0", "--time-scale"),
        ("--ttft-slo=0s", "--ttft-slo"),
        ("--block-size 0", "--block-size"),
        ("--prefill-linear-s=-0.1", "--prefill-linear-s"),
    ] {
        let err = sim_config(&args(extra)).unwrap_err();
        assert!(err.to_string().starts_with(want), "{err}");
        assert_eq!(err.category(), "flag");
    }
    assert!(T::try_parse_from(["t", "--trace", "x", "--pool-blocks", "lots"]).is_err());
    assert!(T::try_parse_from(["t"]).is_err(), "--trace is required");
    assert!(T::try_parse_from(["t", "--bench-decision"]).is_ok());
}

#[test]
fn old_flag_spellings_still_parse_for_one_release() {
    let old = sim_config(&args(
        "--ttft-slo-s 2.5 --tpot-slo-s=0.05 --pool-bandwidth-gbps 12.5 --kv-bandwidth-gbps=50 \
         --bytes-per-token 1024",
    ))
    .unwrap();
    let new = sim_config(&args(
        "--ttft-slo 2500ms --tpot-slo=50ms --pool-bandwidth 100Gbit/s --kv-bandwidth=50GB/s \
         --kv-bytes-per-token 1024",
    ))
    .unwrap();
    for c in [&old, &new] {
        let s = &c.scheduler;
        assert_eq!((s.slo.ttft_s, s.slo.tpot_s), (2.5, 0.05));
        assert_eq!((s.pool_bandwidth_bps, s.kv_bandwidth_bps), (12.5e9, 50e9));
        assert_eq!(s.bytes_per_token, 1024);
    }
    for bad in [["--pool-bandwidth-gbps", "NaN"], ["--ttft-slo", "soon"]] {
        let mut argv = vec!["t", "--trace", "x"];
        argv.extend(bad);
        assert!(T::try_parse_from(argv).is_err(), "{bad:?}");
    }
}

#[test]
fn profile_parsing() {
    let p = Path::new("p.csv");
    let s = parse_profile("tokens,seconds\n# c\n1000, 0.2\n\n2000,0.5\n", p).unwrap();
    assert_eq!(s, vec![(1000, 0.2), (2000, 0.5)]);
    let err = parse_profile("1000,0.2\n2000\n", p).unwrap_err();
    assert!(err.to_string().contains("line 2"), "{err}");
    let err = parse_profile("1000,0.2\nx,1\n", p).unwrap_err();
    assert!(err.to_string().contains("line 2: tokens `x`"), "{err}");
}

#[test]
fn decode_autoscale_builds_max_decode_instances_and_checks_its_range() {
    let c = sim_config(&args("--autoscale-decode 1:6 --decode 2")).unwrap();
    assert_eq!(c.decode_instances, 6);
    let a = c.autoscale_decode.expect("decode autoscale");
    assert_eq!((a.start, a.min, a.max), (2, 1, 6));
    assert_eq!((a.signal, a.startup_s), (Signal::PredictedLatency, 30.0));
    assert!(c.autoscale.is_none(), "prefill stays fixed");
    assert_eq!(c.scheduler.prefill_costs.len(), 8);
    let c = sim_config(&args(
        "--autoscale-decode 1:4 --decode 1 --autoscale-decode-signal queue-depth \
         --autoscale-decode-startup 10s --autoscale-decode-target 2",
    ))
    .unwrap();
    let a = c.autoscale_decode.expect("decode autoscale");
    assert_eq!((a.signal, a.startup_s), (Signal::QueueDepth, 10.0));
    assert_eq!(a.behavior.queue_target_per_instance, 2.0);
    let err = sim_config(&args("--autoscale-decode 2:4 --decode 8")).unwrap_err();
    assert!(err.to_string().starts_with("--decode"), "{err}");
    let err = sim_config(&args(
        "--autoscale-decode 1:4 --decode 1 --autoscale-decode-target=-1",
    ))
    .unwrap_err();
    assert!(
        err.to_string().starts_with("--autoscale-decode-target"),
        "{err}"
    );
    assert!(
        T::try_parse_from([
            "t",
            "--trace",
            "x",
            "--autoscale-decode-signal",
            "queue-depth"
        ])
        .is_err(),
        "the signal needs --autoscale-decode"
    );
    assert!(sim_config(&args("")).unwrap().autoscale_decode.is_none());
}

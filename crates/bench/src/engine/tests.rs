use super::*;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: EngineBenchArgs,
}

fn summary(median_ms: f64) -> Summary {
    Summary {
        n: 2,
        median_ms,
        p90_ms: median_ms * 1.1,
        min_ms: median_ms * 0.9,
        mean_ms: median_ms,
        samples_ms: vec![median_ms, median_ms],
    }
}

fn sources(compute: i64, hit: i64, external: i64) -> Sources {
    Sources {
        local_compute: compute,
        local_cache_hit: hit,
        external_kv_transfer: external,
    }
}

/// An arm of two rounds: the first requests got `external` tokens from the store (and the
/// rest computed), the second requests hit vLLM's cache for the prefix.
fn arm(name: &str, loaded_ms: f64, hit_ms: f64, external: i64) -> ArmRun {
    let group = ["kvpool", "mooncake", "none"];
    let first = sources(1040 - external, 0, external);
    ArmRun {
        arm: name.into(),
        loaded: summary(loaded_ms),
        hit: summary(hit_ms),
        sources_loaded: vec![first.clone(), first],
        sources_hit: vec![sources(16, 1024, 0), sources(16, 1024, 0)],
        idle_hit: None,
        idle_hit_after_s: 0.0,
        sources_idle_hit: vec![],
        ids_idle_hit: vec![],
        warm: None,
        sources_warm: vec![],
        settle: vec![],
        ids_loaded: vec![vec![5, 6, 7], vec![8, 9, 10]],
        ids_hit: vec![vec![11, 12], vec![13, 14]],
        throughput: None,
        group: if group.contains(&name) {
            group.iter().map(|g| (*g).to_owned()).collect()
        } else {
            vec![name.into()]
        },
        startup_s: 1.0,
        load_average: "1 1 1".into(),
        connector_line: String::new(),
        reader_thp_mib: None,
    }
}

fn workload() -> Workload {
    Workload {
        model: "small".into(),
        prefix_tokens: 1024,
        suffix_tokens: 16,
        block_size: 32,
        repeats: 2,
        max_tokens: 3,
        omp_threads: 1,
        warm_first: false,
        store_hugepages: "none".into(),
        engine_thp: false,
        kvpool_loads: "layerwise auto, early auto".into(),
        kvpool_package: "test".into(),
        load_average: "0 0 0".into(),
    }
}

fn run_of(arms: Vec<ArmRun>) -> DriverRun {
    DriverRun {
        engine: "vllm".into(),
        version: "0.32.0".into(),
        mooncake: Some("0.3.13.post1".into()),
        arms,
    }
}

#[test]
fn the_connector_supplies_the_prefixs_full_blocks_and_never_the_last_token() {
    assert_eq!(expected_external(1024, 16, 32), 1024);
    // A prompt that ends on a block boundary: its last block holds the last token.
    assert_eq!(expected_external(1024, 0, 32), 992);
    assert_eq!(expected_external(1000, 16, 32), 992);
}

#[test]
fn ratios_and_targets_come_from_the_medians_of_one_run() {
    let run = run_of(vec![
        arm("kvpool", 110.0, 100.0, 1024),
        arm("mooncake", 150.0, 100.0, 1024),
        arm("none", 900.0, 100.0, 0),
    ]);
    let r = report(workload(), run);
    assert!(r.all_verified, "{:?}", r.checks);
    let q = &r.ratios;
    let t = &q.targets[0];
    assert_eq!((t.arm.as_str(), t.reference.as_str()), ("kvpool", "none"));
    assert_eq!(t.over_mooncake, Some(110.0 / 150.0));
    assert!(t.vs_prefix_hit);
    assert_eq!(t.vs_mooncake, Some(true));
    assert_eq!(q.loaded_over_none_hit[0].0, "kvpool");
    assert!((q.loaded_over_none_hit[0].1 - 1.1).abs() < 1e-9);
    assert_eq!(q.loaded_over_recompute[1].0, "mooncake");
    let text = render_text(&r);
    assert!(
        text.contains("kvpool: loaded TTFT / none's prefix-cache hit 1.10 (target <= 1.2: yes)"),
        "{text}"
    );
    assert!(text.contains("recompute"), "{text}");
    assert!(text.contains("all verified: yes"), "{text}");

    let slow = report(
        workload(),
        run_of(vec![
            arm("kvpool", 130.0, 100.0, 1024),
            arm("mooncake", 120.0, 100.0, 1024),
            arm("none", 900.0, 100.0, 0),
            // Another group: its own engine's hit is its reference.
            arm("kvpool-agent", 125.0, 100.0, 1024),
        ]),
    );
    let t = &slow.ratios.targets;
    assert_eq!((t[0].vs_prefix_hit, t[0].vs_mooncake), (false, Some(false)));
    assert_eq!(t[1].reference, "kvpool-agent");
    assert!((t[1].over_prefix_hit - 1.25).abs() < 1e-9);
}

#[test]
fn a_recomputed_prefix_or_different_tokens_fail_the_checks() {
    // kvpool's engine recomputed half the prefix; the none arm loaded something.
    let mut odd = arm("mooncake", 1.0, 1.0, 1024);
    odd.ids_loaded[1] = vec![8, 9, 99];
    let r = report(
        workload(),
        run_of(vec![
            arm("kvpool", 1.0, 1.0, 512),
            odd,
            arm("none", 1.0, 1.0, 32),
        ]),
    );
    assert!(!r.all_verified);
    assert!(!r.checks[0].loaded_from_store);
    assert_eq!(r.checks[0].min_external_tokens, 512);
    assert!(r.checks[1].loaded_from_store);
    assert!(!r.checks[1].ids_equal);
    assert!(!r.checks[2].loaded_from_store);
    // Without Mooncake the second target is not measured; without none, the own hit counts.
    let alone = report(workload(), run_of(vec![arm("kvpool", 1.0, 1.0, 1024)]));
    assert_eq!(alone.ratios.targets[0].vs_mooncake, None);
    assert_eq!(alone.ratios.targets[0].reference, "kvpool");
    assert!(alone.all_verified);
}

#[test]
fn the_drivers_last_json_line_is_parsed() {
    let run = run_of(vec![arm("kvpool", 1.0, 1.0, 1024)]);
    let text = format!(
        "noise\n{{\"not\": \"this\"\n{}\n",
        serde_json::to_string(&run).unwrap()
    );
    assert_eq!(parse_run(&text).unwrap(), run);
    assert!(parse_run("no json").is_err());
}

#[test]
fn the_engine_and_its_version_are_read_and_named() {
    // Drivers before `--engine` existed wrote the vLLM version under `vllm`.
    let old = parse_run(r#"{"vllm": "0.32.0", "arms": []}"#).unwrap();
    assert_eq!(
        (old.engine.as_str(), old.version.as_str()),
        ("vllm", "0.32.0")
    );
    let mut run = run_of(vec![arm("kvpool", 1.0, 1.0, 1024)]);
    run.engine = "sglang".into();
    run.version = "0.5.23".into();
    let text = serde_json::to_string(&run).unwrap();
    let back = parse_run(&text).unwrap();
    assert_eq!(back, run);
    let w = workload();
    let shown = render_text(&report(w, back));
    assert!(shown.starts_with("SGLang 0.5.23 "), "{shown}");
}

#[test]
fn flags_are_checked() {
    let ok = Cli::parse_from(["x", "--prefix-tokens", "1000"]);
    ok.args.validate().unwrap();
    assert_eq!(ok.args.prefix(), 992);
    assert_eq!(
        ok.args.groups(),
        vec![
            vec!["kvpool", "mooncake", "none"],
            vec!["kvpool-agent", "kvpool-engine"]
        ]
    );
    for bad in [
        vec!["x", "--arms", "kvpool,redis"],
        vec!["x", "--suffix-tokens", "32"],
        vec!["x", "--prefix-tokens", "16"],
        vec!["x", "--client-mode", "rdma"],
    ] {
        assert!(
            Cli::parse_from(bad.clone()).args.validate().is_err(),
            "{bad:?}"
        );
    }
}

#[test]
fn the_engine_picks_its_venv() {
    let vllm = Cli::parse_from(["x"]).args;
    assert_eq!(
        vllm.python(),
        std::path::PathBuf::from(".tools/vllm/bin/python")
    );
    let sglang = Cli::parse_from(["x", "--engine", "sglang", "--sglang-venv", "/v"]).args;
    assert_eq!(sglang.python(), std::path::PathBuf::from("/v/bin/python"));
    assert!(Cli::try_parse_from(["x", "--engine", "trtllm"]).is_err());
}

#[test]
fn huge_pages_reach_the_stores_the_engines_and_the_report() {
    let plain = Cli::parse_from(["x"]).args;
    assert_eq!(plain.pages.agent_flags(), ["--hugepages", "none"]);
    assert!(!plain.engine_thp);
    let huge = Cli::parse_from(["x", "--store-hugepages", "2MiB", "--engine-thp"]).args;
    assert_eq!(huge.pages.agent_flags(), ["--hugepages", "2MiB"]);
    assert_eq!(huge.pages.mooncake_env()[0], ("MC_STORE_USE_HUGEPAGE", "1"));
    assert!(huge.engine_thp);
    assert!(Cli::try_parse_from(["x", "--store-hugepages", "3MiB"]).is_err());
    let mut w = workload();
    w.store_hugepages = "2MiB".into();
    w.engine_thp = true;
    let text = render_text(&report(w, run_of(vec![])));
    assert!(
        text.contains(
            "stores' huge pages: 2MiB; engines' THP: true; kvpool loads: layerwise auto, early auto"
        ),
        "{text}"
    );
    let late = Cli::parse_from(["x", "--early-load", "false"]).args;
    assert_eq!(late.early_load, "false");
    assert!(Cli::try_parse_from(["x", "--early-load", "soon"]).is_err());
}

#[test]
fn idle_hits_give_an_informative_ratio_and_must_come_from_vllms_cache() {
    let with_idle = |name: &str, loaded: f64, hit: f64, idle: f64, from_cache: bool| {
        let mut a = arm(name, loaded, hit, if name == "none" { 0 } else { 1024 });
        a.idle_hit = Some(summary(idle));
        a.idle_hit_after_s = 2.0;
        let s = if from_cache {
            sources(16, 1024, 0)
        } else {
            sources(1040, 0, 0)
        };
        a.sources_idle_hit = vec![s.clone(), s];
        a
    };
    let run = DriverRun {
        engine: "vllm".into(),
        version: "0.32.0".into(),
        mooncake: None,
        arms: vec![
            with_idle("kvpool", 90.0, 40.0, 60.0, true),
            with_idle("none", 1200.0, 40.0, 75.0, true),
        ],
    };
    let r = report(workload(), run.clone());
    assert_eq!(
        r.ratios.loaded_over_idle_hit,
        vec![("kvpool".to_owned(), 1.2)]
    );
    // The targets stay against the hot hit.
    assert!((r.ratios.targets[0].over_prefix_hit - 2.25).abs() < 1e-9);
    assert!(r.all_verified, "{:?}", r.checks);
    let text = render_text(&r);
    assert!(
        text.contains("prefix-cache hit after 2.0 s idle:  kvpool 1.20"),
        "{text}"
    );
    // An idle request that recomputed its prefix is not a hit: the arm fails its check.
    let mut bad = run;
    bad.arms[0] = with_idle("kvpool", 90.0, 40.0, 60.0, false);
    let r = report(workload(), bad);
    assert!(!r.checks[0].hit_from_cache && !r.all_verified);
    assert!(
        r.checks[0].notes.iter().any(|n| n.contains("idle hits")),
        "{:?}",
        r.checks[0].notes
    );
}

#[test]
fn warm_requests_are_reported_and_must_compute_every_token() {
    let with_warm = |name: &str, warm_sources: Sources| {
        let mut a = arm(name, 45.0, 40.0, if name == "none" { 0 } else { 1024 });
        a.warm = Some(summary(55.0));
        a.sources_warm = vec![warm_sources.clone(), warm_sources];
        a
    };
    let run = run_of(vec![
        with_warm("kvpool", sources(16, 0, 0)),
        with_warm("none", sources(16, 0, 0)),
    ]);
    let r = report(workload(), run.clone());
    assert!(r.all_verified, "{:?}", r.checks);
    let text = render_text(&r);
    assert!(
        text.contains(
            "warm request before each first request (TTFT p50 ms): kvpool 55.0, none 55.0"
        ),
        "{text}"
    );
    // A warm request that took blocks from the store would have been the first request.
    let mut bad = run.clone();
    bad.arms[0] = with_warm("kvpool", sources(0, 0, 16));
    let r = report(workload(), bad);
    assert!(!r.checks[0].loaded_from_store && !r.all_verified);
    assert!(
        r.checks[0]
            .notes
            .iter()
            .any(|n| n.contains("warm requests")),
        "{:?}",
        r.checks[0].notes
    );
    // One warm request's sources missing: not verified either.
    let mut short = run;
    short.arms[1].sources_warm.pop();
    assert!(!report(workload(), short).all_verified);
}

#[test]
fn idle_hits_greedy_ids_must_match_across_arms() {
    let mut run = run_of(vec![
        arm("kvpool", 45.0, 40.0, 1024),
        arm("none", 1200.0, 40.0, 0),
    ]);
    for a in &mut run.arms {
        a.idle_hit = Some(summary(50.0));
        a.sources_idle_hit = vec![sources(16, 1024, 0), sources(16, 1024, 0)];
        a.ids_idle_hit = vec![vec![1, 2], vec![3, 4]];
    }
    assert!(report(workload(), run.clone()).all_verified);
    run.arms[1].ids_idle_hit[1] = vec![3, 5];
    let r = report(workload(), run);
    assert!(!r.checks[1].ids_equal && !r.all_verified, "{:?}", r.checks);
}

#[test]
fn the_reader_engines_huge_pages_are_reported_and_a_missing_one_warned_of() {
    let mut w = workload();
    w.engine_thp = true;
    // A driver that read nothing (older runs): no line.
    let text = render_text(&report(
        w.clone(),
        run_of(vec![arm("kvpool", 40.0, 35.0, 1024)]),
    ));
    assert!(!text.contains("transparent huge pages"), "{text}");
    let mut with = arm("kvpool", 40.0, 35.0, 1024);
    with.reader_thp_mib = Some(258.0);
    let mut without = arm("none", 300.0, 35.0, 0);
    without.reader_thp_mib = Some(0.0);
    let text = render_text(&report(
        w.clone(),
        run_of(vec![with.clone(), without.clone()]),
    ));
    assert!(
        text.contains("transparent huge pages (AnonHugePages): kvpool 258 MiB, none 0 MiB (warning: --engine-thp asked for them; none in none)"),
        "{text}"
    );
    // Not asked for: the figures, no warning.
    w.engine_thp = false;
    let text = render_text(&report(w, run_of(vec![with, without])));
    assert!(text.contains("kvpool 258 MiB, none 0 MiB\n"), "{text}");
}

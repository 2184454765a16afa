//! Unit tests of `kvpool bench transfer`'s flags, size parsing and baselines.

use super::baselines::{Baselines, memcpy_bandwidth, parse_iperf3_json};
use super::*;
use clap::Parser;

#[derive(Parser)]
struct Wrap {
    #[command(flatten)]
    a: TransferBenchArgs,
}

#[test]
fn sizes_parse_with_units() {
    assert_eq!(parse_size("65536"), Ok(65536));
    assert_eq!(parse_size("4MiB"), Ok(4 << 20));
    assert_eq!(parse_size("4M"), Ok(4 << 20));
    assert_eq!(parse_size("1g"), Ok(1 << 30));
    assert!(parse_size("0").is_err());
    assert!(parse_size("12 parsecs").is_err());
    assert!(parse_size("99999999999999999999G").is_err());
}

#[test]
fn mooncake_style_flags_parse() {
    let w = Wrap::try_parse_from([
        "x",
        "--mode",
        "initiator",
        "--operation",
        "write",
        "--protocol",
        "tcp",
        "--block-size",
        "4MiB",
        "--batch-size",
        "16",
        "--threads",
        "2",
        "--duration",
        "3",
        "--target-addr",
        "10.0.0.2:7400",
        "--json",
    ])
    .unwrap();
    assert_eq!(w.a.block_size, 4 << 20);
    assert_eq!(w.a.mode, Mode::Initiator);
    assert!(w.a.validate().is_ok());
    let w = Wrap::try_parse_from(["x", "--mode", "initiator"]).unwrap();
    assert!(matches!(w.a.validate(), Err(TransferBenchError::Args(_))));
}

#[test]
fn iperf3_json_is_parsed_and_errors_are_reported() {
    let ok = r#"{"start":{},"end":{"sum_received":{"bits_per_second":8e10}}}"#;
    assert!((parse_iperf3_json(ok).unwrap() - 10.0).abs() < 1e-9);
    let err = r#"{"start":{},"error":"unable to connect to server"}"#;
    assert!(
        parse_iperf3_json(err)
            .unwrap_err()
            .contains("unable to connect")
    );
    assert!(parse_iperf3_json("not json").is_err());
}

/// Baselines of one measurement: one iperf3 run and one memcpy run at these rates.
fn one_run(iperf3_gb_per_s: f64, memcpy_gb_per_s: f64) -> Baselines {
    Baselines {
        iperf3_gb_per_s: Some(iperf3_gb_per_s),
        iperf3_runs: vec![iperf3_gb_per_s],
        iperf3_error: None,
        memcpy_gb_per_s,
        memcpy_runs: vec![memcpy_gb_per_s],
    }
}

#[test]
fn baselines_before_and_after_are_averaged() {
    let a = one_run(1.0, 4.0);
    let b = one_run(3.0, 2.0);
    let m = a.merge(b);
    assert_eq!(m.iperf3_gb_per_s, Some(2.0));
    assert_eq!(m.memcpy_gb_per_s, 3.0);
    assert_eq!(m.iperf3_runs.len(), 2);
}

#[test]
fn memcpy_baseline_measures_something() {
    assert!(memcpy_bandwidth(1 << 20, Duration::from_millis(50)) > 0.0);
}

#[test]
fn tls_runs_plain_and_tls_in_one_process_only() {
    let w = Wrap::try_parse_from(["x", "--tls"]).unwrap();
    assert!(w.a.tls);
    assert!(w.a.validate().is_ok());
    assert_eq!(
        w.a.engine_tls.mode,
        TlsMode::Off,
        "the first run is plaintext"
    );
    let w = Wrap::try_parse_from(["x", "--tls", "--mode", "target"]).unwrap();
    assert!(matches!(w.a.validate(), Err(TransferBenchError::Args(m)) if m.contains("--tls")));
}

/// The TLS run of `--tls` moves real bytes over TLS: a short cell against a throw-away CA.
#[test]
fn the_tls_run_moves_bytes_over_tls() {
    let w = Wrap::try_parse_from([
        "x",
        "--tls",
        "--no-baselines",
        "--duration",
        "300ms",
        "--block-size",
        "64KiB",
        "--batch-size",
        "4",
        "--threads",
        "1",
        "--buffer-size",
        "1MiB",
    ])
    .unwrap();
    let key = AuthKey::random().unwrap();
    let report = run_tls(&w.a, &key).unwrap();
    assert_eq!(report.tls, "require");
    assert!(
        report.requests_done > 0 && report.requests_failed == 0,
        "{report:?}"
    );
}

//! A real Prometheus scraping real `kvpool` processes on 127.0.0.1: the master, a synthetic
//! engine and a conductor routing to it. Checks /livez and /readyz of each, that Prometheus
//! sees every target up and the request counters moving after real OpenAI requests, and that
//! every process exits 0 on SIGTERM. I/O boundary: child processes, loopback sockets, temp dirs.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use kvpool_harness::http::request;
use kvpool_harness::{
    ChildProcess, Launcher, MasterSpec, PrometheusServer, ScrapeTarget, free_addr, kvpool_command,
};

const KVPOOL: &str = env!("CARGO_BIN_EXE_kvpool");
/// Bound on every wait (readiness, scrapes, exits); generous for a loaded 2-core CI box.
const WAIT: Duration = Duration::from_secs(45);
const POLL: Duration = Duration::from_millis(100);

/// `kvpool <args>` as child `name`, logging into `dir/<name>.log`; `args` are split at spaces.
fn spawn(name: &str, args: &str, dir: &Path) -> ChildProcess {
    Launcher::new(dir)
        .spawn(
            name,
            kvpool_command(Path::new(KVPOOL)).args(args.split(' ')),
        )
        .expect("spawn")
}

/// A free loopback address.
fn addr() -> SocketAddr {
    free_addr().expect("free port")
}

/// Polls `check` until it returns true or [`WAIT`] passes; returns whether it succeeded.
fn wait_until(check: impl FnMut() -> bool) -> bool {
    kvpool_harness::poll::until(WAIT, POLL, check)
}

struct Target {
    job: &'static str,
    admin: SocketAddr,
    /// A series its /metrics must export before any request.
    series: &'static str,
}

#[test]
fn prometheus_scrapes_master_engine_and_conductor() {
    PrometheusServer::binary().unwrap_or_else(|e| {
        panic!("FAIL: {e}; install the test dependencies with scripts/deps.sh")
    });
    let dir = tempfile::tempdir().expect("temp dir");

    // Master: gRPC + admin, with a pool key.
    let key = dir.path().join("pool.key");
    std::fs::write(&key, b"prometheus-scrape-test-key-0123456789").expect("write key");
    let master = MasterSpec::new(KVPOOL, &key)
        .and_then(|m| m.spawn(&Launcher::new(dir.path()), "master"))
        .expect("kvpool master");
    let (master_admin, master) = (master.admin, master.process);

    // One synthetic engine, 1000x faster than the cost model, serving prefill and decode.
    let engine_api = addr();
    let engine_admin = addr();
    let engine = spawn(
        "engine",
        &format!(
            "engine --synthetic --listen {engine_api} --admin-listen {engine_admin} \
             --time-scale 0.001"
        ),
        dir.path(),
    );

    let conductor_api = addr();
    let conductor_admin = addr();
    let conductor = spawn(
        "conductor",
        &format!(
            "conductor --listen {conductor_api} --admin-listen {conductor_admin} \
             --prefill http://{engine_api} --decode http://{engine_api}"
        ),
        dir.path(),
    );

    let mut procs = [master, engine, conductor];
    let targets = [
        Target {
            job: "kvpool-master",
            admin: master_admin,
            series: "kvpool_master_objects",
        },
        Target {
            job: "kvpool-engine",
            admin: engine_admin,
            series: "kvpool_engine_generated_tokens_total",
        },
        Target {
            job: "kvpool-conductor",
            admin: conductor_admin,
            series: r#"kvpool_conductor_requests_total{outcome="ok"} 0"#,
        },
    ];

    // /livez and /readyz answer 200 once each process is ready; /metrics has its series.
    for (p, t) in procs.iter_mut().zip(&targets) {
        p.wait_ready(&kvpool_harness::Probe::readyz(t.admin), WAIT)
            .expect("ready");
        let livez = request(t.admin, "GET", "/livez", "").expect("livez answers");
        assert_eq!(livez.status, 200, "{}: /livez", p.name());
        let metrics = request(t.admin, "GET", "/metrics", "").expect("metrics answers");
        assert_eq!(metrics.status, 200, "{}: /metrics", p.name());
        assert!(
            metrics.body.contains(t.series),
            "{}: /metrics lacks `{}`:\n{}",
            p.name(),
            t.series,
            metrics.body
        );
    }

    // Prometheus scraping the three admin endpoints every second.
    let scrape: Vec<ScrapeTarget> = targets
        .iter()
        .map(|t| ScrapeTarget {
            job: t.job.into(),
            addr: t.admin,
        })
        .collect();
    let mut prom = PrometheusServer::start(dir.path(), &scrape).expect("prometheus");

    // Real requests through the conductor, so the request counters move.
    for i in 0..3 {
        let body = format!(
            r#"{{"model":"kvpool-synthetic","prompt":"observability check {i}","max_tokens":4}}"#
        );
        let r = request(conductor_api, "POST", "/v1/completions", &body)
            .expect("conductor answers /v1/completions");
        assert_eq!(r.status, 200, "completion {i}: {}", r.body);
    }

    // Every target up, and the counters of the conductor and the engine seen by Prometheus.
    let mut wanted: Vec<String> = targets
        .iter()
        .map(|t| format!("up{{job=\"{}\"}}", t.job))
        .collect();
    wanted.push(r#"sum(kvpool_conductor_requests_total{outcome="ok"})"#.into());
    wanted.push(r#"sum(kvpool_engine_requests_total{outcome="ok"})"#.into());
    let mut missing = wanted.clone();
    let all_seen = wait_until(|| {
        missing.retain(|q| prom.query(q).is_none_or(|v| v < 1.0));
        missing.is_empty()
    });
    prom.process.assert_running().expect("prometheus runs");
    assert!(
        all_seen,
        "within {WAIT:?} Prometheus did not report >= 1 for: {missing:?}; prometheus log:\n{}",
        prom.process.log_text()
    );

    // Clean shutdown: SIGTERM, exit status 0. Conductor first, the engine it uses last.
    for p in procs.iter_mut().rev() {
        let status = p.terminate(WAIT).expect("exit after SIGTERM");
        assert!(
            status.success(),
            "{} exited with {status} after SIGTERM; log:\n{}",
            p.name(),
            p.log_text()
        );
    }
    // `prom` is killed by its Drop guard, also when an assertion above fails.
}

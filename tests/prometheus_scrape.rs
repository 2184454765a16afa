//! A real Prometheus scraping real `kvpool` processes on 127.0.0.1: the master, a synthetic
//! engine and a conductor routing to it. Checks /livez and /readyz of each, that Prometheus
//! sees every target up and the request counters moving after real OpenAI requests, and that
//! every process exits 0 on SIGTERM. I/O boundary: child processes, loopback sockets, temp dirs.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

const KVPOOL: &str = env!("CARGO_BIN_EXE_kvpool");
/// Bound on every wait (readiness, scrapes, exits); generous for a loaded 2-core CI box.
const WAIT: Duration = Duration::from_secs(45);
const POLL: Duration = Duration::from_millis(100);

/// A free loopback port: bound then released, so the child can bind it.
fn free_addr() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr")
}

/// A child process with its log file; killed on drop unless it was already reaped.
struct Proc {
    name: &'static str,
    child: Child,
    log: PathBuf,
    exited: Option<ExitStatus>,
}

impl Proc {
    fn spawn(name: &'static str, program: &Path, args: &[String], dir: &Path) -> Proc {
        let log = dir.join(format!("{name}.log"));
        let out = File::create(&log).expect("create log file");
        let err = out.try_clone().expect("clone log file");
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({}): {e}", program.display()));
        Proc {
            name,
            child,
            log,
            exited: None,
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Fails the test if the process has already exited.
    fn assert_running(&mut self) {
        if let Some(status) = self.child.try_wait().expect("try_wait") {
            self.exited = Some(status);
            panic!(
                "{} exited early with {status}; its log:\n{}",
                self.name,
                self.log_text()
            );
        }
    }

    /// SIGTERM, then wait (bounded) for the exit status.
    fn terminate(&mut self) -> ExitStatus {
        let pid = Pid::from_raw(i32::try_from(self.child.id()).expect("pid fits i32"));
        kill(pid, Signal::SIGTERM).expect("send SIGTERM");
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                self.exited = Some(status);
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not exit within {WAIT:?} of SIGTERM; its log:\n{}",
                self.name,
                self.log_text()
            );
            std::thread::sleep(POLL);
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.exited.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One HTTP/1.1 request over a fresh connection; returns (status, body), or None when the
/// server is not answering (yet).
fn http(addr: SocketAddr, method: &str, target: &str, body: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(20))).ok()?;
    let req = format!(
        "{method} {target} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.get(9..12)?.parse().ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)?
    } else {
        body.to_owned()
    };
    Some((status, body))
}

fn dechunk(mut rest: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(after.get(..size)?);
        rest = after.get(size + 2..)?;
    }
}

/// Percent-encodes a query-string value.
fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// Polls `check` until it returns true or [`WAIT`] passes; returns whether it succeeded.
fn wait_until(mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + WAIT;
    loop {
        if check() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
}

/// The value of an instant PromQL query with a single-sample answer, if any.
fn prom_value(prom: SocketAddr, query: &str) -> Option<f64> {
    let (status, body) = http(
        prom,
        "GET",
        &format!("/api/v1/query?query={}", encode(query)),
        "",
    )?;
    if status != 200 {
        return None;
    }
    let v: Value = serde_json::from_str(&body).ok()?;
    v["data"]["result"].get(0)?["value"]
        .get(1)?
        .as_str()?
        .parse()
        .ok()
}

fn prometheus_binary() -> PathBuf {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join("prometheus"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "FAIL: no `prometheus` binary on PATH; install the test dependencies with \
                 scripts/deps.sh (Debian package `prometheus`)"
            )
        })
}

struct Target {
    job: &'static str,
    admin: SocketAddr,
    /// A series its /metrics must export before any request.
    series: &'static str,
}

#[test]
fn prometheus_scrapes_master_engine_and_conductor() {
    let prometheus = prometheus_binary();
    let dir = tempfile::tempdir().expect("temp dir");
    let kvpool = Path::new(KVPOOL);

    // Master: gRPC + admin, with a pool key.
    let key = dir.path().join("pool.key");
    std::fs::write(&key, b"prometheus-scrape-test-key-0123456789").expect("write key");
    let master_admin = free_addr();
    let master = Proc::spawn(
        "master",
        kvpool,
        &[
            "master".into(),
            "--listen".into(),
            free_addr().to_string(),
            "--admin-addr".into(),
            master_admin.to_string(),
            "--auth-key-file".into(),
            key.display().to_string(),
        ],
        dir.path(),
    );

    // One synthetic engine, 1000x faster than the cost model, serving prefill and decode.
    let engine_api = free_addr();
    let engine_admin = free_addr();
    let engine = Proc::spawn(
        "engine",
        kvpool,
        &[
            "engine".into(),
            "--synthetic".into(),
            "--listen".into(),
            engine_api.to_string(),
            "--admin-listen".into(),
            engine_admin.to_string(),
            "--time-scale".into(),
            "0.001".into(),
        ],
        dir.path(),
    );

    let conductor_api = free_addr();
    let conductor_admin = free_addr();
    let conductor = Proc::spawn(
        "conductor",
        kvpool,
        &[
            "conductor".into(),
            "--listen".into(),
            conductor_api.to_string(),
            "--admin-listen".into(),
            conductor_admin.to_string(),
            "--prefill".into(),
            format!("http://{engine_api}"),
            "--decode".into(),
            format!("http://{engine_api}"),
        ],
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
        let ready = wait_until(|| {
            http(t.admin, "GET", "/readyz", "").is_some_and(|(s, _)| s == 200)
                || p.child.try_wait().ok().flatten().is_some()
        });
        p.assert_running();
        assert!(
            ready,
            "{}: /readyz on {} not 200 within {WAIT:?}; log:\n{}",
            p.name,
            t.admin,
            p.log_text()
        );
        let (status, _) = http(t.admin, "GET", "/livez", "").expect("livez answers");
        assert_eq!(status, 200, "{}: /livez", p.name);
        let (status, body) = http(t.admin, "GET", "/metrics", "").expect("metrics answers");
        assert_eq!(status, 200, "{}: /metrics", p.name);
        assert!(
            body.contains(t.series),
            "{}: /metrics lacks `{}`:\n{body}",
            p.name,
            t.series
        );
    }

    // Prometheus scraping the three admin endpoints every second.
    let mut config = String::from("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n");
    config.push_str("scrape_configs:\n");
    for t in &targets {
        let _ = write!(
            config,
            "  - job_name: {job}\n    scrape_interval: 1s\n    scrape_timeout: 1s\n    \
             static_configs:\n      - targets: ['{addr}']\n",
            job = t.job,
            addr = t.admin
        );
    }
    let config_path = dir.path().join("prometheus.yml");
    std::fs::write(&config_path, config).expect("write prometheus.yml");
    let tsdb = dir.path().join("tsdb");
    let prom_addr = free_addr();
    let mut prom = Proc::spawn(
        "prometheus",
        &prometheus,
        &[
            format!("--config.file={}", config_path.display()),
            format!("--storage.tsdb.path={}", tsdb.display()),
            format!("--web.listen-address={prom_addr}"),
        ],
        dir.path(),
    );

    // Real requests through the conductor, so the request counters move.
    for i in 0..3 {
        let body = format!(
            r#"{{"model":"kvpool-synthetic","prompt":"observability check {i}","max_tokens":4}}"#
        );
        let (status, text) = http(conductor_api, "POST", "/v1/completions", &body)
            .expect("conductor answers /v1/completions");
        assert_eq!(status, 200, "completion {i}: {text}");
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
        missing.retain(|q| prom_value(prom_addr, q).is_none_or(|v| v < 1.0));
        missing.is_empty()
    });
    prom.assert_running();
    assert!(
        all_seen,
        "within {WAIT:?} Prometheus did not report >= 1 for: {missing:?}; prometheus log:\n{}",
        prom.log_text()
    );

    // Clean shutdown: SIGTERM, exit status 0. Conductor first, the engine it uses last.
    for p in procs.iter_mut().rev() {
        let status = p.terminate();
        assert!(
            status.success(),
            "{} exited with {status} after SIGTERM; log:\n{}",
            p.name,
            p.log_text()
        );
    }
    // `prom` is killed by its Drop guard, also when an assertion above fails.
}

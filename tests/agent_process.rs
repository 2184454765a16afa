//! The real node agent (`kvpool agent run`) as a child process: config errors exit non-zero
//! naming the field; a running agent becomes ready, serves the engine API, the admin endpoints
//! and metrics; SIGTERM drains, persists the SSD index and exits 0; a restarted agent recovers
//! the blocks from SSD.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kvpool_agent::api::client::EngineClient;
use kvpool_agent::proto::Status;
use kvpool_harness::scrape::metric_value;
use kvpool_harness::{AgentSpec, ChildProcess, Launcher, Probe, http};

const KVPOOL: &str = env!("CARGO_BIN_EXE_kvpool");

/// `kvpool agent ...`.
fn agent_command() -> Command {
    let mut cmd = Command::new(KVPOOL);
    cmd.arg("agent");
    cmd
}
/// Generous: the CI box is a loaded 2-core machine. Only a hang ever reaches it.
const DEADLINE: Duration = Duration::from_secs(120);

fn fixture_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("agent/tests/fixtures/tcp-single")
}

fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let r = http::get(addr, path).expect("admin answers");
    (r.status, r.body)
}

struct Agent {
    process: ChildProcess,
    admin: SocketAddr,
    socket: PathBuf,
}

/// A local agent in `dir` with 8 MiB of DRAM, a 16 MiB SSD tier that keeps DRAM on shutdown,
/// the admin server on any port, logging JSON.
fn agent_spec(dir: &Path) -> AgentSpec {
    AgentSpec::new(KVPOOL, dir, "test-node", "8MiB")
        .fixture(&fixture_root())
        .section(&format!(
            "ssd:\n  path: {}\n  capacity: 16MiB\n  persist_dram_on_shutdown: true\n  sync_interval: 100ms\n",
            dir.join("ssd").display()
        ))
        .args(["--log-format", "json"])
}

/// The address of a JSON log line saying the admin server listens.
fn admin_listening(line: &str) -> Option<SocketAddr> {
    let parsed: serde_json::Value = serde_json::from_str(line).ok()?;
    if parsed["fields"]["message"] != "admin server listening" {
        return None;
    }
    parsed["fields"]["addr"].as_str()?.parse().ok()
}

fn start(spec: &AgentSpec, dir: &Path) -> Agent {
    let mut a = spec.spawn(&Launcher::new(dir)).expect("spawn agent");
    let line = a
        .process
        .wait_for_log_line("the admin address", DEADLINE, |l| {
            admin_listening(l).is_some()
        })
        .expect("agent logs its admin address");
    let admin = admin_listening(&line).expect("addr");
    a.process
        .wait_ready(&Probe::readyz(admin), DEADLINE)
        .expect("agent ready");
    Agent {
        process: a.process,
        admin,
        socket: a.socket,
    }
}

fn terminate(mut agent: Agent) {
    let status = agent
        .process
        .terminate(DEADLINE)
        .expect("agent exits after SIGTERM");
    assert!(status.success(), "agent exited with {status}");
    assert!(!agent.socket.exists(), "socket removed on shutdown");
}

/// `kvpool agent <args> <path>`, which must exit non-zero; returns its stderr.
fn check_config_fails(args: &[&str], path: &Path) -> String {
    let out = agent_command().args(args).arg(path).output().expect("run");
    assert!(!out.status.success(), "{args:?} accepted");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn bad_config_exits_non_zero_naming_the_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bad.yaml");
    std::fs::write(&path, "dram:\n  capacity: 1KiB\n").expect("write");
    let stderr = check_config_fails(&["check-config", "--config"], &path);
    assert!(stderr.contains("dram.capacity"), "{stderr}");

    // A flag overrides the file and is validated the same way.
    std::fs::write(&path, "ssd:\n  path: /var/lib/kvpool\n  capacity: 1GiB\n").expect("write");
    let stderr = check_config_fails(
        &["check-config", "--ssd-capacity", "10KiB", "--config"],
        &path,
    );
    assert!(stderr.contains("ssd.capacity"), "{stderr}");

    let out = agent_command()
        .args(["run", "--dram-capacity", "plenty"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--dram-capacity"));
}

#[test]
fn serves_persists_on_sigterm_and_recovers_after_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = agent_spec(dir.path());
    let agent = start(&spec, dir.path());

    let (code, body) = http_get(agent.admin, "/topology/summary");
    assert_eq!(code, 200);
    let summary: serde_json::Value = serde_json::from_str(&body).expect("summary json");
    assert_eq!(summary["labels"]["kvpool.dev/rdma"], "false");
    assert_eq!(summary["labels"]["kvpool.dev/gpus"], "1");
    let (code, body) = http_get(agent.admin, "/topology");
    assert_eq!(code, 200);
    let topo: serde_json::Value = serde_json::from_str(&body).expect("topology json");
    assert_eq!(topo["gpus"][0]["pci_bus_id"], "0000:01:00.0");

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut c = EngineClient::connect(&agent.socket, 1 << 20, "test")
            .await
            .expect("connect");
        for i in 0..3u8 {
            let data = vec![i; 100_000];
            assert_eq!(c.put(&[b'b', i], &data).await.expect("put"), Status::Ok);
        }
        assert_eq!(c.get(b"b\x01").await.expect("get"), Some(vec![1; 100_000]));
        c.close().await.expect("close");
    });

    let (code, metrics) = http_get(agent.admin, "/metrics");
    assert_eq!(code, 200);
    for needle in [
        "kvpool_agent_capacity_bytes{numa_node=\"0\",tier=\"dram\"} 8388608",
        "kvpool_agent_capacity_bytes{numa_node=\"all\",tier=\"ssd\"} 16777216",
        "kvpool_agent_blocks{tier=\"dram\"} 3",
        "kvpool_agent_hits_total{tier=\"dram\"} 1",
        "kvpool_agent_written_bytes_total{tier=\"dram\"} 300000",
        "kvpool_agent_discovery_warnings 0",
        "kvpool_agent_op_duration_seconds_count{op=\"put\"} 3",
    ] {
        assert!(metrics.contains(needle), "missing {needle} in\n{metrics}");
    }

    // An engine that stays connected (session open, channel idle) must not hold up shutdown.
    let lingering = rt.block_on(async {
        let mut c = EngineClient::connect(&agent.socket, 4096, "lingering")
            .await
            .expect("connect");
        assert_eq!(c.exists(&[b"b\x00"]).await.expect("exists"), vec![true]);
        c
    });
    terminate(agent);
    drop(lingering);

    // Restart: the blocks were demoted on shutdown and come back from SSD.
    let agent = start(&spec, dir.path());
    let (_, metrics) = http_get(agent.admin, "/metrics");
    assert_eq!(
        metric_value(&metrics, "kvpool_agent_blocks", &["tier=\"ssd\""]),
        Some(3.0),
        "{metrics}"
    );
    rt.block_on(async {
        let mut c = EngineClient::connect(&agent.socket, 1 << 20, "test")
            .await
            .expect("connect");
        for i in 0..3u8 {
            assert_eq!(
                c.get(&[b'b', i]).await.expect("get"),
                Some(vec![i; 100_000]),
                "block {i} after restart"
            );
        }
        c.close().await.expect("close");
    });
    let (_, metrics) = http_get(agent.admin, "/metrics");
    assert_eq!(
        metric_value(&metrics, "kvpool_agent_hits_total", &["tier=\"ssd\""]),
        Some(3.0),
        "{metrics}"
    );
    terminate(agent);
}

//! The real `kvpool-agent` binary as a child process: config errors exit non-zero naming the
//! field; a running agent becomes ready, serves the engine API, the admin endpoints and
//! metrics; SIGTERM drains, persists the SSD index and exits 0; a restarted agent recovers the
//! blocks from SSD.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvpool_agent::api::client::EngineClient;
use kvpool_agent::proto::Status;

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
    let mut s = TcpStream::connect(addr).expect("connect admin");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_owned();
    (code, body)
}

struct Agent {
    child: Child,
    admin: SocketAddr,
    socket: PathBuf,
}

fn write_config(dir: &Path) -> PathBuf {
    let root = fixture_root();
    let cfg = format!(
        "node_name: test-node\n\
         discovery:\n  sysfs_root: {}\n  procfs_root: {}\n\
         dram:\n  capacity: 8MiB\n  lock: false\n\
         ssd:\n  path: {}\n  capacity: 16MiB\n  persist_dram_on_shutdown: true\n  sync_interval: 100ms\n\
         engine_api:\n  socket_dir: {}\n\
         admin:\n  listen: 127.0.0.1:0\n",
        root.join("sys").display(),
        root.join("proc").display(),
        dir.join("ssd").display(),
        dir.join("run").display(),
    );
    let path = dir.join("agent.yaml");
    std::fs::write(&path, cfg).expect("write config");
    path
}

fn start(config: &Path, dir: &Path) -> Agent {
    let mut child = agent_command()
        .args(["--log-format", "json", "run", "--config"])
        .arg(config)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn agent");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let parsed: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
            if parsed["fields"]["message"] == "admin server listening"
                && let Some(addr) = parsed["fields"]["addr"].as_str()
            {
                let _ = tx.send(addr.to_owned());
            }
        }
    });
    let addr: SocketAddr = rx
        .recv_timeout(DEADLINE)
        .expect("agent logs its admin address")
        .parse()
        .expect("addr");
    let started = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("agent exited early: {status}");
        }
        if TcpStream::connect(addr).is_ok() && http_get(addr, "/readyz").0 == 200 {
            break;
        }
        assert!(started.elapsed() < DEADLINE, "agent never became ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    Agent {
        child,
        admin: addr,
        socket: dir.join("run").join("agent.sock"),
    }
}

fn terminate(mut agent: Agent) {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(agent.child.id()).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = agent.child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "agent did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "agent exited with {status}");
    assert!(!agent.socket.exists(), "socket removed on shutdown");
}

#[test]
fn bad_config_exits_non_zero_naming_the_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bad.yaml");
    std::fs::write(&path, "dram:\n  capacity: 1KiB\n").expect("write");
    let out = agent_command()
        .args(["check-config", "--config"])
        .arg(&path)
        .output()
        .expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("dram.capacity"), "{stderr}");

    // A flag overrides the file and is validated the same way.
    std::fs::write(&path, "ssd:\n  path: /var/lib/kvpool\n  capacity: 1GiB\n").expect("write");
    let out = agent_command()
        .args(["check-config", "--ssd-capacity", "10KiB", "--config"])
        .arg(&path)
        .output()
        .expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
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
    let config = write_config(dir.path());
    let agent = start(&config, dir.path());

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
    let agent = start(&config, dir.path());
    let (_, metrics) = http_get(agent.admin, "/metrics");
    assert!(
        metrics.contains("kvpool_agent_blocks{tier=\"ssd\"} 3"),
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
    assert!(
        metrics.contains("kvpool_agent_hits_total{tier=\"ssd\"} 3"),
        "{metrics}"
    );
    terminate(agent);
}

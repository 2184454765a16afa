//! Helpers shared by the agent tests that run a real `kvpool master` and real `kvpool-agent`
//! processes on 127.0.0.1 (pool_wiring.rs, pool_ssd_restart.rs): start them with logs in the
//! test's directory, kill them when a test fails, and poll readiness, metrics and master stats.

#![allow(dead_code)]

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvpool_agent::api::client::EngineClient;
use kvpool_client::master::{ClientConfig, MasterClient};
use kvpool_proto::auth::AuthKey as MasterKey;

pub const KVPOOL: &str = env!("CARGO_BIN_EXE_kvpool");
/// Only a hang ever reaches it; the CI box is a loaded 2-core machine.
pub const DEADLINE: Duration = Duration::from_secs(120);
pub const KEY: &str = "pool-wiring-test-key-0123456789abcdef";

/// Kills the child (if still running) when dropped, so a failing test leaves no process.
pub struct Proc {
    pub name: &'static str,
    pub child: Child,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).expect("pid"));
        nix::sys::signal::kill(pid, sig).expect("signal");
    }

    pub fn assert_running(&mut self, logs: &Path) {
        if let Ok(Some(status)) = self.child.try_wait() {
            let log = std::fs::read_to_string(logs.join(format!("{}.log", self.name)))
                .unwrap_or_default();
            panic!("{} exited early with {status}; log:\n{log}", self.name);
        }
    }
}

pub fn kvpool_bin() -> PathBuf {
    PathBuf::from(KVPOOL)
}

pub fn log_file(dir: &Path, name: &str) -> Stdio {
    Stdio::from(File::create(dir.join(format!("{name}.log"))).expect("log file"))
}

/// Write [`KEY`] to `dir/pool.key` and return its path.
pub fn write_key(dir: &Path) -> PathBuf {
    let key_file = dir.join("pool.key");
    std::fs::write(&key_file, KEY).expect("key file");
    key_file
}

/// The directory `dir/ssd` and the agent config lines of an 8 MiB SSD tier in it (the `extra`
/// of [`start_agent_with`]).
pub fn ssd_tier(dir: &Path) -> (PathBuf, String) {
    let ssd_dir = dir.join("ssd");
    let extra = format!("ssd:\n  path: {}\n  capacity: 8MiB\n", ssd_dir.display());
    (ssd_dir, extra)
}

pub fn start_master(dir: &Path, key_file: &Path) -> (Proc, SocketAddr) {
    let grpc = SocketAddr::from(([127, 0, 0, 1], kvpool_harness::free_port().expect("port")));
    let admin = SocketAddr::from(([127, 0, 0, 1], kvpool_harness::free_port().expect("port")));
    let child = Command::new(kvpool_bin())
        .args(["master", "--listen", &grpc.to_string(), "--admin-addr", &admin.to_string()])
        .arg("--auth-key-file")
        .arg(key_file)
        // Short enough to keep the test quick, long enough for a loaded box: agents beat every
        // 200 ms.
        .args(["--heartbeat-timeout", "5s", "--tick-interval", "100ms"])
        .stdout(Stdio::null())
        .stderr(log_file(dir, "master"))
        .spawn()
        .expect("spawn kvpool master");
    let mut proc = Proc {
        name: "master",
        child,
    };
    assert!(
        kvpool_harness::wait_for_port(grpc, DEADLINE),
        "master never listened on {grpc}"
    );
    proc.assert_running(dir);
    (proc, grpc)
}

/// Where a started agent can be reached.
pub struct AgentAddrs {
    pub admin: SocketAddr,
    pub socket: PathBuf,
}

pub fn start_agent(dir: &Path, name: &'static str, master: SocketAddr, key_file: &Path) -> Proc {
    start_agent_with(dir, name, master, key_file, "8MiB", "").0
}

/// An agent with `dram` of DRAM tier; `extra` is appended to the config (top-level sections
/// after `pool:`'s own lines, e.g. `"  replicas: 2\n"` or an `ssd:` section).
pub fn start_agent_with(
    dir: &Path,
    name: &'static str,
    master: SocketAddr,
    key_file: &Path,
    dram: &str,
    extra: &str,
) -> (Proc, AgentAddrs) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("agent/tests/fixtures/tcp-single");
    let own = dir.join(name);
    std::fs::create_dir_all(&own).expect("agent dir");
    let admin = SocketAddr::from(([127, 0, 0, 1], kvpool_harness::free_port().expect("port")));
    let cfg = format!(
        "node_name: {name}\n\
         discovery:\n  sysfs_root: {}\n  procfs_root: {}\n\
         dram:\n  capacity: {dram}\n  lock: false\n\
         engine_api:\n  socket_dir: {}\n\
         admin:\n  listen: {admin}\n\
         pool:\n  master: [\"{master}\"]\n  auth_key_file: {}\n  transport_listen: 127.0.0.1:0\n  heartbeat_interval: 200ms\n{extra}",
        root.join("sys").display(),
        root.join("proc").display(),
        own.join("run").display(),
        key_file.display(),
    );
    let path = own.join("agent.yaml");
    std::fs::write(&path, cfg).expect("write agent config");
    let child = Command::new(KVPOOL)
        .args(["agent", "run", "--config"])
        .arg(&path)
        .env_remove("KVPOOL_MASTER")
        .env_remove("KVPOOL_AUTH_KEY_FILE")
        .env_remove("POD_IP")
        .stdout(Stdio::null())
        .stderr(log_file(dir, name))
        .spawn()
        .expect("spawn kvpool agent");
    (
        Proc { name, child },
        AgentAddrs {
            admin,
            socket: own.join("run").join("agent.sock"),
        },
    )
}

/// `GET path` on the admin server: (status code, body); None while it does not answer.
pub async fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).await.ok()?;
    let code = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((code, body))
}

/// Wait until the agent's `/readyz` answers 200.
pub async fn wait_ready(agent: &AgentAddrs, proc: &mut Proc, dir: &Path) {
    let started = Instant::now();
    loop {
        proc.assert_running(dir);
        if let Some((200, _)) = http_get(agent.admin, "/readyz").await {
            return;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "{} never became ready",
            proc.name
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The value of the first sample of `metric` whose line contains every one of `labels`.
pub fn metric(text: &str, metric: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.split([' ', '{'])
                .next()
                .is_some_and(|name| name == metric)
        })
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

pub fn master_client(grpc: SocketAddr) -> MasterClient {
    MasterClient::new(
        vec![grpc.to_string()],
        MasterKey::from_bytes(KEY.as_bytes()).expect("master key"),
        ClientConfig::default(),
    )
    .expect("master client")
}

pub async fn engine(agent: &AgentAddrs, name: &str) -> EngineClient {
    EngineClient::connect(&agent.socket, 4 << 20, name)
        .await
        .expect("engine session")
}

/// Poll the master's stats until `done` holds.
pub async fn wait_stats(
    client: &MasterClient,
    what: &str,
    procs: &mut [&mut Proc],
    dir: &Path,
    done: impl Fn(&kvpool_proto::master::StatsResponse) -> bool,
) {
    let started = Instant::now();
    loop {
        for p in procs.iter_mut() {
            p.assert_running(dir);
        }
        if let Ok(s) = client.stats().await
            && done(&s)
        {
            return;
        }
        assert!(started.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Wait for the process to exit (after a signal).
pub fn wait_exit(proc: &mut Proc) {
    let started = Instant::now();
    loop {
        if let Ok(Some(_)) = proc.child.try_wait() {
            return;
        }
        assert!(started.elapsed() < DEADLINE, "{} did not exit", proc.name);
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Poll the agent's metrics until `done` holds for the value of `name{labels}` (0 if absent).
pub async fn wait_metric(
    agent: &AgentAddrs,
    proc: &mut Proc,
    dir: &Path,
    name: &str,
    labels: &[&str],
    done: impl Fn(f64) -> bool,
) -> f64 {
    let started = Instant::now();
    let mut last = None;
    loop {
        proc.assert_running(dir);
        if let Some((200, text)) = http_get(agent.admin, "/metrics").await {
            let v = metric(&text, name, labels).unwrap_or(0.0);
            if done(v) {
                return v;
            }
            last = Some(v);
        }
        if started.elapsed() > DEADLINE {
            let log =
                std::fs::read_to_string(dir.join(format!("{}.log", proc.name))).unwrap_or_default();
            panic!("timed out waiting for {name}{labels:?} (last {last:?}); log:\n{log}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

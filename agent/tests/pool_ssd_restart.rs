//! The pool-mode SSD segment persists across agent restarts, with real processes on
//! 127.0.0.1 (one `kvpool master`, one `kvpool-agent` with a 1 MiB DRAM tier and an 8 MiB SSD
//! segment). Blocks put through the engine API overflow DRAM and are demoted into `ssd0`; once
//! the agent's index is synced the agent is stopped (SIGTERM in one test, SIGKILL in the
//! other), one demoted block is corrupted on disk while it is down, and the agent is started
//! again on the same SSD path. After the remount the master lists every other demoted object
//! with an SSD replica on that node again, the engine API returns each byte-exact, and the
//! corrupted block is dropped at start-up (counted in
//! `kvpool_agent_pool_ssd_blocks_dropped_total{reason="corrupt"}`), never served.
//!
//! Helpers are those of `pool_wiring.rs` (the `kvpool` binary is found or built the same way).

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvpool::master::Tier;
use kvpool::master::auth::AuthKey as MasterKey;
use kvpool::master::client::{ClientConfig, MasterClient};
use kvpool_agent::api::client::EngineClient;
use kvpool_agent::proto::Status;

const AGENT_BIN: &str = env!("CARGO_BIN_EXE_kvpool-agent");
/// Only a hang ever reaches it; the CI box is a loaded 2-core machine.
const DEADLINE: Duration = Duration::from_secs(60);
const KEY: &str = "pool-ssd-restart-test-key-0123456789ab";

/// Kills the child (if still running) when dropped, so a failing test leaves no process.
struct Proc {
    name: &'static str,
    child: Child,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    fn signal(&self, sig: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).expect("pid"));
        nix::sys::signal::kill(pid, sig).expect("signal");
    }

    fn assert_running(&mut self, logs: &Path) {
        if let Ok(Some(status)) = self.child.try_wait() {
            let log = std::fs::read_to_string(logs.join(format!("{}.log", self.name)))
                .unwrap_or_default();
            panic!("{} exited early with {status}; log:\n{log}", self.name);
        }
    }
}

fn kvpool_bin() -> PathBuf {
    let agent = PathBuf::from(AGENT_BIN);
    let dir = agent.parent().expect("agent binary has a directory");
    let bin = dir.join("kvpool");
    if bin.exists() {
        return bin;
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "-p", "kvpool", "--bin", "kvpool"])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .status()
        .expect("running cargo build for the kvpool binary");
    assert!(status.success(), "building the kvpool binary failed");
    assert!(bin.exists(), "kvpool binary not found at {}", bin.display());
    bin
}

fn log_file(dir: &Path, name: &str) -> Stdio {
    Stdio::from(File::create(dir.join(format!("{name}.log"))).expect("log file"))
}

fn start_master(dir: &Path, key_file: &Path) -> (Proc, SocketAddr) {
    let grpc = SocketAddr::from((
        [127, 0, 0, 1],
        kvpool::master::testing::free_port().expect("port"),
    ));
    let admin = SocketAddr::from((
        [127, 0, 0, 1],
        kvpool::master::testing::free_port().expect("port"),
    ));
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
        kvpool::master::testing::wait_for_port(grpc, DEADLINE),
        "master never listened on {grpc}"
    );
    proc.assert_running(dir);
    (proc, grpc)
}

/// Where a started agent can be reached.
struct AgentAddrs {
    admin: SocketAddr,
    socket: PathBuf,
}

/// An agent with `dram` of DRAM tier; `extra` is appended to the config (top-level sections
/// after `pool:`'s own lines, e.g. `"  replicas: 2\n"` or an `ssd:` section).
fn start_agent_with(
    dir: &Path,
    name: &'static str,
    master: SocketAddr,
    key_file: &Path,
    dram: &str,
    extra: &str,
) -> (Proc, AgentAddrs) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tcp-single");
    let own = dir.join(name);
    std::fs::create_dir_all(&own).expect("agent dir");
    let admin = SocketAddr::from((
        [127, 0, 0, 1],
        kvpool::master::testing::free_port().expect("port"),
    ));
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
    let child = Command::new(AGENT_BIN)
        .args(["run", "--config"])
        .arg(&path)
        .env_remove("KVPOOL_MASTER")
        .env_remove("KVPOOL_AUTH_KEY_FILE")
        .env_remove("POD_IP")
        .stdout(Stdio::null())
        .stderr(log_file(dir, name))
        .spawn()
        .expect("spawn kvpool-agent");
    (
        Proc { name, child },
        AgentAddrs {
            admin,
            socket: own.join("run").join("agent.sock"),
        },
    )
}

/// `GET path` on the admin server: (status code, body); None while it does not answer.
async fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
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
async fn wait_ready(agent: &AgentAddrs, proc: &mut Proc, dir: &Path) {
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
fn metric(text: &str, metric: &str, labels: &[&str]) -> Option<f64> {
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

fn master_client(grpc: SocketAddr) -> MasterClient {
    MasterClient::new(
        vec![grpc.to_string()],
        MasterKey::from_bytes(KEY.as_bytes()).expect("master key"),
        ClientConfig::default(),
    )
    .expect("master client")
}

async fn engine(agent: &AgentAddrs, name: &str) -> EngineClient {
    EngineClient::connect(&agent.socket, 4 << 20, name)
        .await
        .expect("engine session")
}

/// Poll the master's stats until `done` holds.
async fn wait_stats(
    client: &MasterClient,
    what: &str,
    procs: &mut [&mut Proc],
    dir: &Path,
    done: impl Fn(&kvpool::master::proto::StatsResponse) -> bool,
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

fn block(i: usize) -> Vec<u8> {
    (0..100 * 1024 + i)
        .map(|j: usize| (j.wrapping_mul(13) ^ i.wrapping_mul(101)) as u8)
        .collect()
}

/// Wait for the process to exit (after a signal).
fn wait_exit(proc: &mut Proc) {
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
async fn wait_metric(
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

async fn restart_keeps_demoted_blocks(sig: nix::sys::signal::Signal) {
    let dir = tempfile::tempdir().expect("tempdir");
    let logs = dir.path();
    let key_file = dir.path().join("pool.key");
    std::fs::write(&key_file, KEY).expect("key file");
    let (mut master, grpc) = start_master(logs, &key_file);
    let ssd_dir = dir.path().join("ssd");
    let extra = format!("ssd:\n  path: {}\n  capacity: 8MiB\n", ssd_dir.display());
    let (mut a, addr_a) = start_agent_with(logs, "agent-a", grpc, &key_file, "1MiB", &extra);
    let client = master_client(grpc);
    wait_ready(&addr_a, &mut a, logs).await;

    // 16 blocks of ~100 KiB into 1 MiB of DRAM: most are demoted to the SSD segment.
    let mut engine_a = engine(&addr_a, "engine-a").await;
    let keys: Vec<Vec<u8>> = (0..16)
        .map(|i| format!("persist-block-{i}").into_bytes())
        .collect();
    for (i, key) in keys.iter().enumerate() {
        assert_eq!(
            engine_a.put(key, &block(i)).await.expect("put"),
            Status::Ok,
            "put {i}"
        );
    }
    drop(engine_a);
    wait_stats(
        &client,
        "demotions done",
        &mut [&mut master, &mut a],
        logs,
        |s| s.tasks == 0 && s.used_bytes.get(1).copied().unwrap_or(0) > 0,
    )
    .await;
    // (index in `keys`, offset in ssd0) of every block with an SSD replica.
    let mut on_ssd: Vec<(usize, u64)> = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let located = client.get(key).await.expect("locate");
        if let Some(r) = located
            .replicas
            .iter()
            .find(|r| r.tier == Tier::Ssd && r.segment == "ssd0")
        {
            assert_eq!(r.node, "agent-a");
            on_ssd.push((i, r.offset));
        }
        client
            .release_lease(located.lease_id)
            .await
            .expect("release");
    }
    assert!(on_ssd.len() >= 2, "blocks were demoted: {on_ssd:?}");
    let n = on_ssd.len() as f64;
    // The index holds every demoted block durably before the agent goes down.
    wait_metric(
        &addr_a,
        &mut a,
        logs,
        "kvpool_agent_pool_ssd_index_blocks",
        &[],
        |v| v >= n,
    )
    .await;

    a.signal(sig);
    wait_exit(&mut a);
    drop(a);

    // Corrupt the first demoted block on disk while the agent is down.
    let (bad, bad_offset) = on_ssd[0];
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(ssd_dir.join("pool-ssd.dat"))
            .expect("data file");
        let mut byte = [0u8; 1];
        f.read_exact_at(&mut byte, bad_offset + 100).expect("read");
        f.write_all_at(&[byte[0] ^ 0x5a], bad_offset + 100)
            .expect("corrupt");
    }

    let (mut a, addr_a) = start_agent_with(logs, "agent-a", grpc, &key_file, "1MiB", &extra);
    wait_ready(&addr_a, &mut a, logs).await;
    let adopted = wait_metric(
        &addr_a,
        &mut a,
        logs,
        "kvpool_agent_pool_ssd_blocks_adopted_total",
        &[],
        |v| v >= n - 1.0,
    )
    .await;
    assert_eq!(adopted, n - 1.0, "every intact block adopted");
    let (_, text) = http_get(addr_a.admin, "/metrics").await.expect("metrics");
    assert_eq!(
        metric(
            &text,
            "kvpool_agent_pool_ssd_blocks_dropped_total",
            &["reason=\"corrupt\""],
        ),
        Some(1.0),
        "the corrupted block is dropped and counted:\n{text}"
    );

    let mut engine_a = engine(&addr_a, "engine-a2").await;
    for &(i, offset) in &on_ssd {
        let key = &keys[i];
        if i == bad {
            assert!(
                !client.exists(&[key.as_slice()]).await.expect("exists")[0],
                "the corrupted block is not announced"
            );
            assert!(
                engine_a.get(key).await.expect("get").is_none(),
                "the corrupted block is never served"
            );
            continue;
        }
        let located = client.get(key).await.expect("locate after restart");
        let r = located
            .replicas
            .iter()
            .find(|r| r.tier == Tier::Ssd)
            .expect("an SSD replica again");
        assert_eq!((r.node.as_str(), r.segment.as_str()), ("agent-a", "ssd0"));
        assert_eq!(r.offset, offset, "adopted where it was written");
        client
            .release_lease(located.lease_id)
            .await
            .expect("release");
        let got = engine_a.get(key).await.expect("get").expect("present");
        assert!(got == block(i), "object {i} differs after the restart");
    }
    // A clean shutdown still works after the adoption.
    a.signal(nix::sys::signal::Signal::SIGTERM);
    wait_exit(&mut a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demoted_blocks_survive_a_sigterm_restart() {
    restart_keeps_demoted_blocks(nix::sys::signal::Signal::SIGTERM).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demoted_blocks_survive_a_sigkill_after_the_index_sync() {
    restart_keeps_demoted_blocks(nix::sys::signal::Signal::SIGKILL).await;
}

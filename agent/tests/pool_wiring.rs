//! A real pool across processes on 127.0.0.1: one `kvpool master` and two `kvpool-agent`s in
//! pool mode (shared key file, random ports, temp dirs). The test, as a client with its own
//! transfer engine, puts values with two replicas (master allocates, the engine WRITEs to both
//! agents, master commits), reads them back (master locates, the engine READs) and checks every
//! byte; then SIGKILLs one agent and, once the master has declared it dead, reads every value
//! again from the survivor. Finally SIGTERM on the survivor must unmount its segment.
//!
//! The `kvpool` binary belongs to the root package, which an agent-crate test cannot name with
//! `CARGO_BIN_EXE_*`. It is looked up next to the agent binary in the same target directory (a
//! workspace test run builds every binary there); when it is missing (e.g. `cargo test -p
//! kvpool-agent`) the test builds it with the cargo that runs the test.

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool::master::auth::AuthKey as MasterKey;
use kvpool::master::client::{ClientConfig, MasterClient};
use kvpool::master::data::PoolClient;
use kvpool::master::{PutOptions, Tier};
use kvpool::transfer::{AuthKey, EngineConfig, StaticDirectory, TransferEngine, TransferMetrics};

const AGENT_BIN: &str = env!("CARGO_BIN_EXE_kvpool-agent");
/// Only a hang ever reaches it; the CI box is a loaded 2-core machine.
const DEADLINE: Duration = Duration::from_secs(120);
const KEY: &str = "pool-wiring-test-key-0123456789abcdef";
const OBJECTS: usize = 12;

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

fn start_agent(dir: &Path, name: &'static str, master: SocketAddr, key_file: &Path) -> Proc {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tcp-single");
    let own = dir.join(name);
    std::fs::create_dir_all(&own).expect("agent dir");
    let cfg = format!(
        "node_name: {name}\n\
         discovery:\n  sysfs_root: {}\n  procfs_root: {}\n\
         dram:\n  capacity: 8MiB\n  lock: false\n\
         engine_api:\n  socket_dir: {}\n\
         admin:\n  listen: 127.0.0.1:0\n\
         pool:\n  master: [\"{master}\"]\n  auth_key_file: {}\n  transport_listen: 127.0.0.1:0\n  heartbeat_interval: 200ms\n",
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
    Proc { name, child }
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

fn value(i: usize) -> Vec<u8> {
    // Sizes from 1 byte to a few slices' worth, content distinct per object.
    let len = [1, 4095, 4096, 70_000, 300_000][i % 5] + i;
    (0..len)
        .map(|j| (j.wrapping_mul(31) ^ i.wrapping_mul(7)) as u8)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_survive_the_death_of_one_replica_holder() {
    let dir = tempfile::tempdir().expect("tempdir");
    let logs = dir.path();
    let key_file = dir.path().join("pool.key");
    std::fs::write(&key_file, KEY).expect("key file");

    let (mut master, grpc) = start_master(logs, &key_file);
    let mut a = start_agent(logs, "agent-a", grpc, &key_file);
    let mut b = start_agent(logs, "agent-b", grpc, &key_file);

    let client = MasterClient::new(
        vec![grpc.to_string()],
        MasterKey::from_bytes(KEY.as_bytes()).expect("master key"),
        ClientConfig::default(),
    )
    .expect("master client");
    wait_stats(
        &client,
        "both agents mounted",
        &mut [&mut master, &mut a, &mut b],
        logs,
        |s| s.nodes_alive == 2 && s.segments >= 2,
    )
    .await;

    let engine = TransferEngine::new(
        EngineConfig {
            node: "test-client".into(),
            ..EngineConfig::default()
        },
        AuthKey::new(KEY.as_bytes().to_vec()).expect("transfer key"),
        Arc::new(StaticDirectory::new()),
        TransferMetrics::unregistered().expect("metrics"),
    )
    .expect("engine");
    let pool = PoolClient::new(client.clone(), engine, "test-client".into(), None);
    let opts = PutOptions {
        replicas: 2,
        ..PutOptions::default()
    };

    let keys: Vec<Vec<u8>> = (0..OBJECTS)
        .map(|i| format!("block-{i}").into_bytes())
        .collect();
    for (i, key) in keys.iter().enumerate() {
        let replicas = pool.put(key, &value(i), &opts).await.expect("put");
        let mut nodes: Vec<_> = replicas.iter().map(|r| r.node.clone()).collect();
        nodes.sort();
        assert_eq!(nodes, ["agent-a", "agent-b"], "one replica per agent");
        assert!(replicas.iter().all(|r| r.tier == Tier::Dram));
    }
    for (i, key) in keys.iter().enumerate() {
        let got = pool.get(key).await.expect("get");
        let want = value(i);
        assert_eq!(got.len(), want.len());
        assert_eq!(crc32c::crc32c(&got), crc32c::crc32c(&want), "object {i}");
        assert!(got == want, "object {i} differs");
    }

    // One replica holder dies without a word.
    a.signal(nix::sys::signal::Signal::SIGKILL);
    let _ = a.child.wait();
    wait_stats(
        &client,
        "the master to declare agent-a dead",
        &mut [&mut master, &mut b],
        logs,
        |s| s.nodes_alive == 1,
    )
    .await;
    for (i, key) in keys.iter().enumerate() {
        let located = client.get(key).await.expect("locate after death");
        assert!(
            located.replicas.iter().all(|r| r.node == "agent-b"),
            "object {i}: the dead node's replica is no longer handed out"
        );
        assert!(!located.replicas.is_empty(), "object {i} lost");
        client
            .release_lease(located.lease_id)
            .await
            .expect("release");
        let got = pool.get(key).await.expect("get from the survivor");
        let want = value(i);
        assert_eq!(crc32c::crc32c(&got), crc32c::crc32c(&want), "object {i}");
        assert!(got == want, "object {i} differs after the death of agent-a");
    }

    // A clean stop unmounts: the master is left with no segment.
    b.signal(nix::sys::signal::Signal::SIGTERM);
    let started = Instant::now();
    let status = loop {
        if let Some(s) = b.child.try_wait().expect("wait") {
            break s;
        }
        assert!(started.elapsed() < DEADLINE, "agent-b ignored SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "agent-b exited with {status}");
    wait_stats(
        &client,
        "agent-b's segments unmounted",
        &mut [&mut master],
        logs,
        |s| s.segments == 0,
    )
    .await;
}

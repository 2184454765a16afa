//! Helpers shared by the root tests that run a real `kvpool master` and real `kvpool-agent`
//! processes on 127.0.0.1 (master_kill_under_load.rs, master_striping.rs): spawn them with logs
//! in the test's directory, kill them when a test fails, and poll the master's stats; and the
//! flags of an in-process master (master_service.rs, master_coalescing.rs).

#![allow(dead_code)]

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvpool_client::master::{ClientConfig, MasterClient};
use kvpool_harness::{free_port, wait_for_port};
use kvpool_master::cmd::{MasterArgs, RunningMaster, start};
use kvpool_proto::auth::AuthKey as MasterKey;
use kvpool_proto::master::StatsResponse;
use tokio_util::sync::CancellationToken;

pub const KVPOOL: &str = env!("CARGO_BIN_EXE_kvpool");
/// Only a hang reaches it on a loaded 2-core box.
pub const DEADLINE: Duration = Duration::from_secs(180);

pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    pub fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            panic!("{} exited early with {status}; log:\n{log}", self.name);
        }
    }
}

pub fn spawn(dir: &Path, name: &str, cmd: &mut Command) -> Proc {
    let log = dir.join(format!("{name}.log"));
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(File::create(&log).expect("log file")))
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
    Proc {
        name: name.into(),
        child,
        log,
    }
}

pub fn start_master(dir: &Path, key_file: &Path) -> (Proc, SocketAddr) {
    let grpc = SocketAddr::from(([127, 0, 0, 1], free_port().expect("port")));
    let admin = SocketAddr::from(([127, 0, 0, 1], free_port().expect("port")));
    let mut p = spawn(
        dir,
        "master",
        Command::new(KVPOOL)
            .args(["master", "--listen", &grpc.to_string()])
            .args(["--admin-addr", &admin.to_string()])
            .arg("--auth-key-file")
            .arg(key_file)
            .args(["--heartbeat-timeout", "3s", "--tick-interval", "100ms"]),
    );
    assert!(wait_for_port(grpc, DEADLINE), "master never listened");
    p.assert_running();
    (p, grpc)
}

pub fn start_agent(dir: &Path, name: &str, master: SocketAddr, key_file: &Path) -> Proc {
    // A fixture machine description (one NUMA node, plenty of free memory) keeps the test
    // independent of the host's free memory; the DRAM itself is real.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("agent/tests/fixtures/tcp-single");
    let own = dir.join(name);
    std::fs::create_dir_all(own.join("run")).expect("agent dir");
    let cfg = format!(
        "node_name: {name}\n\
         discovery:\n  sysfs_root: {}\n  procfs_root: {}\n\
         dram:\n  capacity: 64MiB\n  lock: false\n\
         engine_api:\n  socket_dir: {run}\n  shm_dir: {run}\n\
         admin:\n  listen: 127.0.0.1:0\n\
         pool:\n  master: [\"{master}\"]\n  auth_key_file: {}\n  transport_listen: 127.0.0.1:0\n  heartbeat_interval: 200ms\n",
        root.join("sys").display(),
        root.join("proc").display(),
        key_file.display(),
        run = own.join("run").display(),
    );
    let path = own.join("agent.yaml");
    std::fs::write(&path, cfg).expect("agent config");
    spawn(
        dir,
        name,
        Command::new(KVPOOL)
            .args(["agent", "run", "--config"])
            .arg(&path)
            .env_remove("KVPOOL_MASTER")
            .env_remove("KVPOOL_AUTH_KEY_FILE")
            .env_remove("POD_IP"),
    )
}

pub async fn wait_stats(
    client: &MasterClient,
    what: &str,
    procs: &mut [&mut Proc],
    done: impl Fn(&StatsResponse) -> bool,
) -> StatsResponse {
    let started = Instant::now();
    loop {
        for p in procs.iter_mut() {
            p.assert_running();
        }
        if let Ok(s) = client.stats().await
            && done(&s)
        {
            return s;
        }
        assert!(started.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An in-process master with its key file in a temporary directory and a client of it.
pub struct InProcessMaster {
    pub _dir: tempfile::TempDir,
    pub master: RunningMaster,
    pub shutdown: CancellationToken,
    pub client: MasterClient,
}

/// Start a master with [`kvpool_master::cmd::loopback_args`] changed by `tweak`, keyed with `key`.
pub async fn in_process_master(key: &[u8], tweak: impl FnOnce(&mut MasterArgs)) -> InProcessMaster {
    let dir = tempfile::tempdir().expect("tmp");
    let key_file = dir.path().join("key");
    std::fs::write(&key_file, key).expect("key");
    let mut a = kvpool_master::cmd::loopback_args(key_file);
    tweak(&mut a);
    let shutdown = CancellationToken::new();
    let master = start(a.validate().expect("valid"), shutdown.clone())
        .await
        .expect("start master");
    let client = MasterClient::new(
        vec![master.grpc_addr.to_string()],
        MasterKey::from_bytes(key).expect("master key"),
        ClientConfig::default(),
    )
    .expect("client");
    InProcessMaster {
        _dir: dir,
        master,
        shutdown,
        client,
    }
}

/// A plain HTTP/1.1 GET on `addr` (admin endpoints); the whole response, headers included.
pub async fn http_get(addr: SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read");
    out
}

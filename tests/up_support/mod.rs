//! Helpers shared by the tests that run the node agent as a child process (synthetic engine
//! with KV blocks, `kvpool up`): find the `kvpool-agent` binary, write an agent config, and kill
//! children that a failing test leaves behind.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command};

/// The one-NUMA-node, no-RDMA sysfs fixture of the agent's tests.
pub fn sysfs_fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("agent/tests/fixtures/tcp-single")
}

/// Starts a local-only agent with a small DRAM tier in `dir`; returns it and its socket path
/// once the socket accepts connections.
pub fn start_local_agent(dir: &Path) -> (Reap, PathBuf) {
    let root = sysfs_fixture();
    let run = dir.join("run");
    let cfg = format!(
        "node_name: test-node\n\
         discovery:\n  sysfs_root: {}\n  procfs_root: {}\n\
         dram:\n  capacity: 16MiB\n  lock: false\n\
         engine_api:\n  socket_dir: {}\n\
         admin:\n  listen: 127.0.0.1:0\n",
        root.join("sys").display(),
        root.join("proc").display(),
        run.display(),
    );
    let path = dir.join("agent.yaml");
    std::fs::write(&path, cfg).expect("write agent config");
    let log = std::fs::File::create(dir.join("agent.log")).expect("agent log");
    let mut child = Reap(
        Command::new(env!("CARGO_BIN_EXE_kvpool"))
            .args(["agent", "run", "--config"])
            .arg(&path)
            .env_remove("KVPOOL_MASTER")
            .env_remove("KVPOOL_AUTH_KEY_FILE")
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn kvpool agent"),
    );
    let socket = run.join("agent.sock");
    // Bounded wait: only a hang reaches the end on a loaded box.
    for _ in 0..1200 {
        if std::os::unix::net::UnixStream::connect(&socket).is_ok() {
            return (child, socket);
        }
        if let Ok(Some(status)) = child.0.try_wait() {
            let log = std::fs::read_to_string(dir.join("agent.log")).unwrap_or_default();
            panic!("kvpool-agent exited with {status}: {log}");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("kvpool-agent never opened {}", socket.display());
}

/// Kills the child if the test fails before it exits on its own.
pub struct Reap(pub Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Whether a process with this id still exists (and is not a zombie).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

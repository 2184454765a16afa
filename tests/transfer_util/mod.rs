//! Helpers shared by the transfer engine's multi-process tests: a `kvpool bench transfer
//! --mode target` child process (through the process harness) and an initiator engine talking
//! to it; and for any test with an engine, a read of the head of a remote segment.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use kvpool_harness::{ChildProcess, Launcher};
use kvpool_transfer::*;

pub const KEY: &str = "multi-process-test-key-0123456789";
pub const MIB: u64 = 1024 * 1024;

/// A target child process (logging into `target.log` next to its shm socket); killed (and
/// reaped) on drop.
pub struct TargetProcess {
    pub process: ChildProcess,
    pub tcp: SocketAddr,
    pub shm: PathBuf,
    pub segment: String,
    pub size: u64,
}

impl TargetProcess {
    /// Start `[prefix..] kvpool bench transfer --mode target ...` and read its address line.
    pub fn spawn(prefix: &[&str], listen: &str, shm: &std::path::Path) -> TargetProcess {
        Self::try_spawn(prefix, listen, shm).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Like [`TargetProcess::spawn`], but reports a target that did not come up as an error.
    pub fn try_spawn(
        prefix: &[&str],
        listen: &str,
        shm: &std::path::Path,
    ) -> Result<TargetProcess, String> {
        let exe = env!("CARGO_BIN_EXE_kvpool");
        let mut cmd = if let Some((first, rest)) = prefix.split_first() {
            let mut c = Command::new(first);
            c.args(rest).arg(exe);
            c
        } else {
            Command::new(exe)
        };
        cmd.args([
            "bench",
            "transfer",
            "--mode",
            "target",
            "--buffer_size",
            "64MiB",
        ])
        .args(["--listen", listen, "--shm_path"])
        .arg(shm)
        .env("KVPOOL_AUTH_KEY", KEY)
        .env_remove("KVPOOL_AUTH_KEY_FILE");
        let logs = shm.parent().unwrap_or(std::path::Path::new("."));
        let mut process = Launcher::new(logs)
            .pipe_stdout()
            .spawn("target", &mut cmd)
            .map_err(|e| format!("cannot spawn the target: {e}"))?;
        let stdout = process.take_stdout().expect("stdout");
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let field = |k: &str| {
            line.split_whitespace()
                .find_map(|f| f.strip_prefix(&format!("{k}=")))
                .map(str::to_owned)
                .ok_or_else(|| {
                    format!(
                        "target did not start: no {k}= in its first line {line:?}; its log:\n{}",
                        process.log_text()
                    )
                })
        };
        let (tcp, shm, segment, size) = (|| {
            Ok::<_, String>((
                field("tcp")?
                    .parse()
                    .map_err(|e| format!("bad tcp address: {e}"))?,
                PathBuf::from(field("shm")?),
                field("segment")?,
                field("size")?
                    .parse()
                    .map_err(|e| format!("bad size: {e}"))?,
            ))
        })()?;
        Ok(TargetProcess {
            process,
            tcp,
            shm,
            segment,
            size,
        })
    }

    pub fn descriptor(&self, node: &str) -> SegmentDescriptor {
        SegmentDescriptor {
            name: self.segment.clone(),
            node: node.into(),
            size: self.size,
            numa_node: None,
            memory: MemoryKind::Host,
            gpu_device: None,
            endpoints: vec![Endpoint::Tcp(self.tcp), Endpoint::Shm(self.shm.clone())],
            nics: vec![],
        }
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        self.process.signal(sig).expect("signal the target");
    }

    /// SIGSTOP the target and wait until the kernel reports it stopped (state `T` in
    /// `/proc/<pid>/stat`): from then on it answers nothing.
    pub fn freeze(&self) {
        self.signal(nix::sys::signal::Signal::SIGSTOP);
        let stat = format!("/proc/{}/stat", self.process.id());
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let state = std::fs::read_to_string(&stat).unwrap_or_default();
            // The state follows the command name, which is in parentheses.
            let stopped = state
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('T'));
            if stopped {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "target never stopped: {state}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// An initiator engine with a registered 64 MiB local buffer.
pub fn initiator(timeout: Duration) -> (TransferEngine, LocalSegment) {
    let engine = TransferEngine::new(
        EngineConfig {
            node: "bench".into(),
            lanes: 2,
            slice_size: MIB,
            window: 4,
            timeout,
            connect_timeout: timeout,
            ..EngineConfig::default()
        },
        AuthKey::new(KEY.as_bytes()).unwrap(),
        Arc::new(StaticDirectory::new()),
        TransferMetrics::unregistered().unwrap(),
    )
    .unwrap();
    let local = engine
        .register(
            "initiator/buf",
            Arc::new(Segment::host(64 * MIB as usize, HostOptions::default()).unwrap()),
        )
        .unwrap();
    (engine, local)
}

pub fn requests(
    local: &LocalSegment,
    remote: &RemoteSegment,
    op: TransferOp,
    count: u64,
    len: u64,
) -> Vec<TransferRequest> {
    (0..count)
        .map(|i| TransferRequest {
            op,
            local: local.clone(),
            local_offset: (i * len) % (64 * MIB - len + 1),
            remote: remote.clone(),
            remote_offset: (i * len) % (64 * MIB - len + 1),
            len,
        })
        .collect()
}

/// Write a pattern to the target and read it back into another place: proves the path works.
pub fn round_trip(engine: &TransferEngine, local: &LocalSegment, remote: &RemoteSegment, seed: u8) {
    let data: Vec<u8> = (0..3 * MIB as usize + 7)
        .map(|i| (i as u8) ^ seed)
        .collect();
    local.segment().write_at(0, &data).unwrap();
    let mk = |op, lo| TransferRequest {
        op,
        local: local.clone(),
        local_offset: lo,
        remote: remote.clone(),
        remote_offset: 1000,
        len: data.len() as u64,
    };
    engine.transfer(vec![mk(TransferOp::Write, 0)]).unwrap();
    engine
        .transfer(vec![mk(TransferOp::Read, 32 * MIB)])
        .unwrap();
    let mut back = vec![0u8; data.len()];
    local.segment().read_at(32 * MIB, &mut back).unwrap();
    assert!(back == data, "bytes differ after a round trip");
}

/// Wait (bounded) until `f` holds; the bound only guards against hangs.
pub fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..600 {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting for {what}");
}

/// After a fault: retry a small read until the engine has reconnected (failed connects are held
/// off for a moment, and a resumed peer first drains its backlog), then check a full round trip.
pub fn recover(engine: &TransferEngine, local: &LocalSegment, remote: &RemoteSegment, seed: u8) {
    let mut last = None;
    for _ in 0..100 {
        match engine.transfer(requests(local, remote, TransferOp::Read, 1, 4096)) {
            Ok(()) => {
                round_trip(engine, local, remote, seed);
                return;
            }
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    panic!("transfers did not recover: {last:?}");
}

/// Reads the first `len` bytes (at most 4 KiB) of segment `name` through `client`, into a
/// fresh 4 KiB buffer `buf` registered with it; any failure as its text.
pub fn read_head(client: &TransferEngine, name: &str, len: u64) -> Result<Vec<u8>, String> {
    let text = |e: &dyn std::fmt::Display| e.to_string();
    let buf = Segment::host(4096, HostOptions::default()).map_err(|e| text(&e))?;
    let local = client
        .register("buf", Arc::new(buf))
        .map_err(|e| text(&e))?;
    let remote = client.open(name).map_err(|e| text(&e))?;
    client
        .transfer(vec![TransferRequest {
            op: TransferOp::Read,
            local: local.clone(),
            local_offset: 0,
            remote,
            remote_offset: 0,
            len,
        }])
        .map_err(|e| text(&e))?;
    let mut got = vec![0u8; len as usize];
    local.segment().read_at(0, &mut got).map_err(|e| text(&e))?;
    Ok(got)
}

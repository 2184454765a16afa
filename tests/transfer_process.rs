//! Transfer engine across two processes: a `kvpool bench transfer --mode target` child serves a
//! memfd segment; this process transfers over TCP and over shared memory, then the child is
//! frozen (SIGSTOP) or killed (SIGKILL) mid-transfer and every pending request must fail with a
//! clear error instead of hanging.

#![allow(clippy::unwrap_used)]

mod transfer_util;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool_transfer::*;
use nix::sys::signal::Signal;
use transfer_util::*;

fn assert_settled_with_failures(batch: &Batch, allowed: &[&str]) -> usize {
    let st = batch
        .wait(Duration::from_secs(120))
        .expect("batch must settle");
    let mut failed = 0;
    for s in &st {
        match s {
            RequestStatus::Done => {}
            RequestStatus::Failed(f) => {
                failed += 1;
                assert!(allowed.contains(&f.category), "unexpected failure {f}");
                assert!(!f.reason.is_empty());
            }
            RequestStatus::Pending => panic!("request still pending after wait"),
        }
    }
    failed
}

/// A target process on 127.0.0.1 with its shared-memory socket in a fresh temporary directory
/// (returned with it, to keep).
fn loopback_target() -> (tempfile::TempDir, TargetProcess) {
    let dir = tempfile::tempdir().unwrap();
    let target = TargetProcess::spawn(&[], "127.0.0.1:0", &dir.path().join("t.sock"));
    (dir, target)
}

/// The target's segment `x`, opened over TCP.
fn open_tcp(engine: &TransferEngine, target: &TargetProcess) -> RemoteSegment {
    engine
        .open_descriptor(&target.descriptor("x"), Some(Protocol::Tcp))
        .expect("open over TCP")
}

/// 256 x 1 MiB reads submitted from another thread, once the first has completed: `submit` is
/// still queueing then (the lanes apply backpressure), so a signal sent now lands mid-batch.
fn reads_under_way(
    engine: &TransferEngine,
    local: &LocalSegment,
    remote: &RemoteSegment,
) -> std::thread::JoinHandle<Batch> {
    let submitter =
        submit_in_background(engine, requests(local, remote, TransferOp::Read, 256, MIB));
    eventually("first completed request", || {
        engine
            .metrics()
            .bytes
            .with_label_values(&["tcp", "read"])
            .get()
            > 0
    });
    submitter
}

fn submit_in_background(
    engine: &TransferEngine,
    reqs: Vec<TransferRequest>,
) -> std::thread::JoinHandle<Batch> {
    let engine = engine.clone();
    std::thread::spawn(move || engine.submit(reqs).unwrap())
}

#[test]
fn transfer_two_processes_over_tcp_and_shared_memory() {
    let (_dir, target) = loopback_target();
    let (engine, local) = initiator(Duration::from_secs(5));
    let tcp = engine
        .open_descriptor(&target.descriptor("bench"), Some(Protocol::Tcp))
        .unwrap();
    round_trip(&engine, &local, &tcp, 1);
    let shm = engine
        .open_descriptor(&target.descriptor("bench"), Some(Protocol::Shm))
        .unwrap();
    assert_eq!(shm.protocol(), Protocol::Shm);
    // What was written over shared memory is visible over TCP: same pages in the target.
    round_trip(&engine, &local, &shm, 2);
    let mut via_tcp = vec![0u8; 4096];
    engine
        .transfer(vec![TransferRequest {
            op: TransferOp::Read,
            local: local.clone(),
            local_offset: 48 * MIB,
            remote: tcp.clone(),
            remote_offset: 1000,
            len: 4096,
        }])
        .unwrap();
    local.segment().read_at(48 * MIB, &mut via_tcp).unwrap();
    let expect: Vec<u8> = (0..4096).map(|i| (i as u8) ^ 2).collect();
    assert_eq!(via_tcp, expect);
    // Same node by name: `open` through a directory picks shared memory by itself.
    let by_name = TransferEngine::new(
        EngineConfig {
            node: "bench".into(),
            ..EngineConfig::default()
        },
        AuthKey::new(KEY.as_bytes()).unwrap(),
        Arc::new(
            [target.descriptor("bench")]
                .into_iter()
                .collect::<StaticDirectory>(),
        ),
        TransferMetrics::unregistered().unwrap(),
    )
    .unwrap();
    assert_eq!(
        by_name.open(&target.segment).unwrap().protocol(),
        Protocol::Shm
    );
}

#[test]
fn transfer_peer_killed_mid_transfer_fails_pending_requests() {
    let (_dir, target) = loopback_target();
    let (engine, local) = initiator(Duration::from_secs(2));
    let remote = open_tcp(&engine, &target);
    let baseline = Arc::strong_count(local.segment());
    let submitter = reads_under_way(&engine, &local, &remote);
    target.signal(Signal::SIGKILL);
    let batch = submitter.join().unwrap();
    let t0 = Instant::now();
    let failed = assert_settled_with_failures(
        &batch,
        &[
            "peer_closed",
            "io",
            "lane_closed",
            "timeout",
            "connect",
            "handshake",
        ],
    );
    eprintln!(
        "settled {failed} failures {:?} after the kill",
        t0.elapsed()
    );
    assert!(failed > 0, "the kill landed after the whole batch finished");
    // Nothing leaks: no open connection and no transfer holding our memory.
    eventually("lanes closed", || engine.metrics().connections.get() == 0);
    eventually("segment references released", || {
        Arc::strong_count(local.segment()) == baseline
    });
    // New work fails fast with a connection error.
    let batch = engine
        .submit(requests(&local, &remote, TransferOp::Write, 2, 4096))
        .unwrap();
    assert_eq!(
        assert_settled_with_failures(&batch, &["connect", "handshake"]),
        2
    );
}

#[test]
fn transfer_frozen_peer_times_out_within_the_configured_timeout() {
    let (_dir, target) = loopback_target();
    let (engine, local) = initiator(Duration::from_secs(2));
    let remote = open_tcp(&engine, &target);
    let submitter = reads_under_way(&engine, &local, &remote);
    // A frozen process keeps its sockets open but never answers: only the timeout can help.
    target.freeze();
    // Reads submitted once the target is stopped cannot complete, however many of the first
    // batch finished before the freeze (on a fast machine, all of them may have).
    let after = engine
        .submit(requests(&local, &remote, TransferOp::Read, 16, MIB))
        .unwrap();
    let allowed = ["timeout", "lane_closed", "handshake"];
    let batch = submitter.join().unwrap();
    assert_settled_with_failures(&batch, &allowed);
    assert_eq!(assert_settled_with_failures(&after, &allowed), 16);
    assert!(
        engine
            .metrics()
            .failures
            .with_label_values(&["tcp", "timeout"])
            .get()
            > 0
    );
    target.signal(Signal::SIGCONT);
    // After the peer recovers, the engine reconnects and works again.
    recover(&engine, &local, &remote, 3);
}

#[test]
fn transfer_bench_initiator_cli_drives_a_target_process() {
    let (_dir, target) = loopback_target();
    for (protocol, extra) in [("tcp", "--target_addr"), ("shm", "--shm_path")] {
        let endpoint = if protocol == "tcp" {
            target.tcp.to_string()
        } else {
            target.shm.display().to_string()
        };
        let v = kvpool_harness::output_json(
            std::process::Command::new(env!("CARGO_BIN_EXE_kvpool"))
                .args([
                    "bench",
                    "transfer",
                    "--mode",
                    "initiator",
                    "--protocol",
                    protocol,
                ])
                .args([extra, &endpoint, "--segment_id", &target.segment])
                .args([
                    "--operation",
                    "write",
                    "--block_size",
                    "1MiB",
                    "--batch_size",
                    "4",
                ])
                .args([
                    "--buffer_size",
                    "64MiB",
                    "--threads",
                    "1",
                    "--duration",
                    "0.3",
                    "--json",
                ])
                .env("KVPOOL_AUTH_KEY", KEY),
        )
        .expect("the command succeeds and prints JSON");
        assert_eq!(v["transfer"]["protocol"], protocol);
        assert!(v["transfer"]["requests_done"].as_u64().unwrap() > 0, "{v}");
        assert_eq!(v["transfer"]["requests_failed"], 0);
    }
    // A wrong key is refused with a clear, non-zero exit.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvpool"))
        .args(["bench", "transfer", "--mode", "initiator", "--target_addr"])
        .arg(target.tcp.to_string())
        .args(["--duration", "0.1", "--buffer_size", "64MiB"])
        .env("KVPOOL_AUTH_KEY", "not-the-pool-key-at-all")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("handshake") || err.contains("Handshake"),
        "{err}"
    );
}

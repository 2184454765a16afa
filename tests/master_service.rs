//! The master's gRPC service over loopback: the client library against an in-process master,
//! authentication, error codes, admin endpoints, agent death, and the real binary's SIGTERM.

mod pool_support;

use std::time::Duration;

use kvpool_client::master::{ClientConfig, ClientError, MasterClient};
use kvpool_core::master::{PutOptions, PutStarted};
use kvpool_master::cmd::MasterArgs;
use kvpool_proto::auth::AuthKey;
use kvpool_proto::master::ErrorCode;
use pool_support::{
    InProcessMaster, assert_closed_within, assert_committed, current_thread_runtime, dram_segment,
    eventually, http_get, in_process_master, mount_dram, put_allocated,
};
use tokio_util::sync::CancellationToken;

const KEY: &[u8] = b"kvpool-test-pool-key-0123456789";
const MIB: u64 = 1 << 20;

type Fixture = InProcessMaster;

async fn fixture(tweak: impl FnOnce(&mut MasterArgs)) -> Fixture {
    in_process_master(KEY, tweak).await
}

fn code(e: &ClientError) -> Option<ErrorCode> {
    e.code()
}

#[tokio::test]
async fn put_get_batch_and_error_codes_over_grpc() {
    let f = fixture(|_| {}).await;
    let c = &f.client;
    mount_dram(c, &["a", "b", "c"], 64 * MIB).await;
    let opts = PutOptions {
        replicas: 2,
        writer_node: Some("a".into()),
        ..PutOptions::default()
    };
    // Batch put of a 4-block chain.
    let keys: Vec<Vec<u8>> = (0..4).map(|i| format!("chain/{i}").into_bytes()).collect();
    let items: Vec<(&[u8], u64)> = keys.iter().map(|k| (k.as_slice(), 100_000)).collect();
    let started = c.put_start_batch(&items, &opts).await.expect("put_start");
    let mut ends = Vec::new();
    for (k, r) in keys.iter().zip(started) {
        match r.expect("allocated") {
            PutStarted::Allocated { put_id, replicas } => {
                assert_eq!(replicas.len(), 2);
                assert_eq!(replicas[0].node, "a", "writer's node first");
                assert_ne!(replicas[0].node, replicas[1].node);
                ends.push((k.as_slice(), put_id));
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    // Only the first three are committed.
    let committed = c.put_end_batch(&ends[..3]).await.expect("put_end");
    assert!(committed.iter().all(Result::is_ok));
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    assert_eq!(
        c.exists(&refs).await.expect("exists"),
        vec![true, true, true, false]
    );
    assert_eq!(c.longest_prefix(&refs).await.expect("prefix"), 3);
    c.put_revoke(ends[3].0, ends[3].1).await.expect("revoke");

    let got = c.get(&keys[0]).await.expect("get");
    assert_eq!(got.size, 100_000);
    assert_eq!(got.replicas.len(), 2);
    assert!(got.lease_ttl > Duration::ZERO);
    let gets = c
        .get_batch(&[&keys[1], b"missing"])
        .await
        .expect("get batch");
    assert!(gets[0].is_ok());
    assert_eq!(
        gets[1].as_ref().err().and_then(code),
        Some(ErrorCode::UnknownKey)
    );

    // Bad input: clear codes, no state change.
    let before = c.stats().await.expect("stats");
    let dup = c.put_start(&keys[0], 100_000, &opts).await.expect("dup");
    assert_eq!(dup, PutStarted::AlreadyCommitted { size: 100_000 });
    let conflict = c.put_start(&keys[0], 5, &opts).await.expect_err("conflict");
    assert_eq!(code(&conflict), Some(ErrorCode::SizeConflict));
    let big = c
        .put_start(b"big", 65 * MIB, &opts)
        .await
        .expect_err("too large");
    assert_eq!(code(&big), Some(ErrorCode::TooLarge));
    let stale = c.put_end(&keys[0], 12345).await.expect_err("stale put");
    assert_eq!(code(&stale), Some(ErrorCode::StalePut));
    let leased = c.remove(&keys[0]).await.expect_err("leased");
    assert_eq!(code(&leased), Some(ErrorCode::Leased));
    c.release_lease(got.lease_id).await.expect("release");
    let stale = c
        .release_lease(got.lease_id)
        .await
        .expect_err("stale lease");
    assert_eq!(code(&stale), Some(ErrorCode::StaleLease));
    let unknown = c.remove(b"missing").await.expect_err("unknown");
    assert_eq!(code(&unknown), Some(ErrorCode::UnknownKey));
    let empty_key = c.exists(&[b""]).await.expect_err("empty key");
    assert!(
        matches!(empty_key, ClientError::Rpc { ref source, .. } if source.code() == tonic::Code::InvalidArgument)
    );
    let bad_hb = c.heartbeat("nobody").await.expect_err("unknown node");
    assert!(
        matches!(bad_hb, ClientError::Rpc { ref source, .. } if source.code() == tonic::Code::NotFound)
    );
    let mut after = c.stats().await.expect("stats");
    // The only difference: the lease was released.
    after.leases += 1;
    assert_eq!(after, before);

    // Pins and remove.
    assert!(c.pin(&[&keys[1]], true, Duration::ZERO).await.expect("pin")[0].is_ok());
    assert!(c.unpin(&[&keys[1]]).await.expect("unpin")[0].is_ok());
    let leases: Vec<u64> = gets
        .into_iter()
        .filter_map(|g| g.ok())
        .map(|g| g.lease_id)
        .collect();
    c.release_leases(&leases).await.expect("release");
    let removed = c.remove_batch(&[&keys[0], &keys[1]]).await.expect("remove");
    assert!(removed.iter().all(Result::is_ok), "{removed:?}");
    assert_eq!(c.longest_prefix(&refs).await.expect("prefix"), 0);

    f.shutdown.cancel();
    f.master.join().await.expect("clean stop");
}

#[tokio::test]
async fn unauthenticated_requests_are_refused_and_change_nothing() {
    let f = fixture(|_| {}).await;
    mount_dram(&f.client, &["a"], 64 * MIB).await;
    let before = f.client.stats().await.expect("stats");
    let intruder = MasterClient::new(
        vec![f.master.grpc_addr.to_string()],
        AuthKey::from_bytes(b"not-the-pool-key-at-all").expect("key"),
        ClientConfig::default(),
    )
    .expect("client");
    let e = intruder
        .mount_segment(&dram_segment("evil", 64 * MIB))
        .await
        .expect_err("refused");
    assert!(
        matches!(e, ClientError::Rpc { ref source, .. } if source.code() == tonic::Code::Unauthenticated),
        "{e:?}"
    );
    let e = intruder
        .put_start(b"k", 10, &PutOptions::default())
        .await
        .expect_err("refused");
    assert!(
        matches!(e, ClientError::Rpc { ref source, .. } if source.code() == tonic::Code::Unauthenticated)
    );
    assert_eq!(f.client.stats().await.expect("stats"), before);
    // The refusals are counted.
    let (_, metrics) = http_get(f.master.admin_addr, "/metrics")
        .await
        .expect("metrics");
    let labels = ["method=\"mount_segment\"", "result=\"ok\""];
    assert_eq!(
        kvpool_harness::scrape::metric_value(&metrics, "kvpool_master_requests_total", &labels),
        Some(1.0),
        "{metrics}"
    );
    f.shutdown.cancel();
    f.master.join().await.expect("clean stop");
}

/// The item code of a refused item, or the gRPC status mapped onto the same vocabulary for
/// requests refused as a whole.
fn refusal(e: &ClientError) -> String {
    match e {
        ClientError::Refused { code, .. } => format!("{code:?}"),
        ClientError::Rpc { source, .. } => format!("rpc:{:?}", source.code()),
        other => format!("{other:?}"),
    }
}

#[tokio::test]
async fn every_kind_of_bad_input_gets_its_code_and_changes_no_state() {
    let f = fixture(|_| {}).await;
    let c = &f.client;
    mount_dram(c, &["a", "b"], 64 * MIB).await;
    let opts = PutOptions::default();
    // One committed object and one pending put.
    let (put_id, _) = put_allocated(c, b"kept", 4096, &opts).await;
    c.put_end(b"kept", put_id).await.expect("commit");
    let (pending_id, _) = put_allocated(c, b"pending", 4096, &opts).await;
    let before = c.stats().await.expect("stats");
    assert_eq!((before.objects, before.pending_puts), (1, 1));

    let mut seen = Vec::new();
    let mut expect = |what: &str, got: Result<(), ClientError>, want: &str| {
        let e = got.expect_err(what);
        assert_eq!(refusal(&e), want, "{what}: {e:?}");
        seen.push(what.to_owned());
    };
    // Unknown keys.
    expect(
        "get unknown",
        c.get(b"missing").await.map(|_| ()),
        "UnknownKey",
    );
    expect("remove unknown", c.remove(b"missing").await, "UnknownKey");
    let pin = c
        .pin(&[b"missing"], true, Duration::ZERO)
        .await
        .expect("pin");
    expect(
        "pin unknown",
        pin.into_iter().next().expect("one result"),
        "UnknownKey",
    );
    // Pending objects are invisible to readers.
    expect(
        "get pending",
        c.get(b"pending").await.map(|_| ()),
        "UnknownKey",
    );
    // Duplicates: same size is idempotent (checked below), another size conflicts, a pending
    // key is busy.
    assert_eq!(
        c.put_start(b"kept", 4096, &opts).await.expect("dup"),
        PutStarted::AlreadyCommitted { size: 4096 }
    );
    expect(
        "put other size",
        c.put_start(b"kept", 8192, &opts).await.map(|_| ()),
        "SizeConflict",
    );
    expect(
        "put pending key",
        c.put_start(b"pending", 4096, &opts).await.map(|_| ()),
        "PutInProgress",
    );
    // Sizes and counts.
    expect(
        "larger than any segment",
        c.put_start(b"huge", 65 * MIB, &opts).await.map(|_| ()),
        "TooLarge",
    );
    expect(
        "size zero",
        c.put_start(b"zero", 0, &opts).await.map(|_| ()),
        "InvalidArgument",
    );
    let zero_replicas = PutOptions {
        replicas: 0,
        ..PutOptions::default()
    };
    expect(
        "zero replicas",
        c.put_start(b"r0", 10, &zero_replicas).await.map(|_| ()),
        "InvalidArgument",
    );
    // Stale put ids and leases.
    expect(
        "put_end wrong id",
        c.put_end(b"pending", pending_id + 1000).await,
        "StalePut",
    );
    expect(
        "revoke wrong id",
        c.put_revoke(b"pending", pending_id + 1000).await,
        "StalePut",
    );
    expect(
        "release unknown lease",
        c.release_lease(987_654_321).await,
        "StaleLease",
    );
    expect(
        "oversized key",
        c.exists(&[vec![7u8; 5000].as_slice()]).await.map(|_| ()),
        "rpc:InvalidArgument",
    );
    // Unauthenticated peers: every kind of call is refused before any handler runs.
    let intruder = MasterClient::new(
        vec![f.master.grpc_addr.to_string()],
        AuthKey::from_bytes(b"not-the-pool-key-at-all").expect("key"),
        ClientConfig::default(),
    )
    .expect("client");
    expect(
        "intruder get",
        intruder.get(b"kept").await.map(|_| ()),
        "rpc:Unauthenticated",
    );
    expect(
        "intruder remove",
        intruder.remove(b"kept").await,
        "rpc:Unauthenticated",
    );
    expect(
        "intruder put_end",
        intruder.put_end(b"pending", pending_id).await,
        "rpc:Unauthenticated",
    );
    expect(
        "intruder unmount",
        intruder.unmount_segment("a", 1).await,
        "rpc:Unauthenticated",
    );
    expect(
        "intruder heartbeat",
        intruder.heartbeat("a").await.map(|_| ()),
        "rpc:Unauthenticated",
    );
    assert_eq!(seen.len(), 18, "every case ran");

    // Nothing changed: same objects, pending puts, leases and bytes (the lookup counters
    // count the refused lookups too; they are figures, not state).
    let after = c.stats().await.expect("stats");
    let state = |s: &kvpool_proto::master::StatsResponse| kvpool_proto::master::StatsResponse {
        lookup_hits: 0,
        lookup_misses: 0,
        get_hits: 0,
        get_misses: 0,
        ..s.clone()
    };
    assert_eq!(state(&after), state(&before));
    // And the legitimate operations still work on the same state.
    c.put_end(b"pending", pending_id)
        .await
        .expect("commit pending");
    let got = c.get(b"kept").await.expect("kept");
    assert_eq!(got.size, 4096);
    c.release_lease(got.lease_id).await.expect("release");
    f.shutdown.cancel();
    f.master.join().await.expect("clean stop");
}

#[tokio::test]
async fn admin_endpoints_and_metrics() {
    let f = fixture(|_| {}).await;
    assert!(
        http_get(f.master.admin_addr, "/livez")
            .await
            .is_some_and(|(status, _)| status == 200)
    );
    assert!(
        http_get(f.master.admin_addr, "/readyz")
            .await
            .is_some_and(|(status, _)| status == 200)
    );
    mount_dram(&f.client, &["a"], 64 * MIB).await;
    match f
        .client
        .put_start(b"k", MIB, &PutOptions::default())
        .await
        .expect("put")
    {
        PutStarted::Allocated { put_id, .. } => f.client.put_end(b"k", put_id).await.expect("end"),
        other => panic!("{other:?}"),
    }
    // Gauges are refreshed by the tick loop; poll until they show the object.
    assert_metrics(
        &f,
        "kvpool_master_objects 1",
        &[
            "kvpool_master_objects 1",
            "kvpool_master_used_bytes{tier=\"dram\"} 1048576",
            "kvpool_master_capacity_bytes{tier=\"dram\"} 67108864",
            "kvpool_master_requests_total{method=\"put_end\",result=\"ok\"} 1",
            "kvpool_master_request_duration_seconds_bucket{method=\"put_start\"",
            "kvpool_master_leader 1",
            "kvpool_master_leases 0",
        ],
    )
    .await;
    let ready = f.master.readiness.clone();
    f.shutdown.cancel();
    f.master.join().await.expect("clean stop");
    assert!(!ready.is_ready(), "not ready once stopped");
}

#[tokio::test]
async fn silent_agents_die_and_two_replica_objects_stay_readable() {
    let f = fixture(|a| a.heartbeat_timeout = Duration::from_secs(2)).await;
    let c = &f.client;
    mount_dram(c, &["a", "b"], 64 * MIB).await;
    // b heartbeats for the whole test; a only while the objects are written.
    let a_beats = CancellationToken::new();
    let beats = CancellationToken::new();
    for (node, stop) in [("a", a_beats.clone()), ("b", beats.clone())] {
        let (c, stop) = (c.clone(), stop);
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let _ = c.heartbeat(node).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
    }
    let opts = PutOptions {
        replicas: 2,
        ..PutOptions::default()
    };
    let keys: Vec<Vec<u8>> = (0..50).map(|i| format!("obj/{i}").into_bytes()).collect();
    for k in &keys {
        match c.put_start(k, 4096, &opts).await.expect("put") {
            PutStarted::Allocated { put_id, .. } => c.put_end(k, put_id).await.expect("end"),
            other => panic!("{other:?}"),
        }
    }
    a_beats.cancel();
    let mut alive = 2;
    for _ in 0..600 {
        alive = c.stats().await.expect("stats").nodes_alive;
        if alive == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(alive, 1, "agent a was never declared dead");
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    assert_eq!(c.exists(&refs).await.expect("exists"), vec![true; 50]);
    for k in &refs {
        let got = c.get(k).await.expect("readable");
        assert_eq!(got.replicas.len(), 1);
        assert_eq!(got.replicas[0].node, "b");
    }
    let e = c.heartbeat("a").await.expect_err("dead");
    assert!(
        matches!(e, ClientError::Rpc { ref source, .. } if source.code() == tonic::Code::NotFound)
    );
    assert_eq!(c.stats().await.expect("stats").under_replicated, 50);
    beats.cancel();
    f.shutdown.cancel();
    f.master.join().await.expect("clean stop");
}

#[test]
fn binary_serves_and_stops_cleanly_on_sigterm() {
    use kvpool_harness::{Launcher, Probe, free_addr, kvpool_command};
    let dir = tempfile::tempdir().expect("tmp");
    let key_file = dir.path().join("key");
    std::fs::write(&key_file, KEY).expect("key");
    let (grpc, admin) = (free_addr().expect("port"), free_addr().expect("port"));
    // The key file comes from the environment here.
    let mut child = Launcher::new(dir.path())
        .spawn(
            "master",
            kvpool_command(pool_support::KVPOOL.as_ref())
                .args(["master", "--listen", &grpc.to_string()])
                .args(["--admin-listen", &admin.to_string()])
                .env("KVPOOL_AUTH_KEY_FILE", &key_file),
        )
        .expect("spawn");
    child
        .wait_ready(&Probe::Tcp(admin), Duration::from_secs(30))
        .expect("master did not start");
    let status = child
        .terminate(Duration::from_secs(30))
        .expect("exits after SIGTERM");
    assert!(status.success(), "exit status {status:?}");

    // A bad flag exits non-zero naming the field.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvpool"))
        .args([
            "master",
            "--dram-high-watermark",
            "0.5",
            "--dram-low-watermark",
            "0.9",
        ])
        .env("KVPOOL_AUTH_KEY_FILE", &key_file)
        .output()
        .expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("dram-low-watermark"), "{stderr}");
}

/// Stand-in for the transfer engine and the agents' memory until those land (issues 3 and 4):
/// each mounted segment is a byte buffer; a killed agent's buffers disappear.
#[derive(Clone, Default)]
struct Fabric(std::sync::Arc<parking_lot::Mutex<std::collections::HashMap<u32, Vec<u8>>>>);

impl Fabric {
    fn add(&self, seg: u32, cap: u64) {
        self.0.lock().insert(seg, vec![0; cap as usize]);
    }
    fn drop_segment(&self, seg: u32) {
        self.0.lock().remove(&seg);
    }
    fn write(&self, r: &kvpool_core::master::ReplicaInfo, data: &[u8]) -> bool {
        let mut m = self.0.lock();
        let Some(buf) = m.get_mut(&r.segment_id) else {
            return false;
        };
        let off = r.offset as usize;
        buf[off..off + data.len()].copy_from_slice(data);
        true
    }
    fn read(&self, r: &kvpool_core::master::ReplicaInfo) -> Option<Vec<u8>> {
        let m = self.0.lock();
        let buf = m.get(&r.segment_id)?;
        let off = r.offset as usize;
        Some(buf[off..off + r.length as usize].to_vec())
    }
}

fn value_for(i: u64) -> Vec<u8> {
    let len = 1000 + (i * 7919 % 60_000) as usize;
    (0..len).map(|j| (i as usize * 31 + j * 17) as u8).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_under_load_loses_nothing_and_reads_verify() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    // Live agents heartbeat every 50 ms; the timeout is generous for a loaded 2-core box.
    let f = fixture(|a| a.heartbeat_timeout = Duration::from_secs(3)).await;
    let fabric = Fabric::default();
    let mut agents = Vec::new();
    for n in ["a", "b", "c"] {
        let id = f
            .client
            .mount_segment(&dram_segment(n, 32 * MIB))
            .await
            .expect("mount");
        fabric.add(id, 32 * MIB);
        let alive = std::sync::Arc::new(AtomicBool::new(true));
        // Agent loop: heartbeat, execute repair copies through the fabric.
        let (c, fab, al, node) = (
            f.client.clone(),
            fabric.clone(),
            alive.clone(),
            n.to_owned(),
        );
        agents.push((
            id,
            alive,
            tokio::spawn(async move {
                while al.load(Ordering::SeqCst) {
                    if let Ok(tasks) = c.heartbeat(&node).await {
                        for t in tasks {
                            let ok = match fab.read(&t.source) {
                                Some(bytes) => fab.write(&t.target, &bytes),
                                None => false,
                            };
                            let _ = c.complete_task(&node, t.id, ok).await;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }),
        ));
    }
    let opts = PutOptions {
        replicas: 2,
        ..PutOptions::default()
    };
    let committed: std::sync::Arc<parking_lot::Mutex<Vec<u64>>> = Default::default();
    let next = std::sync::Arc::new(AtomicU64::new(0));
    let bad_reads = std::sync::Arc::new(AtomicU64::new(0));
    let stop_readers = CancellationToken::new();
    // Two writers.
    let mut writers = Vec::new();
    for _ in 0..2 {
        let (c, fab, done, next, opts) = (
            f.client.clone(),
            fabric.clone(),
            committed.clone(),
            next.clone(),
            opts.clone(),
        );
        writers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= 300 {
                    break;
                }
                let key = format!("obj/{i}").into_bytes();
                let value = value_for(i);
                let (put_id, replicas) = put_allocated(&c, &key, value.len() as u64, &opts).await;
                for r in &replicas {
                    fab.write(r, &value); // a dead target just fails, like a transfer would
                }
                match c.put_end(&key, put_id).await {
                    Ok(()) => done.lock().push(i),
                    Err(e) => assert_eq!(code(&e), Some(ErrorCode::ReplicasLost), "{e}"),
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }));
    }
    // A reader verifying every byte it reads, through the kill.
    let reader = {
        let (c, fab, done, bad, stop) = (
            f.client.clone(),
            fabric.clone(),
            committed.clone(),
            bad_reads.clone(),
            stop_readers.clone(),
        );
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.is_cancelled() {
                let keys: Vec<u64> = done.lock().clone();
                for i in keys.iter().rev().take(20) {
                    let got = c
                        .get(format!("obj/{i}").as_bytes())
                        .await
                        .expect("committed object readable");
                    let ok = got
                        .replicas
                        .iter()
                        .filter_map(|r| fab.read(r))
                        .any(|b| b == value_for(*i));
                    if !ok {
                        bad.fetch_add(1, Ordering::SeqCst);
                    }
                    let _ = c.release_lease(got.lease_id).await;
                    n += 1;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            n
        })
    };
    // Kill agent b once a third of the objects are in.
    while committed.lock().len() < 100 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (b_seg, b_alive, b_task) = &agents[1];
    b_alive.store(false, Ordering::SeqCst);
    fabric.drop_segment(*b_seg);
    b_task.abort();
    for w in writers {
        w.await.expect("writer");
    }
    // Wait for death detection and repairs to restore two replicas everywhere.
    let mut stats = f.client.stats().await.expect("stats");
    for _ in 0..1200 {
        stats = f.client.stats().await.expect("stats");
        if stats.nodes_alive == 2 && stats.under_replicated == 0 && stats.tasks == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_readers.cancel();
    let reads = reader.await.expect("reader");
    assert!(reads > 0);
    assert_eq!(
        bad_reads.load(Ordering::SeqCst),
        0,
        "every read returned the bytes written"
    );
    assert_eq!(
        (stats.nodes_alive, stats.under_replicated),
        (2, 0),
        "{stats:?}"
    );
    let done = committed.lock().clone();
    assert!(done.len() >= 250, "most puts committed: {}", done.len());
    assert_eq!(stats.objects, done.len() as u64, "zero lost objects");
    for i in done {
        let got = f
            .client
            .get(format!("obj/{i}").as_bytes())
            .await
            .expect("get");
        assert_eq!(got.replicas.len(), 2, "repaired to two replicas");
        for r in &got.replicas {
            assert_ne!(r.node, "b");
            assert_eq!(
                fabric.read(r).expect("replica memory"),
                value_for(i),
                "object {i}"
            );
        }
    }
    for (_, alive, task) in agents {
        alive.store(false, Ordering::SeqCst);
        task.abort();
    }
    f.shutdown.cancel();
    f.master.join().await.expect("clean stop");
}

/// Poll the master's metrics until `needle` shows (the gauges follow the tick loop).
/// Waits (see [`metrics_with`]) for `ready` in the master's metrics, then asserts that each of
/// `needles` is in them.
async fn assert_metrics(f: &Fixture, ready: &str, needles: &[&str]) {
    let metrics = metrics_with(f, ready).await;
    for needle in needles {
        assert!(metrics.contains(needle), "missing {needle} in\n{metrics}");
    }
}

async fn metrics_with(f: &Fixture, needle: &str) -> String {
    let mut metrics = String::new();
    for _ in 0..200 {
        metrics = http_get(f.master.admin_addr, "/metrics")
            .await
            .map(|(_, body)| body)
            .unwrap_or_default();
        if metrics.contains(needle) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    metrics
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remove_sends_the_releases_that_forks_still_hold() {
    let f = fixture(|_| {}).await;
    mount_dram(&f.client, &["a"], 64 * MIB).await;
    let (put_id, _) = put_allocated(&f.client, b"held/k", MIB, &PutOptions::default()).await;
    f.client.put_end(b"held/k", put_id).await.expect("put_end");
    // The fork's parent runtime is never driven, so the fork's timed release (through the
    // parent) cannot fire: only the flush before the remove can send the read's lease.
    let idle = current_thread_runtime();
    let fork = f.client.fork(idle.handle().clone());
    let fork = tokio::task::spawn_blocking(move || {
        let rt = current_thread_runtime();
        rt.block_on(async {
            let located = fork.get(b"held/k").await.expect("get");
            // Held by the fork's lane for its next call, which never comes.
            fork.release_lease_later(located.lease_id);
        });
        fork
    })
    .await
    .expect("fork thread");
    // Another client of the same root removes the key the fork has just read.
    f.client
        .remove(b"held/k")
        .await
        .expect("the fork's finished read does not block the remove");
    assert_eq!(
        f.client.exists(&[b"held/k"]).await.expect("exists"),
        vec![false]
    );
    tokio::task::spawn_blocking(move || drop((fork, idle)))
        .await
        .expect("drop the idle runtime off the async threads");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_calls_over_the_fast_lane_next_to_grpc_on_the_same_port() {
    let f = fixture(|_| {}).await;
    mount_dram(&f.client, &["a"], 64 * MIB).await;
    let fork = f.client.fork(tokio::runtime::Handle::current());
    // The fork is driven by a thread of its own, as a Python thread drives it.
    let (lease, fork) = tokio::task::spawn_blocking(move || {
        let rt = current_thread_runtime();
        let lease = rt.block_on(async {
            let (put_id, replicas) =
                put_allocated(&fork, b"fast/k", MIB, &PutOptions::default()).await;
            assert_eq!(replicas[0].node, "a");
            fork.put_end(b"fast/k", put_id).await.expect("put_end");
            let located = assert_committed(&fork, b"fast/k", b"fast/missing", MIB).await;
            // A refusal keeps its code over the fast lane too.
            let missing = fork.get(b"fast/missing").await.expect_err("missing");
            assert_eq!(code(&missing), Some(ErrorCode::UnknownKey), "{missing}");
            // Released with the fork's next call (or by the parent within a few ms).
            fork.release_lease_later(located.lease_id);
            assert_eq!(fork.longest_prefix(&[b"fast/k"]).await.expect("prefix"), 1);
            located.lease_id
        });
        // Kept open (with its connection) until the metrics were read.
        (lease, fork)
    })
    .await
    .expect("fork thread");
    assert!(lease > 0);
    // The fork's calls are counted with its root client's.
    let calls = f.client.batched_calls();
    assert_eq!(
        (calls.get, calls.put_start, calls.put_end),
        (2, 1, 1),
        "{calls:?}"
    );
    // gRPC on the same port still works, and saw none of the fork's calls.
    assert_eq!(
        f.client.exists(&[b"fast/k"]).await.expect("grpc"),
        vec![true]
    );
    assert_metrics(
        &f,
        "kvpool_master_leases 0",
        &[
            "kvpool_master_fast_lane_connections 1",
            "kvpool_master_requests_total{method=\"put_start\",result=\"ok\"} 1",
            "kvpool_master_requests_total{method=\"exists\",result=\"ok\"} 2",
            "kvpool_master_requests_total{method=\"get\",result=\"unknown_key\"} 1",
            "kvpool_master_requests_total{method=\"release_leases\",result=\"ok\"} 1",
            "kvpool_master_leases 0",
            // The piggybacked release ended the fork's one lease; none expired.
            "kvpool_master_lease_hold_seconds_count{end=\"released\"} 1",
            "kvpool_master_lease_hold_seconds_count{end=\"expired\"} 0",
        ],
    )
    .await;
    drop(fork);
    let closed = "kvpool_master_fast_lane_connections 0";
    assert!(
        metrics_with(&f, closed).await.contains(closed),
        "the lane stays open"
    );
}

#[tokio::test]
async fn bad_fast_lane_input_is_refused_and_grpc_goes_on() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let f = fixture(|_| {}).await;
    let addr = f.master.grpc_addr;
    let answer = |bytes: Vec<u8>| async move {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        s.write_all(&bytes).await.expect("write");
        let mut got = Vec::new();
        // The master answers what it answers, then closes.
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got)).await;
        got
    };
    // A preface of another version: closed without a word.
    assert!(answer(b"KVMP\x09\x00\x00\x00".to_vec()).await.is_empty());
    // A good preface, then a frame larger than the limit: INVALID_ARGUMENT (3), then closed.
    let mut big = kvpool_proto::fast::PREFACE.to_vec();
    big.extend_from_slice(&u32::MAX.to_le_bytes());
    let got = answer(big).await;
    assert_eq!(&got[..8], &kvpool_proto::fast::PREFACE);
    assert_eq!(got[12], 3, "{got:?}");
    // A well-formed call with a forged credential: UNAUTHENTICATED (16), then closed.
    let mut forged = kvpool_proto::fast::PREFACE.to_vec();
    kvpool_proto::fast::encode_request(
        &mut forged,
        kvpool_proto::fast::Method::Exists,
        &AuthKey::from_bytes(b"another-key-0123456789abcdef")
            .expect("key")
            .sign_body("Exists", &[]),
        &[],
        &[],
    );
    let got = answer(forged).await;
    assert_eq!(got[12], 16, "{got:?}");
    // The credential is checked before the rest of a frame is read: a forged call that
    // announces 50 MiB and sends only its head and credential is refused at once.
    let cred = AuthKey::from_bytes(b"another-key-0123456789abcdef")
        .expect("key")
        .sign_body("Get", &[]);
    let mut head_only = kvpool_proto::fast::PREFACE.to_vec();
    head_only.extend_from_slice(&(50u32 << 20).to_le_bytes());
    head_only.extend_from_slice(&[kvpool_proto::fast::Method::Get as u8, 0]);
    head_only.extend_from_slice(&(cred.len() as u16).to_le_bytes());
    head_only.extend_from_slice(cred.as_bytes());
    let started = std::time::Instant::now();
    let got = answer(head_only).await;
    assert_eq!(got[12], 16, "{got:?}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    // Garbage that is not the fast lane goes to gRPC, which drops it; gRPC clients are served.
    let _ = answer(b"GET / HTTP/1.0\r\n\r\n".to_vec()).await;
    assert_eq!(f.client.exists(&[b"k"]).await.expect("grpc"), vec![false]);
    assert_metrics(
        &f,
        "kvpool_master_fast_lane_refusals_total",
        &[
            "kvpool_master_fast_lane_refusals_total{reason=\"preface\"} 1",
            "kvpool_master_fast_lane_refusals_total{reason=\"frame\"} 1",
            "kvpool_master_fast_lane_refusals_total{reason=\"unauthenticated\"} 2",
            "kvpool_master_fast_lane_connections 0",
        ],
    )
    .await;
}

/// Issue 15: silent connections, fast-lane handshakes that trickle, and gRPC connections that
/// never make a call hold a bounded number of the master's connections for a bounded time,
/// and a real client is served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_silent_connections_are_capped_and_closed_at_the_deadline() {
    use tokio::io::AsyncWriteExt;
    let f = fixture(|a| {
        a.handshake_timeout = Duration::from_secs(1);
        a.max_connections_per_source = 32;
    })
    .await;
    let addr = f.master.grpc_addr;
    let m = &f.master.core.metrics;
    let connect_from = |ip: &'static str| async move {
        let s = tokio::net::TcpSocket::new_v4().expect("socket");
        s.bind(format!("{ip}:0").parse().expect("addr"))
            .expect("bind");
        s.connect(addr).await.expect("connect")
    };
    let start = std::time::Instant::now();
    // 40 silent connections from one address: 32 held, 8 closed at once.
    let mut held = Vec::new();
    for _ in 0..40 {
        held.push(connect_from("127.0.0.2").await);
    }
    // From another address: fast-lane handshakes stopped half-way (in the preface, and in the
    // first call's length), and HTTP/2 connections that never make a call.
    let mut preface_and_half_a_length = kvpool_proto::fast::PREFACE.to_vec();
    preface_and_half_a_length.extend_from_slice(&[1, 0]);
    let mut h2 = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    h2.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]); // an empty SETTINGS frame
    for first in [b"KVMP\x01".to_vec(), preface_and_half_a_length, h2] {
        for _ in 0..5 {
            let mut s = connect_from("127.0.0.3").await;
            s.write_all(&first).await.expect("write");
            held.push(s);
        }
    }
    assert!(
        eventually(Duration::from_secs(5), || m.conn_refusals("per_source")
            == 8)
        .await,
        "refused {}",
        m.conn_refusals("per_source")
    );
    // A real client is served while they are held.
    let served_at = tokio::time::Instant::now();
    assert_eq!(f.client.exists(&[b"k"]).await.expect("grpc"), vec![false]);
    let served = served_at.elapsed();
    assert!(served < Duration::from_secs(1), "{served:?}");
    // Every one of them is closed by the deadline (EOF or reset).
    assert_closed_within(&mut held, Duration::from_secs(5)).await;
    let closed_after = start.elapsed();
    assert!(
        m.conn_refusals("silent") >= 32,
        "{}",
        m.conn_refusals("silent")
    );
    assert!(m.conn_refusals("handshake_timeout") >= 10);
    // The five call-less HTTP/2 connections were cut at the deadline; the real client's
    // connection, which authenticated a call, was not (it is past its own deadline too).
    tokio::time::sleep_until(served_at + Duration::from_millis(1200)).await;
    assert_eq!(f.client.exists(&[b"k"]).await.expect("grpc"), vec![false]);
    assert_eq!(m.conn_refusals("grpc_unauthenticated"), 5);
    println!(
        "figure: master held 32 of 40 silent connections from one source (cap 32) and 15 slow \
         handshakes; real call served in {served:?}; all closed {closed_after:?} after the start \
         (deadline 1 s)"
    );
}

/// Issue 15: an authenticated connection on which calls keep starting stays open past the idle
/// timeout (HTTP/2 pings alone do not keep one open), an idle one is closed and counted, and
/// the client's next call reconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_authenticated_connections_are_closed_and_clients_reconnect() {
    let f = fixture(|a| a.idle_timeout = Duration::from_secs(1)).await;
    let m = &f.master.core.metrics;
    // Busy: a call every 200 ms for three idle timeouts.
    let busy_until = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < busy_until {
        assert_eq!(f.client.exists(&[b"k"]).await.expect("grpc"), vec![false]);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(m.conn_refusals("idle"), 0, "a busy connection was closed");
    // Idle: closed once the timeout passes.
    assert!(
        eventually(Duration::from_secs(10), || m.conn_refusals("idle") >= 1).await,
        "idle connection not closed"
    );
    // The client reconnects on its next call.
    assert_eq!(f.client.exists(&[b"k"]).await.expect("grpc"), vec![false]);
}

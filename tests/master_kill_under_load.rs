//! An agent SIGKILLed while puts and gets are in flight, across real processes on 127.0.0.1:
//! one `kvpool master`, three `kvpool agent run` processes in pool mode and this test as the
//! client (its own transfer engine, TCP to the agents). Writers put values with two replicas,
//! readers read committed ones back concurrently; one agent dies mid-run. Then: zero committed
//! objects lost, every committed value reads back with the checksum of the bytes written, every
//! read that returned bytes during the run returned the right ones, and a put that failed is
//! either absent or (if its commit raced the failure report) byte-exact, never pointing at freed
//! memory.

mod pool_support;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvpool_client::pool::PoolClient;
use kvpool_core::master::PutOptions;
use parking_lot::Mutex;
use pool_support::*;

const WRITERS: u64 = 3;
const PUTS_PER_WRITER: u64 = 60;
const READERS: usize = 2;
/// Commits before the kill.
const KILL_AFTER: u64 = 40;

/// The value of a key: length 4 KiB to ~260 KiB, content from the key's id.
fn value(id: u64) -> Vec<u8> {
    let len = 4096 + (id * 7919 % 64) as usize * 4096 + (id % 13) as usize;
    kvpool_harness::bytes::pseudo_random(id, len)
}

fn key(id: u64) -> Vec<u8> {
    format!("kill-under-load/{id}").into_bytes()
}

#[derive(Default)]
struct Outcomes {
    /// id -> crc32c of the committed value.
    committed: HashMap<u64, u32>,
    /// Failed put attempts (the put was retried until it committed).
    failed: Vec<(u64, String)>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_killed_under_load_loses_no_committed_object() {
    let (dir, key_file, mut master, grpc) = test_pool("3s");
    let logs = dir.path();
    let (mut a, _) = start_agent(logs, "agent-a", grpc, &key_file, "64MiB");
    let (mut b, _) = start_agent(logs, "agent-b", grpc, &key_file, "64MiB");
    let (mut c, _) = start_agent(logs, "agent-c", grpc, &key_file, "64MiB");

    let client = master_client(grpc, KEY);
    wait_stats(
        &client,
        "three agents mounted",
        &mut [&mut master, &mut a, &mut b, &mut c],
        |s| s.nodes_alive == 3 && s.segments >= 3,
    )
    .await;

    let engine = client_engine("test-client", KEY, |c| c.prefer_shm = false);
    let pool = PoolClient::new(client.clone(), engine, "test-client".into(), None);
    let opts = PutOptions {
        replicas: 2,
        ..PutOptions::default()
    };

    let outcomes = Arc::new(Mutex::new(Outcomes::default()));
    let commits = Arc::new(AtomicU64::new(0));
    let writers_done = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (pool, opts, outcomes, commits) = (
            pool.clone(),
            opts.clone(),
            outcomes.clone(),
            commits.clone(),
        );
        writers.push(tokio::spawn(async move {
            for i in 0..PUTS_PER_WRITER {
                let id = w * 1_000_000 + i;
                let v = value(id);
                // Like a real client, retry a failed put (the master keeps placing replicas on
                // the dead agent until its heartbeat timeout); every failed attempt is kept.
                let started = Instant::now();
                loop {
                    match pool.put(&key(id), &v, &opts).await {
                        Ok(_) => {
                            outcomes.lock().committed.insert(id, crc32c::crc32c(&v));
                            commits.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        Err(e) => {
                            outcomes.lock().failed.push((id, format!("{e:#}")));
                            assert!(
                                started.elapsed() < DEADLINE,
                                "put {id} never succeeded: {e:#}"
                            );
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
            }
        }));
    }
    // Readers: any committed object, checked against its checksum. A read may fail while the
    // dead agent is still listed (the client then tries the other replica); it may never return
    // other bytes.
    let reads = Arc::new(AtomicU64::new(0));
    let bad_reads = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut readers = Vec::new();
    for r in 0..READERS {
        let (pool, outcomes, done, reads, bad) = (
            pool.clone(),
            outcomes.clone(),
            writers_done.clone(),
            reads.clone(),
            bad_reads.clone(),
        );
        readers.push(tokio::spawn(async move {
            let mut n = r as u64;
            while !done.load(Ordering::Relaxed) {
                let pick = {
                    let o = outcomes.lock();
                    let ids: Vec<(u64, u32)> = o.committed.iter().map(|(k, v)| (*k, *v)).collect();
                    if ids.is_empty() {
                        None
                    } else {
                        ids.get((n as usize * 7) % ids.len()).copied()
                    }
                };
                n += 1;
                let Some((id, crc)) = pick else {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                };
                if let Ok(got) = pool.get(&key(id)).await {
                    reads.fetch_add(1, Ordering::Relaxed);
                    if crc32c::crc32c(&got) != crc || got.len() != value(id).len() {
                        bad.lock()
                            .push(format!("object {id}: {} bytes, wrong checksum", got.len()));
                    }
                }
            }
        }));
    }

    // Kill one replica holder in the middle of the run.
    let started = Instant::now();
    while commits.load(Ordering::Relaxed) < KILL_AFTER {
        master.assert_running().expect("master runs");
        assert!(started.elapsed() < DEADLINE, "no progress before the kill");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    b.kill().expect("SIGKILL agent-b");
    let killed_at_commits = commits.load(Ordering::Relaxed);

    for w in writers {
        tokio::time::timeout(DEADLINE, w)
            .await
            .expect("writers finish")
            .expect("writer task");
    }
    writers_done.store(true, Ordering::Relaxed);
    for r in readers {
        r.await.expect("reader task");
    }
    let stats = wait_stats(
        &client,
        "agent-b declared dead",
        &mut [&mut master, &mut a, &mut c],
        |s| s.nodes_alive == 2,
    )
    .await;

    // Every task is finished: take the outcomes out of the lock before awaiting anything.
    let o = std::mem::take(&mut *outcomes.lock());
    println!(
        "kill under load: {} committed ({} before the kill), {} failed put attempts, {} concurrent reads",
        o.committed.len(),
        killed_at_commits,
        o.failed.len(),
        reads.load(Ordering::Relaxed)
    );
    assert_eq!(
        o.committed.len() as u64,
        WRITERS * PUTS_PER_WRITER,
        "every put committed in the end, on the surviving agents"
    );
    assert!(
        killed_at_commits < WRITERS * PUTS_PER_WRITER,
        "the kill came mid-run"
    );
    assert!(bad_reads.lock().is_empty(), "{:?}", bad_reads.lock());
    // Zero lost: the master still knows every committed object ...
    assert_eq!(
        stats.objects,
        o.committed.len() as u64,
        "objects known to the master"
    );
    // ... and each reads back exactly, from the survivors.
    for (&id, &crc) in &o.committed {
        let got = pool
            .get(&key(id))
            .await
            .unwrap_or_else(|e| panic!("committed object {id} lost: {e:#}"));
        assert_eq!(crc32c::crc32c(&got), crc, "object {id} checksum");
        assert!(got == value(id), "object {id} bytes");
        let located = client.get(&key(id)).await.expect("locate");
        assert!(
            located.replicas.iter().all(|r| r.node != "agent-b"),
            "object {id} still points at the dead agent"
        );
        client
            .release_lease(located.lease_id)
            .await
            .expect("release");
    }
    // A failed attempt never left an object pointing at freed memory: the key is either absent
    // or (committed by a later retry) holds exactly its bytes.
    let failed_keys: Vec<Vec<u8>> = o.failed.iter().map(|(id, _)| key(*id)).collect();
    let refs: Vec<&[u8]> = failed_keys.iter().map(Vec::as_slice).collect();
    if !refs.is_empty() {
        let present = client.exists(&refs).await.expect("exists");
        for ((id, err), there) in o.failed.iter().zip(present) {
            if there {
                let got = pool.get(&key(*id)).await.expect("present failed put reads");
                assert!(
                    got == value(*id),
                    "failed put {id} ({err}) committed other bytes"
                );
            }
        }
    }
}

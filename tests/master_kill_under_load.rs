//! An agent SIGKILLed while puts and gets are in flight, across real processes on 127.0.0.1:
//! one `kvpool master`, three `kvpool agent run` processes in pool mode and this test as the
//! client (its own transfer engine, TCP to the agents). Writers put values with two replicas,
//! readers read committed ones back concurrently; one agent dies mid-run. Then: zero committed
//! objects lost, every committed value reads back with the checksum of the bytes written, every
//! read that returned bytes during the run returned the right ones, and a put that failed is
//! either absent or (if its commit raced the failure report) byte-exact, never pointing at freed
//! memory.

mod pool_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvpool_client::pool::PoolClient;
use kvpool_core::master::PutOptions;
use parking_lot::Mutex;
use pool_support::load::{Committed, Objects, join_tasks, wait_commits};
use pool_support::*;

const WRITERS: u64 = 3;
const PUTS_PER_WRITER: u64 = 60;
const READERS: usize = 2;
/// Commits before the kill.
const KILL_AFTER: u64 = 40;

/// Values of 4 KiB to ~260 KiB.
const LOAD: Objects = Objects::new("kill-under-load", 0).lengths(4096, 64, 4096, 13);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_killed_under_load_loses_no_committed_object() {
    let (dir, key_file, mut master, grpc, client) = test_pool("3s");
    let [mut a, mut b, mut c] = start_agents(dir.path(), grpc, &key_file, "64MiB");
    wait_mounted(&client, 3, &mut [&mut master, &mut a, &mut b, &mut c]).await;

    let engine = client_engine("test-client", KEY, |c| c.prefer_shm = false);
    let pool = PoolClient::new(client.clone(), engine, "test-client".into(), None);
    let opts = PutOptions {
        replicas: 2,
        ..PutOptions::default()
    };

    let committed = Committed::default();
    let failed = Arc::new(Mutex::new(Vec::<(u64, String)>::new()));
    let commits = Arc::new(AtomicU64::new(0));
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (pool, opts, committed, failed, commits) = (
            pool.clone(),
            opts.clone(),
            committed.clone(),
            failed.clone(),
            commits.clone(),
        );
        writers.push(tokio::spawn(async move {
            for i in 0..PUTS_PER_WRITER {
                let id = w * 1_000_000 + i;
                // Like a real client, retry a failed put (the master keeps placing replicas on
                // the dead agent until its heartbeat timeout); every failed attempt is kept.
                let pause = Duration::from_millis(50);
                let crc = LOAD
                    .put_until_committed(&pool, &opts, id, Instant::now(), pause, |e| {
                        failed.lock().push((id, e))
                    })
                    .await;
                committed.lock().insert(id, crc);
                commits.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    // Readers: any committed object, checked against its checksum. A read may fail while the
    // dead agent is still listed (the client then tries the other replica); it may never return
    // other bytes.
    let readers = LOAD.spawn_readers(READERS, &pool, &committed);

    // Kill one replica holder in the middle of the run.
    wait_commits(&commits, KILL_AFTER, &mut [&mut master]).await;
    b.kill().expect("SIGKILL agent-b");
    let killed_at_commits = commits.load(Ordering::Relaxed);

    join_tasks(writers).await;
    let reads = readers.stop().await;
    let stats = wait_stats(
        &client,
        "agent-b declared dead",
        &mut [&mut master, &mut a, &mut c],
        |s| s.nodes_alive == 2,
    )
    .await;

    // Every task is finished: take the outcomes out of the locks before awaiting anything.
    let committed = std::mem::take(&mut *committed.lock());
    let failed = std::mem::take(&mut *failed.lock());
    println!(
        "kill under load: {} committed ({} before the kill), {} failed put attempts, {} concurrent reads",
        committed.len(),
        killed_at_commits,
        failed.len(),
        reads
    );
    assert_eq!(
        committed.len() as u64,
        WRITERS * PUTS_PER_WRITER,
        "every put committed in the end, on the surviving agents"
    );
    assert!(
        killed_at_commits < WRITERS * PUTS_PER_WRITER,
        "the kill came mid-run"
    );
    // Zero lost: the master still knows every committed object ...
    assert_eq!(
        stats.objects,
        committed.len() as u64,
        "objects known to the master"
    );
    // ... and each reads back exactly, from the survivors.
    LOAD.assert_read_back(&pool, &committed, "committed object")
        .await;
    for &id in committed.keys() {
        let nodes = replica_nodes(&client, &LOAD.key(id)).await.expect("locate");
        assert!(
            nodes.iter().all(|n| n != "agent-b"),
            "object {id} still points at the dead agent"
        );
    }
    // A failed attempt never left an object pointing at freed memory: the key is either absent
    // or (committed by a later retry) holds exactly its bytes.
    let failed_keys: Vec<Vec<u8>> = failed.iter().map(|(id, _)| LOAD.key(*id)).collect();
    let refs: Vec<&[u8]> = failed_keys.iter().map(Vec::as_slice).collect();
    if !refs.is_empty() {
        let present = client.exists(&refs).await.expect("exists");
        for ((id, err), there) in failed.iter().zip(present) {
            if there {
                let got = pool
                    .get(&LOAD.key(*id))
                    .await
                    .expect("present failed put reads");
                assert!(
                    got == LOAD.value(*id),
                    "failed put {id} ({err}) committed other bytes"
                );
            }
        }
    }
}

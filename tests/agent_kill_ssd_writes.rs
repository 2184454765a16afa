//! An agent SIGKILLed while its SSD segment is being written, with real processes on 127.0.0.1:
//! one `kvpool master`, one `kvpool agent run` with 1 MiB of DRAM over an 8 MiB SSD segment
//! (`ssd0`), and this test as a remote client (its own transfer engine). Two writers run until
//! the kill: one puts values straight into `ssd0` (tier SSD) and removes each one a few puts
//! later, so freed ranges are rewritten by new keys (the COMMIT->FREE window of the agent's
//! index, docs/agent.md); the other puts into DRAM, which overflows and is demoted into `ssd0`
//! by the agent's own tasks. The agent is killed after a number of commits, with both writers
//! still going. Once the master has declared it dead it is started again on the same SSD
//! directory and announces what its index recovered. Then every key the test ever wrote is
//! asked for: each one the master lists reads back with exactly the bytes written under it, and
//! the others are absent. Never other bytes: a recovered block whose checksum was taken over
//! another key's bytes would read back as that other key's value. Counts are printed as a
//! `figure:` line (docs/reliability.md).

mod pool_support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvpool_client::pool::PoolClient;
use kvpool_core::master::{PutOptions, Tier};
use parking_lot::Mutex;
use pool_support::load::{Objects, wait_commits};
use pool_support::*;

/// Commits (both writers together) before the kill.
const KILL_AFTER: u64 = 60;
/// The SSD writer removes the key it put this many puts earlier.
const REMOVE_LAG: u64 = 4;
/// Ids of the DRAM writer start here.
const DRAM_IDS: u64 = 1_000_000;

/// Values of 8 KiB to ~130 KiB.
const LOAD: Objects = Objects::new("agent-kill-ssd", 0x55aa).lengths(8192, 30, 4096, 17);

/// What the writers did, by id.
#[derive(Default)]
struct Log {
    /// Every id a put was started for.
    attempted: Vec<u64>,
    committed: u64,
    /// Puts that failed before the kill (no space while eviction catches up).
    failed_before_kill: u64,
    /// Ids whose remove was acknowledged.
    removed: Vec<u64>,
}

/// Puts ids `first..` with `opts` until `stop` (or the first failure once the agent is gone),
/// removing each one `remove_lag` puts later when that is set.
async fn writer(
    pool: PoolClient,
    first: u64,
    opts: PutOptions,
    remove_lag: Option<u64>,
    log: Arc<Mutex<Log>>,
    commits: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) {
    let started = Instant::now();
    for id in first.. {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        assert!(started.elapsed() < DEADLINE, "the writers never stopped");
        log.lock().attempted.push(id);
        match pool.put(&LOAD.key(id), &LOAD.value(id), &opts).await {
            Ok(_) => {
                log.lock().committed += 1;
                commits.fetch_add(1, Ordering::Relaxed);
            }
            // The agent is gone (or a write raced its death): stop like a client would.
            Err(_) if stop.load(Ordering::Relaxed) => return,
            // Before the kill a put can only fail for want of space while eviction catches up.
            Err(_) => {
                log.lock().failed_before_kill += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        if let Some(lag) = remove_lag
            && id >= first + lag
            && pool.master().remove(&LOAD.key(id - lag)).await.is_ok()
        {
            log.lock().removed.push(id - lag);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_killed_during_ssd_writes_never_serves_wrong_bytes() {
    let (dir, key_file, mut master, grpc, client) = test_pool("2s");
    let logs = dir.path();
    let (_ssd_dir, extra, mut a, first_addr) = start_ssd_agent(logs, grpc, &key_file);
    let pool = pool_client(grpc, KEY, "remote-client", |c| c.lanes = 1);

    let log = Arc::new(Mutex::new(Log::default()));
    let commits = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let ssd_only = PutOptions {
        tier: Some(Tier::Ssd),
        ..PutOptions::default()
    };
    let writers = [
        tokio::spawn(writer(
            pool.clone(),
            0,
            ssd_only,
            Some(REMOVE_LAG),
            log.clone(),
            commits.clone(),
            stop.clone(),
        )),
        tokio::spawn(writer(
            pool.clone(),
            DRAM_IDS,
            PutOptions::default(),
            None,
            log.clone(),
            commits.clone(),
            stop.clone(),
        )),
    ];

    wait_commits(&commits, KILL_AFTER, &mut [&mut master, &mut a]).await;
    // A commit becomes durable only once a later feed answer confirmed it: on a loaded machine
    // the confirmations lag the puts, and a kill before any would leave nothing to check. The
    // writers keep going meanwhile.
    wait_metric(
        &first_addr,
        &mut a,
        "kvpool_agent_pool_ssd_commits_confirmed_total",
        &[],
        |v| v >= 10.0,
    )
    .await;
    // Both writers are mid-loop: the kill lands while ssd0 is being written.
    assert!(
        writers.iter().all(|w| !w.is_finished()),
        "writers still running"
    );
    a.kill().expect("SIGKILL agent-a");
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        tokio::time::timeout(DEADLINE, w)
            .await
            .expect("writers stop")
            .expect("writer task");
    }
    wait_stats(&client, "agent-a declared dead", &mut [&mut master], |s| {
        s.nodes_alive == 0
    })
    .await;

    // The same node on the same SSD directory: it replays its index and announces it.
    let (mut a, addr_a) = spawn_ssd_agent(logs, grpc, &key_file, &extra);
    tokio::task::block_in_place(|| {
        a.wait_for_log_line("the SSD announcement", DEADLINE, |l| {
            l.contains("recovered blocks announced") && l.contains("ssd")
        })
    })
    .expect("announced");
    wait_ready(&addr_a, &mut a);
    let adopted = ssd_blocks_adopted(&addr_a, &mut a, |_| true).await;

    let log = std::mem::take(&mut *log.lock());
    let mut present = 0u64;
    let mut resurrected = 0u64;
    let mut wrong: BTreeMap<u64, String> = BTreeMap::new();
    let mut refused = 0u64;
    for &id in &log.attempted {
        if !client
            .exists(&[LOAD.key(id).as_slice()])
            .await
            .expect("exists")[0]
        {
            continue;
        }
        match pool.get(&LOAD.key(id)).await {
            Ok(got) if got == LOAD.value(id) => {
                present += 1;
                if log.removed.contains(&id) {
                    resurrected += 1;
                }
            }
            Ok(got) => {
                wrong.insert(
                    id,
                    format!("{} bytes, crc32c {:08x}", got.len(), crc32c::crc32c(&got)),
                );
            }
            Err(e) => {
                // Refused by the agent's read check: the block was dropped and reported, and
                // the master forgets the replica. Absent, never wrong.
                refused += 1;
                let gone = tokio::time::timeout(DEADLINE, async {
                    while client
                        .exists(&[LOAD.key(id).as_slice()])
                        .await
                        .expect("exists")[0]
                    {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                })
                .await;
                assert!(gone.is_ok(), "object {id} listed but unreadable: {e:#}");
            }
        }
    }
    println!(
        "figure: agent SIGKILLed during SSD writes after {} commits ({} attempted puts, {} \
         failed before the kill, {} removes): {adopted} blocks adopted after the restart, {present} objects read back \
         byte-exact ({resurrected} of them removed before the kill, their FREE not yet \
         applied), {refused} refused by the read check, {} wrong",
        log.committed,
        log.attempted.len(),
        log.failed_before_kill,
        log.removed.len(),
        wrong.len()
    );
    assert!(wrong.is_empty(), "wrong bytes served: {wrong:?}");
    assert!(
        present > 0,
        "nothing came back from the SSD segment: the check proved nothing"
    );
    // The restarted agent still works: a new value reads back.
    pool.put(b"after-the-restart", &LOAD.value(7), &PutOptions::default())
        .await
        .expect("put after the restart");
    assert!(pool.get(b"after-the-restart").await.expect("get") == LOAD.value(7));
}

//! The persistent DRAM tier (`dram.persistence`, files in a tmpfs directory) keeps its committed
//! blocks across agent restarts, with real processes on 127.0.0.1 (a `kvpool master` and
//! `kvpool agent run` processes started with `--dram-persistence-path`, each on its own
//! directory under /dev/shm):
//! - blocks put through the engine API are indexed (the master's segment-event feed reaches
//!   the agent's `dram0` index); the agent is stopped with SIGTERM (or SIGKILL) and one block's
//!   bytes are flipped in its tier file; the restarted agent drops that one at start-up
//!   (`..._dram_blocks_dropped_total{reason="corrupt"}`), the master adopts every other block
//!   at its old offset in `agent-a/dram0`, and each reads back byte-exact;
//! - a remote client keeps putting while the agent is SIGKILLed: after the restart every block
//!   indexed before the kill reads back byte-exact, and no key ever returns wrong bytes (a put
//!   in flight at the kill may be gone);
//! - a rolling update under load: three agents, two replicas, a put/get loop with checksums
//!   while each agent in turn gets SIGTERM and starts again (the next one only once the master
//!   has no under-replicated object, as a rollout waits for readiness): no acknowledged block
//!   is lost, none is ever read wrong;
//! - a garbage index stops the agent with an error naming the file; a truncated tier file
//!   drops the blocks past its end (`reason="truncated"`).
//!
//! Process helpers: `pool_support` over `kvpool_harness`.

mod pool_support;
mod skip_support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvpool_client::pool::PoolClient;
use kvpool_core::master::{PutOptions, Tier};
use kvpool_harness::ChildProcess;
use nix::sys::signal::Signal;
use parking_lot::Mutex;
use pool_support::*;
use tokio_util::sync::CancellationToken;

/// A fresh directory under /dev/shm for one agent's tier, or `None` (after a SKIP line) where
/// /dev/shm is not tmpfs.
fn shm_dir() -> Option<tempfile::TempDir> {
    let ok = std::fs::read_to_string("/proc/mounts").is_ok_and(|m| {
        m.lines()
            .any(|l| l.split(' ').nth(1) == Some("/dev/shm") && l.contains(" tmpfs "))
    });
    if !ok {
        skip_support::skip("/dev/shm is not a tmpfs mount");
        return None;
    }
    Some(tempfile::tempdir_in("/dev/shm").expect("tempdir in /dev/shm"))
}

/// Agent `name` of the pool behind `master` with `dram` of DRAM kept in `tier`.
fn start_persistent(
    dir: &Path,
    name: &str,
    master: std::net::SocketAddr,
    key_file: &Path,
    tier: &Path,
    dram: &str,
) -> (ChildProcess, AgentAddrs) {
    let args = [
        "--dram-persistence-path".to_owned(),
        tier.display().to_string(),
    ];
    start_agent_args(dir, name, master, key_file, dram, "", &args)
}

/// A fresh pool for one persistent agent, `agent-a`, with 4 MiB of DRAM kept in a tmpfs
/// directory.
struct OneAgentPool {
    _shm: tempfile::TempDir,
    tier: PathBuf,
    dir: tempfile::TempDir,
    key_file: PathBuf,
    master: ChildProcess,
    grpc: std::net::SocketAddr,
}

impl OneAgentPool {
    /// `None` (after a SKIP line) where /dev/shm is missing (see [`shm_dir`]).
    fn new() -> Option<Self> {
        let shm = shm_dir()?;
        let (dir, key_file, master, grpc, _) = test_pool("5s");
        Some(Self {
            tier: shm.path().join("tier"),
            _shm: shm,
            dir,
            key_file,
            master,
            grpc,
        })
    }

    /// Starts `agent-a` on the tier, without waiting for it.
    fn spawn_agent(&self) -> (ChildProcess, AgentAddrs) {
        let logs = self.dir.path();
        start_persistent(
            logs,
            "agent-a",
            self.grpc,
            &self.key_file,
            &self.tier,
            "4MiB",
        )
    }

    /// Starts `agent-a` on the tier, once it is ready.
    fn start_agent(&self) -> (ChildProcess, AgentAddrs) {
        let (mut a, addrs) = self.spawn_agent();
        wait_ready(&addrs, &mut a);
        (a, addrs)
    }
}

/// `kvpool_agent_pool_dram_blocks_dropped_total{reason}` of the agent.
async fn dropped(agent: &AgentAddrs, reason: &str) -> Option<f64> {
    let (_, text) = http_get(agent.admin, "/metrics").await.expect("metrics");
    let label = format!("reason=\"{reason}\"");
    metric(
        &text,
        "kvpool_agent_pool_dram_blocks_dropped_total",
        &[label.as_str()],
    )
}

fn block(i: usize) -> Vec<u8> {
    (0..50 * 1024 + i * 7)
        .map(|j: usize| (j.wrapping_mul(31) ^ i.wrapping_mul(7919)) as u8)
        .collect()
}

fn key(i: usize) -> Vec<u8> {
    format!("dram-persist-{i}").into_bytes()
}

/// Flip one byte of segment file `dram0.dat` of `tier` at `at`.
fn corrupt(tier: &Path, at: u64) {
    flip_byte(&tier.join("dram0.dat"), at, 0xa5);
}

/// Offset of the replica of `key` in `agent-a/dram0`.
async fn dram_offset(client: &kvpool_client::master::MasterClient, key: &[u8]) -> Option<u64> {
    replicas(client, key)
        .await
        .ok()?
        .iter()
        .find(|r| r.node == "agent-a" && r.segment == "dram0" && r.tier == Tier::Dram)
        .map(|r| r.offset)
}

/// Where each of `keys` lies in `agent-a/dram0`.
async fn dram_offsets(client: &kvpool_client::master::MasterClient, keys: &[Vec<u8>]) -> Vec<u64> {
    let mut offsets = Vec::new();
    for k in keys {
        offsets.push(dram_offset(client, k).await.expect("in agent-a/dram0"));
    }
    offsets
}

/// Waits until the agent's persistent DRAM index holds `n` blocks.
async fn wait_indexed(addr: &AgentAddrs, agent: &mut ChildProcess, n: usize) {
    let name = "kvpool_agent_pool_dram_index_blocks";
    wait_metric(addr, agent, name, &[], |v| v == n as f64).await;
}

/// Waits until the agent has adopted at least `n` blocks from its tier at start-up; how many
/// it adopted by then.
async fn wait_adopted(addr: &AgentAddrs, agent: &mut ChildProcess, n: f64) -> f64 {
    let name = "kvpool_agent_pool_dram_blocks_adopted_total";
    wait_metric(addr, agent, name, &[], |v| v >= n).await
}

/// Puts `block(i)` under the i-th of `keys` through the agent's engine API, then waits until
/// its persistent index holds every one of them.
async fn put_indexed(addr: &AgentAddrs, agent: &mut ChildProcess, keys: &[Vec<u8>]) {
    put_through(addr, "engine-a", keys, block).await;
    wait_indexed(addr, agent, keys.len()).await;
}

async fn restart_keeps_dram_blocks(sig: Signal) {
    let Some(mut pool) = OneAgentPool::new() else {
        return;
    };
    let (tier, grpc) = (pool.tier.clone(), pool.grpc);
    let (mut a, addr_a) = pool.start_agent();
    let client = master_client(grpc, KEY);

    let n = 24usize;
    let keys: Vec<Vec<u8>> = (0..n).map(key).collect();
    // Every block is durably indexed before the agent goes down.
    put_indexed(&addr_a, &mut a, &keys).await;
    let offsets = dram_offsets(&client, &keys).await;

    a.signal(sig).expect("signal");
    wait_exit(&mut a);
    drop(a);
    // One block's bytes change while the agent is down.
    let bad = 5;
    corrupt(&tier, offsets[bad] + 1000);

    let (mut a, addr_a) = pool.start_agent();
    let adopted = wait_adopted(&addr_a, &mut a, (n - 1) as f64).await;
    assert_eq!(adopted, (n - 1) as f64, "every intact block adopted");
    assert_eq!(
        dropped(&addr_a, "corrupt").await,
        Some(1.0),
        "the changed block is dropped at start-up"
    );
    let mut engine_a = engine(&addr_a, "engine-a2").await;
    for (i, k) in keys.iter().enumerate() {
        if i == bad {
            assert_gone(&client, &mut engine_a, k, "the changed block").await;
            continue;
        }
        assert_eq!(
            dram_offset(&client, k).await,
            Some(offsets[i]),
            "block {i} adopted where it was written"
        );
        let got = engine_a.get(k).await.expect("get").expect("present");
        assert!(got == block(i), "block {i} differs after the restart");
    }
    // The restarted tier keeps working: a new block goes in and reads back.
    let fresh = b"after-restart".to_vec();
    assert_eq!(
        engine_a.put(&fresh, &block(99)).await.expect("put"),
        kvpool_agent::proto::Status::Ok
    );
    assert!(engine_a.get(&fresh).await.expect("get").expect("present") == block(99));
    drop(engine_a);
    a.signal(Signal::SIGTERM).expect("signal");
    wait_exit(&mut a);
    pool.master.assert_running().expect("master");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dram_blocks_survive_a_sigterm_restart() {
    restart_keeps_dram_blocks(Signal::SIGTERM).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dram_blocks_survive_a_sigkill_restart() {
    restart_keeps_dram_blocks(Signal::SIGKILL).await;
}

/// A pool client on its own transfer engine, as another node's engine would be.
fn remote_client(grpc: std::net::SocketAddr, node: &str) -> PoolClient {
    pool_client(grpc, KEY, node, |c| c.lanes = 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkill_during_puts_never_serves_wrong_bytes() {
    let Some(pool) = OneAgentPool::new() else {
        return;
    };
    let grpc = pool.grpc;
    let (mut a, addr_a) = pool.start_agent();
    let remote = Arc::new(remote_client(grpc, "remote-client"));
    let opts = PutOptions {
        replicas: 1,
        tier: Some(Tier::Dram),
        ..PutOptions::default()
    };
    // Eight blocks committed and durably indexed before the loop starts.
    let before = 8usize;
    for i in 0..before {
        remote.put(&key(i), &block(i), &opts).await.expect("put");
    }
    wait_indexed(&addr_a, &mut a, before).await;

    // The loop keeps putting; the agent is killed once eight more were acknowledged, with
    // the loop still running.
    let acked = Arc::new(AtomicU64::new(0));
    let stop = CancellationToken::new();
    let attempted = Arc::new(AtomicU64::new(before as u64));
    let looper = {
        let (remote, acked, stop, attempted) = (
            Arc::clone(&remote),
            Arc::clone(&acked),
            stop.clone(),
            Arc::clone(&attempted),
        );
        let opts = opts.clone();
        tokio::spawn(async move {
            let mut i = before;
            while !stop.is_cancelled() {
                attempted.store(i as u64 + 1, Ordering::SeqCst);
                if remote.put(&key(i), &block(i), &opts).await.is_ok() {
                    acked.fetch_add(1, Ordering::SeqCst);
                } else {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                i += 1;
            }
        })
    };
    while acked.load(Ordering::SeqCst) < 8 {
        a.assert_running().expect("agent running");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    a.signal(Signal::SIGKILL).expect("kill");
    wait_exit(&mut a);
    drop(a);
    stop.cancel();
    looper.await.expect("loop");

    let (mut a, addr_a) = pool.start_agent();
    wait_adopted(&addr_a, &mut a, before as f64).await;
    let total = usize::try_from(attempted.load(Ordering::SeqCst)).expect("count");
    let (mut kept, mut gone) = (0, 0);
    for i in 0..total {
        match remote.get(&key(i)).await {
            Ok(v) => {
                assert!(v == block(i), "key {i} served wrong bytes after the kill");
                kept += 1;
            }
            Err(e) => {
                assert!(i >= before, "block {i} was indexed before the kill: {e}");
                gone += 1;
            }
        }
    }
    assert!(kept >= before, "kept {kept}, gone {gone}");
    println!("{kept} of {total} blocks kept across the SIGKILL ({gone} in flight or unindexed)");
    a.signal(Signal::SIGTERM).expect("signal");
    wait_exit(&mut a);
}

/// A value of the rolling update's loop: small (one page), so that a few thousand fit the
/// pool without eviction.
fn small(i: usize) -> Vec<u8> {
    (0..3000 + i % 1000)
        .map(|j: usize| (j.wrapping_mul(17) ^ i.wrapping_mul(131)) as u8)
        .collect()
}

/// Waits until the loop acknowledged `n` puts, while `procs` run.
async fn wait_acked(tally: &Mutex<LoopTally>, n: usize, procs: &mut [&mut ChildProcess]) {
    let started = std::time::Instant::now();
    while tally.lock().acked.len() < n {
        for p in procs.iter_mut() {
            p.assert_running().expect("running");
        }
        assert!(started.elapsed() < DEADLINE, "the put loop stalled");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// What the put/get loop of the rolling update saw.
#[derive(Debug, Default)]
struct LoopTally {
    acked: Vec<usize>,
    verified: u64,
    get_failed: u64,
    wrong: Vec<usize>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_update_under_load_loses_no_committed_block() {
    let tiers: Vec<tempfile::TempDir> = match (0..3).map(|_| shm_dir()).collect::<Option<_>>() {
        Some(t) => t,
        None => return,
    };
    let (dir, key_file, mut master, grpc, client) = test_pool("5s");
    let logs = dir.path();
    let names = ["agent-a", "agent-b", "agent-c"];
    let tier_of = |i: usize| -> PathBuf { tiers[i].path().join("tier") };
    let mut agents: Vec<(ChildProcess, AgentAddrs)> = (0..3)
        .map(|i| start_persistent(logs, names[i], grpc, &key_file, &tier_of(i), "16MiB"))
        .collect();
    for (p, addr) in &mut agents {
        wait_ready(addr, p);
    }
    let remote = Arc::new(remote_client(grpc, "load-client"));
    let opts = PutOptions {
        replicas: 2,
        tier: Some(Tier::Dram),
        ..PutOptions::default()
    };
    let tally = Arc::new(Mutex::new(LoopTally::default()));
    let stop = CancellationToken::new();
    let looper = {
        let (remote, tally, stop) = (Arc::clone(&remote), Arc::clone(&tally), stop.clone());
        tokio::spawn(async move {
            let mut i = 0usize;
            while !stop.is_cancelled() {
                if remote.put(&key(i), &small(i), &opts).await.is_ok() {
                    tally.lock().acked.push(i);
                }
                // Read back an earlier acknowledged block.
                let probe = {
                    let t = tally.lock();
                    t.acked.get(i / 2 % t.acked.len().max(1)).copied()
                };
                if let Some(j) = probe {
                    match remote.get(&key(j)).await {
                        Ok(v) if v == small(j) => tally.lock().verified += 1,
                        Ok(_) => tally.lock().wrong.push(j),
                        Err(_) => tally.lock().get_failed += 1,
                    }
                }
                i += 1;
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        })
    };
    let acked_now = |t: &Mutex<LoopTally>| t.lock().acked.len();
    for (i, name) in names.iter().enumerate() {
        // Load before each roll.
        let target = acked_now(&tally) + 10;
        let mut procs: Vec<&mut ChildProcess> = agents.iter_mut().map(|(p, _)| p).collect();
        wait_acked(&tally, target, &mut procs).await;
        let (mut old, old_addr) = agents.remove(i);
        let (_, text) = http_get(old_addr.admin, "/metrics").await.expect("metrics");
        let indexed = metric(&text, "kvpool_agent_pool_dram_index_blocks", &[]).unwrap_or(0.0);
        old.signal(Signal::SIGTERM).expect("signal");
        wait_exit(&mut old);
        drop(old);
        let (mut p, addr) = start_persistent(logs, name, grpc, &key_file, &tier_of(i), "16MiB");
        wait_ready(&addr, &mut p);
        // What it held comes back (some may be refused: the master may have placed new
        // replicas over them between the mount and the announcement).
        if indexed > 0.0 {
            wait_adopted(&addr, &mut p, 1.0).await;
        }
        agents.insert(i, (p, addr));
        // A rollout moves on once the pool is whole again.
        let mut procs: Vec<&mut ChildProcess> = agents.iter_mut().map(|(p, _)| p).collect();
        procs.push(&mut master);
        wait_stats(&client, "pool whole again", &mut procs, |s| {
            s.nodes_alive == 3 && s.under_replicated == 0 && s.tasks == 0
        })
        .await;
    }
    let target = acked_now(&tally) + 10;
    let mut procs: Vec<&mut ChildProcess> = agents.iter_mut().map(|(p, _)| p).collect();
    wait_acked(&tally, target, &mut procs).await;
    stop.cancel();
    looper.await.expect("loop");

    let t = std::mem::take(&mut *tally.lock());
    assert!(t.wrong.is_empty(), "wrong bytes served for {:?}", t.wrong);
    let mut lost = Vec::new();
    for &i in &t.acked {
        match remote.get(&key(i)).await {
            Ok(v) => assert!(v == small(i), "block {i} differs after the rollout"),
            Err(_) => lost.push(i),
        }
    }
    assert!(lost.is_empty(), "acknowledged blocks lost: {lost:?}");
    assert!(
        t.acked.len() >= 40,
        "the loop ran through the rollout: {t:?}"
    );
    println!(
        "{} blocks acknowledged, {} reads verified, {} reads failed over, none lost or wrong",
        t.acked.len(),
        t.verified,
        t.get_failed
    );
    for (p, _) in &mut agents {
        p.signal(Signal::SIGTERM).expect("signal");
        wait_exit(p);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_tier_is_refused_or_trimmed_never_served() {
    let Some(pool) = OneAgentPool::new() else {
        return;
    };
    let (tier, grpc) = (pool.tier.clone(), pool.grpc);
    let (mut a, addr_a) = pool.start_agent();
    let client = master_client(grpc, KEY);
    let keys: Vec<Vec<u8>> = (0..6).map(key).collect();
    put_indexed(&addr_a, &mut a, &keys).await;
    let offsets = dram_offsets(&client, &keys).await;
    a.signal(Signal::SIGTERM).expect("signal");
    wait_exit(&mut a);
    drop(a);

    // Cut the file inside the last block: that one (and any block past the cut) is dropped.
    let last = (0..6).max_by_key(|&i| offsets[i]).expect("blocks");
    let data = tier.join("dram0.dat");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&data)
        .expect("tier file")
        .set_len(offsets[last] + 100)
        .expect("truncate");
    let (mut a, addr_a) = pool.start_agent();
    wait_adopted(&addr_a, &mut a, 5.0).await;
    assert_eq!(dropped(&addr_a, "truncated").await, Some(1.0));
    let mut engine_a = engine(&addr_a, "engine-a2").await;
    for (i, k) in keys.iter().enumerate() {
        let got = engine_a.get(k).await.expect("get");
        if i == last {
            assert!(got.is_none(), "the cut block is never served");
        } else {
            assert!(got.expect("present") == block(i), "block {i}");
        }
    }
    drop(engine_a);
    a.signal(Signal::SIGTERM).expect("signal");
    wait_exit(&mut a);
    drop(a);

    // Garbage in the index: the agent refuses to start and names the file.
    let index = tier.join("dram0.idx");
    std::fs::write(&index, b"this is not a kvpool index at all").expect("garbage");
    let (mut a, _) = pool.spawn_agent();
    let status = tokio::task::block_in_place(|| a.wait_timeout(DEADLINE)).expect("exits");
    assert!(!status.success(), "a garbage index stops the agent");
    let log = a.log_text();
    assert!(
        log.contains(&index.display().to_string()) && log.contains("bad magic"),
        "the error names the index file:\n{log}"
    );
}

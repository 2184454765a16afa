//! Links cut mid-transfer at pool level, with real processes in network namespaces this test
//! creates (needs root and iproute2): a `kvpool master` and two `kvpool agent run` processes in a
//! "hub" namespace, a third agent (`agent-x`) alone in an "island" namespace joined to the hub by
//! a veth pair (10.201.<n>.0/30), and this test as the client in the hub (a thread that joined
//! it, with its runtime's threads). A writer puts checksummed values with two replicas in a
//! loop while a reader reads committed ones back. The link to agent-x is cut twice while
//! transfers to and from it are in flight, once by `ip link set down` and once silently (both
//! ends up, every frame dropped: the sockets stay half-alive), and restored after each cut.
//! Asserted: no acknowledged put is lost, zero wrong bytes are read, every call that failed
//! during a cut failed within [`CALL_BOUND`] with an error naming the cut agent, the master
//! declares agent-x dead and repairs every object to two replicas on the hub's agents, and
//! once the link is back agent-x rejoins (mounts again, its old replicas dropped: no object
//! points at them) and takes new replicas. The times are printed as `figure:` lines
//! (docs/reliability.md).

mod netns_support;
mod pool_support;
mod skip_support;

use std::collections::HashMap;
use std::fs::File;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvpool_client::master::MasterClient;
use kvpool_client::pool::PoolClient;
use kvpool_core::master::PutOptions;
use kvpool_harness::{AgentSpec, ChildProcess, Launcher, MasterSpec, free_port};
use netns_support::{Cut, HubAndIsland, running_as_root};
use parking_lot::Mutex;
use pool_support::load::{Objects, join_tasks};
use pool_support::*;

/// The master declares an agent dead after this long without a heartbeat.
const HEARTBEAT_TIMEOUT: &str = "2s";
/// The client's transfer timeout (and TCP connect timeout).
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(2);
/// The most a call may take to fail when its agent is cut off: the transfer timeout for the
/// write or read, a retry on the other replica, and the master calls around it, with room for
/// a loaded 2-core box. Only a hang exceeds it.
const CALL_BOUND: Duration = Duration::from_secs(30);
/// Each agent's DRAM: the objects of a run (about 130, 0.5 MiB on average, 2 replicas) fit on
/// the two agents left during a cut, so that nothing is evicted (an evicted object is absent,
/// not lost, and would blur the count).
const DRAM: &str = "256MiB";
/// The cut agent.
const CUT: &str = "agent-x";
/// Puts with a replica on agent-x before each cut (so that it takes writes and serves reads).
const ON_X_BEFORE_CUT: u64 = 8;

/// Values of 64 KiB to ~1 MiB.
const LOAD: Objects = Objects::new("netns-cut", 0x6e65_7463).lengths(64 * 1024, 16, 61_440, 13);

/// A failed put or get.
struct Failure {
    id: u64,
    op: &'static str,
    at: Instant,
    took: Duration,
    error: String,
}

#[derive(Default)]
struct Log {
    /// id -> crc32c of each acknowledged put.
    committed: HashMap<u64, u32>,
    /// Acknowledged puts with a replica on agent-x.
    on_x: u64,
    failures: Vec<Failure>,
    /// Reads that returned bytes other than those written: (id, what happened).
    wrong: Vec<(u64, String)>,
    /// Where the cuts stand (for the failure messages), and since when.
    phase: (String, Option<Instant>),
    reads: u64,
    /// The slowest read that succeeded.
    slowest_read: Duration,
}

/// Agent `name` listening on `ip` (its transfer engine and admin server), in namespace `netns`
/// when given (through `ip netns exec`, which execs the agent: the child is the agent).
fn start_agent_on(
    dir: &Path,
    name: &str,
    master: SocketAddr,
    key_file: &Path,
    ip: IpAddr,
    netns: Option<&str>,
) -> ChildProcess {
    let admin = SocketAddr::new(ip, free_port().expect("port"));
    let spec = AgentSpec::new(KVPOOL, dir.join(name), name, DRAM)
        .fixture(&sysfs_fixture())
        .admin(admin)
        .pool(master, key_file, "200ms")
        .transport_listen(&format!("{ip}:0"));
    let launcher = Launcher::new(dir);
    let Some(ns) = netns else {
        return spec.spawn(&launcher).expect("kvpool agent").process;
    };
    spec.write_config().expect("agent config");
    let agent = spec.command();
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns])
        .arg(agent.get_program())
        .args(agent.get_args());
    for (var, val) in agent.get_envs() {
        match val {
            Some(v) => cmd.env(var, v),
            None => cmd.env_remove(var),
        };
    }
    launcher
        .spawn(name, &mut cmd)
        .expect("kvpool agent in its namespace")
}

/// The nodes holding each committed object, from the master (leases released at once).
async fn holders(client: &MasterClient, ids: &[u64]) -> HashMap<u64, Vec<String>> {
    let mut all = HashMap::new();
    for &id in ids {
        let nodes = replica_nodes(client, &LOAD.key(id)).await;
        all.insert(
            id,
            nodes.unwrap_or_else(|e| panic!("acknowledged object {id} lost: {e:#}")),
        );
    }
    all
}

/// The writer: puts object after object until `stop`, retrying a failed put like a real client
/// (the master places replicas on a cut agent until it declares it dead).
async fn write_loop(pool: PoolClient, log: Arc<Mutex<Log>>, stop: Arc<AtomicBool>) {
    let opts = PutOptions {
        replicas: 2,
        ..PutOptions::default()
    };
    let mut id = 0;
    while !stop.load(Ordering::Relaxed) {
        let v = LOAD.value(id);
        let first = Instant::now();
        loop {
            let at = Instant::now();
            match pool.put(&LOAD.key(id), &v, &opts).await {
                Ok(replicas) => {
                    let mut l = log.lock();
                    l.committed.insert(id, crc32c::crc32c(&v));
                    l.on_x += u64::from(replicas.iter().any(|r| r.node == CUT));
                    break;
                }
                Err(e) => {
                    log.lock().failures.push(Failure {
                        id,
                        op: "put",
                        at,
                        took: at.elapsed(),
                        error: error_chain(&e),
                    });
                    assert!(
                        first.elapsed() < DEADLINE,
                        "put {id} never succeeded: {e:#}"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        id += 1;
    }
}

/// The reader: reads acknowledged objects until `stop`, each checked against its checksum.
async fn read_loop(pool: PoolClient, log: Arc<Mutex<Log>>, stop: Arc<AtomicBool>) {
    let mut n = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let pick = {
            let l = log.lock();
            let len = l.committed.len();
            (len > 0).then(|| {
                // Mostly the newest objects (on agent-x two times in three), some old ones.
                let id = if n.is_multiple_of(3) {
                    (n * 7919) % len
                } else {
                    len - 1 - n % len.min(8)
                };
                (id as u64, l.committed[&(id as u64)])
            })
        };
        n += 1;
        let Some((id, crc)) = pick else {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        let at = Instant::now();
        let got = pool.get(&LOAD.key(id)).await;
        let took = at.elapsed();
        let mut l = log.lock();
        match got {
            Ok(bytes) => {
                l.reads += 1;
                l.slowest_read = l.slowest_read.max(took);
                if crc32c::crc32c(&bytes) != crc || bytes.len() != LOAD.value(id).len() {
                    let (phase, since) = &l.phase;
                    let what = format!(
                        "object {id}: {} bytes, wrong checksum, read in {took:?} starting {:?} \
                         after the {phase}",
                        bytes.len(),
                        since.map(|t| at.saturating_duration_since(t))
                    );
                    l.wrong.push((id, what));
                }
            }
            Err(e) => l.failures.push(Failure {
                id,
                op: "get",
                at,
                took,
                error: error_chain(&e),
            }),
        }
    }
}

/// Polls the log until `done` holds.
async fn wait_log(log: &Mutex<Log>, what: &str, done: impl Fn(&Log) -> bool) {
    let started = Instant::now();
    while !done(&log.lock()) {
        assert!(started.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Starts the log's phase `phase` now and waits (for `what`) until the master counts `alive` live
/// nodes: when the phase started, and how long the wait took.
async fn phase_until_alive(
    client: &MasterClient,
    procs: &mut [&mut ChildProcess],
    log: &Mutex<Log>,
    phase: String,
    what: &str,
    alive: u64,
) -> (Instant, Duration) {
    let started = Instant::now();
    log.lock().phase = (phase, Some(started));
    wait_stats(client, what, procs, |s| s.nodes_alive == alive).await;
    (started, started.elapsed())
}

/// One cut of the link to agent-x under load, then its restoration; returns the figure line.
async fn cut_and_restore(
    net: &HubAndIsland,
    how: Cut,
    client: &MasterClient,
    log: &Mutex<Log>,
    procs: &mut [&mut ChildProcess],
) -> String {
    // agent-x takes writes (and so serves reads) right before the cut.
    let on_x = log.lock().on_x;
    wait_log(log, "puts landing on agent-x", |l| {
        l.on_x >= on_x + ON_X_BEFORE_CUT
    })
    .await;
    let committed_at_cut = log.lock().committed.len();
    net.cut(how).expect("cut the link");
    let phase = format!("{how:?} cut");
    let (cut, noticed) =
        phase_until_alive(client, procs, log, phase, "agent-x declared dead", 2).await;
    wait_stats(client, "two replicas on the hub's agents", procs, |s| {
        s.under_replicated == 0 && s.tasks == 0
    })
    .await;
    let repaired = cut.elapsed();
    let ids: Vec<u64> = log.lock().committed.keys().copied().collect();
    for (id, nodes) in holders(client, &ids).await {
        assert_eq!(nodes.len(), 2, "object {id} has replicas on {nodes:?}");
        assert_ne!(nodes[0], nodes[1], "object {id}: both replicas on one node");
        assert!(
            !nodes.iter().any(|n| n == CUT),
            "object {id} still on the cut {CUT}"
        );
    }

    net.restore(how).expect("restore the link");
    let phase = format!("{how:?} restore");
    let (restored, rejoined) =
        phase_until_alive(client, procs, log, phase, "agent-x back in the pool", 3).await;
    // It takes new replicas again.
    let on_x = log.lock().on_x;
    wait_log(log, "puts landing on agent-x again", |l| l.on_x > on_x).await;
    let used = restored.elapsed();

    let l = log.lock();
    let during: Vec<&Failure> = l.failures.iter().filter(|f| f.at + f.took >= cut).collect();
    for f in &during {
        assert!(
            f.took <= CALL_BOUND,
            "{} of object {} took {:?} to fail: {}",
            f.op,
            f.id,
            f.took,
            f.error
        );
        assert!(
            f.error.contains(CUT) || f.error.contains(&net.island_ip.to_string()),
            "{} of object {} failed with an error that does not name the cut agent: {}",
            f.op,
            f.id,
            f.error
        );
    }
    // A put that met the cut was placed again without agent-x (the writer names it to the
    // master, which places nothing more there until it is heard from): no put failed.
    let puts_failed: Vec<&&Failure> = during.iter().filter(|f| f.op == "put").collect();
    assert!(
        puts_failed.is_empty(),
        "puts failed during the cut instead of moving off {CUT}: {:?}",
        puts_failed.iter().map(|f| &f.error).collect::<Vec<_>>()
    );
    let slowest_fail = during.iter().map(|f| f.took).max().unwrap_or_default();
    format!(
        "figure: link to 1 of 3 agents cut by {how:?} under a put/get loop ({committed_at_cut} \
         objects acknowledged by then, 2 replicas, heartbeat timeout {HEARTBEAT_TIMEOUT}, \
         transfer timeout {TRANSFER_TIMEOUT:?}): {} calls failed during the cut (puts {}, gets \
         {}), the slowest after {slowest_fail:?}; declared dead after {noticed:?}, 2 replicas \
         again after {repaired:?}; link restored: rejoined after {rejoined:?}, new replicas on \
         it after {used:?}",
        during.len(),
        during.iter().filter(|f| f.op == "put").count(),
        during.iter().filter(|f| f.op == "get").count(),
    )
}

async fn scenario(net: &HubAndIsland) {
    let dir = tempfile::tempdir().expect("tempdir");
    let logs = dir.path();
    let key_file = write_key(logs, KEY);
    let mut spec = MasterSpec::new(KVPOOL, &key_file).expect("ports");
    // On the hub's veth address: the island reaches it there.
    spec.grpc = SocketAddr::new(net.hub_ip, spec.grpc.port());
    let m = spec
        .args([
            "--heartbeat-timeout",
            HEARTBEAT_TIMEOUT,
            "--tick-interval",
            "100ms",
        ])
        .start(&Launcher::new(logs), "master", DEADLINE)
        .expect("kvpool master");
    let (mut master, grpc) = (m.process, m.grpc);
    let mut a = start_agent_on(logs, "agent-a", grpc, &key_file, net.hub_ip, None);
    let mut b = start_agent_on(logs, "agent-b", grpc, &key_file, net.hub_ip, None);
    let mut x = start_agent_on(logs, CUT, grpc, &key_file, net.island_ip, Some(&net.island));
    let client = master_client(grpc, KEY);
    wait_mounted(&client, 3, &mut [&mut master, &mut a, &mut b, &mut x]).await;

    let pool = pool_client(grpc, KEY, "test-client", |c| {
        c.prefer_shm = false;
        c.timeout = TRANSFER_TIMEOUT;
        c.connect_timeout = TRANSFER_TIMEOUT;
    });
    let log = Arc::new(Mutex::new(Log::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = tokio::spawn(write_loop(pool.clone(), log.clone(), stop.clone()));
    let reader = tokio::spawn(read_loop(pool.clone(), log.clone(), stop.clone()));

    let mut figures = Vec::new();
    for how in [Cut::LinkDown, Cut::Silent] {
        figures.push(
            cut_and_restore(
                net,
                how,
                &client,
                &log,
                &mut [&mut master, &mut a, &mut b, &mut x],
            )
            .await,
        );
    }
    stop.store(true, Ordering::Relaxed);
    join_tasks([writer, reader]).await;

    // Every acknowledged put reads back exactly, and the master's counters agree.
    let l = std::mem::take(&mut *log.lock());
    if !l.wrong.is_empty() {
        // Whether the pool holds wrong bytes, or one read returned them.
        let mut report = Vec::new();
        for (id, what) in &l.wrong {
            let now = match pool.get(&LOAD.key(*id)).await {
                Ok(b) if b == LOAD.value(*id) => "reads right now".to_owned(),
                Ok(b) => format!("reads wrong again ({} bytes)", b.len()),
                Err(e) => format!("unreadable now: {}", error_chain(&e)),
            };
            report.push(format!("{what}; {now}"));
        }
        panic!("wrong bytes read: {report:?}");
    }
    let stats = wait_stats(
        &client,
        "every object at two replicas",
        &mut [&mut master, &mut a, &mut b, &mut x],
        |s| s.under_replicated == 0 && s.tasks == 0 && s.nodes_alive == 3,
    )
    .await;
    assert_eq!(
        stats.objects,
        l.committed.len() as u64,
        "objects known to the master"
    );
    LOAD.assert_read_back(&pool, &l.committed, "acknowledged object")
        .await;
    let ids: Vec<u64> = l.committed.keys().copied().collect();
    for (id, nodes) in holders(&client, &ids).await {
        assert_eq!(nodes.len(), 2, "object {id} has replicas on {nodes:?}");
    }
    for f in figures {
        println!("{f}");
    }
    println!(
        "figure: {} objects acknowledged, {} on {CUT}, {} concurrent reads (the slowest \
         {:?}), {} failed calls in all; 0 acknowledged objects lost, 0 wrong bytes read",
        l.committed.len(),
        l.on_x,
        l.reads,
        l.slowest_read,
        l.failures.len()
    );
}

#[test]
fn a_pool_survives_cut_links_to_an_agent() {
    if !running_as_root() {
        skip_support::skip("needs root to create network namespaces");
        return;
    }
    let n = (std::process::id() % 250 + 1) as u8;
    let net = match HubAndIsland::create(n) {
        Ok(net) => net,
        Err(e) => {
            skip_support::skip(&format!("cannot create network namespaces: {e}"));
            return;
        }
    };
    // The master, the hub's agents and the client's sockets live in the hub: a thread joins it
    // and everything it starts (runtime threads, child processes) inherits it.
    let result = std::thread::scope(|s| {
        s.spawn(|| {
            let joined = File::open(net.hub_path())
                .map_err(|e| e.to_string())
                .and_then(|fd| {
                    nix::sched::setns(&fd, nix::sched::CloneFlags::CLONE_NEWNET)
                        .map_err(|e| e.to_string())
                });
            if let Err(e) = joined {
                skip_support::skip(&format!("cannot join namespace {}: {e}", net.hub));
                return;
            }
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(4)
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(scenario(&net));
        })
        .join()
    });
    drop(net);
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

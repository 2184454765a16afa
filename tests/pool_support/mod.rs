//! What the root tests share on top of `kvpool_harness`: the `kvpool` binary of this build, the
//! agent's fixture machine, a real `kvpool master` and real `kvpool agent run` processes on
//! 127.0.0.1 with their logs in the test's directory (master_kill_under_load, master_striping,
//! agent_pool_*, agent_transport_report), a local-only agent for the engine tests
//! (synthetic_engine, conductor_http), clients of them, a put-and-read load (`load`), puts and
//! checks of single objects, polls of the master's stats and the agents' metrics, a directory
//! with an etcd for the HA tests (master_ha, master_failover_under_load), and an in-process
//! master (master_service, master_coalescing). Failures panic with the process's log tail.
//! I/O boundary: child processes, loopback sockets, temp dirs.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool_agent::api::client::EngineClient;
use kvpool_client::master::{ClientConfig, ClientError, Located, MasterClient};
use kvpool_client::pool::PoolClient;
use kvpool_core::master::{PutOptions, PutStarted, ReplicaInfo, SegmentSpec, Tier};
use kvpool_harness::{
    AgentSpec, ChildProcess, EtcdServer, Launcher, MasterProcess, MasterSpec, Probe, free_addr,
    http,
};
use kvpool_master::cmd::{MasterArgs, RunningMaster, start};
use kvpool_proto::auth::AuthKey as MasterKey;
use kvpool_proto::master::StatsResponse;
use kvpool_transfer::{AuthKey, EngineConfig, StaticDirectory, TransferEngine, TransferMetrics};
use tokio_util::sync::CancellationToken;

pub mod load;

pub use kvpool_harness::scrape::metric_value as metric;

pub const KVPOOL: &str = env!("CARGO_BIN_EXE_kvpool");
/// The pool key of the agent tests.
pub const KEY: &str = "pool-wiring-test-key-0123456789abcdef";
/// Only a hang reaches it on a loaded 2-core box.
pub const DEADLINE: Duration = Duration::from_secs(180);

/// The one-NUMA-node, no-RDMA machine of the agent's tests (`sys` and `proc` below it).
pub fn sysfs_fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("agent/tests/fixtures/tcp-single")
}

/// Writes `key` to `dir/pool.key` and returns its path.
pub fn write_key(dir: &Path, key: impl AsRef<[u8]>) -> PathBuf {
    let key_file = dir.join("pool.key");
    std::fs::write(&key_file, key).expect("key file");
    key_file
}

/// The directory `dir/ssd` and the agent config lines of an 8 MiB SSD tier in it (the `extra`
/// of [`start_agent_with`]).
pub fn ssd_tier(dir: &Path) -> (PathBuf, String) {
    let ssd_dir = dir.join("ssd");
    let extra = format!("ssd:\n  path: {}\n  capacity: 8MiB\n", ssd_dir.display());
    (ssd_dir, extra)
}

/// A `kvpool master` started with `args` added, logging into `dir/master.log`, once its gRPC
/// port listens. Agents beat every 200 ms: `heartbeat_timeout` is short enough to keep a test
/// quick and long enough for a loaded box.
pub fn start_master(
    dir: &Path,
    key_file: &Path,
    heartbeat_timeout: &str,
    args: &[&str],
) -> MasterProcess {
    MasterSpec::new(KVPOOL, key_file)
        .expect("ports")
        .args([
            "--heartbeat-timeout",
            heartbeat_timeout,
            "--tick-interval",
            "100ms",
        ])
        .args(args.iter().copied())
        .start(&Launcher::new(dir), "master", DEADLINE)
        .expect("kvpool master")
}

/// Master `name` of an HA group that campaigns in the etcd at `etcd` under `prefix` (election
/// TTL 2 s), started with `args` added, once its admin server listens; it logs into
/// `dir/<name>.log`.
pub fn spawn_ha_master(
    dir: &Path,
    key_file: &Path,
    etcd: &str,
    prefix: &str,
    name: &str,
    args: &[&str],
) -> MasterProcess {
    let spec = MasterSpec::new(KVPOOL, key_file).expect("ports");
    let grpc = spec.grpc.to_string();
    let mut m = spec
        .args(["--advertise-addr", &grpc])
        .args(["--etcd-endpoints", etcd, "--etcd-prefix", prefix])
        .args(["--election-ttl", "2s"])
        .args(args.iter().copied())
        .spawn(&Launcher::new(dir), name)
        .expect("spawn master");
    m.process
        .wait_ready(&Probe::Tcp(m.admin), DEADLINE)
        .expect("master up");
    m
}

/// What an HA test reports when it skips for want of etcd.
pub const ETCD_MISSING: &str = "etcd binary not installed (Debian package etcd-server)";

/// For the HA tests: a fresh temporary directory, the key file ([`write_key`]) with `key` in it
/// and an etcd serving from that directory; None where etcd is not installed.
pub fn etcd_dir(key: impl AsRef<[u8]>) -> Option<(tempfile::TempDir, PathBuf, EtcdServer)> {
    if !EtcdServer::available() {
        return None;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let key_file = write_key(dir.path(), key);
    let etcd = EtcdServer::start(dir.path()).expect("etcd");
    Some((dir, key_file, etcd))
}

/// A master client over all of `masters`, keyed with `key`, that follows a failover for up to
/// 30 s.
pub fn ha_master_client(masters: &[SocketAddr], key: &[u8]) -> MasterClient {
    MasterClient::new(
        masters.iter().map(SocketAddr::to_string).collect(),
        MasterKey::from_bytes(key).expect("master key"),
        ClientConfig {
            failover_budget: Duration::from_secs(30),
            ..ClientConfig::default()
        },
    )
    .expect("master client")
}

/// A pool in a fresh temporary directory, which also holds the logs and the agents' folders:
/// the directory, the key file ([`KEY`]), a `kvpool master` (see [`start_master`] for
/// `heartbeat_timeout`), its gRPC address and a client of it.
pub fn test_pool(
    heartbeat_timeout: &str,
) -> (
    tempfile::TempDir,
    PathBuf,
    ChildProcess,
    SocketAddr,
    MasterClient,
) {
    let (dir, key_file, m, client) = test_pool_with(heartbeat_timeout, &[]);
    (dir, key_file, m.process, m.grpc, client)
}

/// Like [`test_pool`], the master started with `args` added and returned whole.
pub fn test_pool_with(
    heartbeat_timeout: &str,
    args: &[&str],
) -> (tempfile::TempDir, PathBuf, MasterProcess, MasterClient) {
    let dir = tempfile::tempdir().expect("tempdir");
    let key_file = write_key(dir.path(), KEY);
    let m = start_master(dir.path(), &key_file, heartbeat_timeout, args);
    let client = master_client(m.grpc, KEY);
    (dir, key_file, m, client)
}

/// `N` agents `agent-a`, `agent-b`, ... of the pool in `dir` (see [`start_agent`]), each with
/// `dram` of DRAM, without waiting for them.
pub fn start_agents<const N: usize>(
    dir: &Path,
    master: SocketAddr,
    key_file: &Path,
    dram: &str,
) -> [ChildProcess; N] {
    std::array::from_fn(|i| {
        let name = format!("agent-{}", char::from(b'a' + i as u8));
        start_agent(dir, &name, master, key_file, dram).0
    })
}

/// Polls the master's stats until `n` agents are alive with at least a segment each, while
/// every one of `procs` runs.
pub async fn wait_mounted(
    client: &MasterClient,
    n: u64,
    procs: &mut [&mut ChildProcess],
) -> StatsResponse {
    wait_stats(client, &format!("{n} agents mounted"), procs, |s| {
        s.nodes_alive == n && s.segments >= n
    })
    .await
}

/// `agent-a` of the pool in `dir` with 1 MiB of DRAM over an 8 MiB SSD tier (so most blocks
/// are demoted), once ready: the SSD directory, the tier's config lines (to restart the agent
/// with), the agent and its addresses.
pub fn start_ssd_agent(
    dir: &Path,
    master: SocketAddr,
    key_file: &Path,
) -> (PathBuf, String, ChildProcess, AgentAddrs) {
    let (ssd_dir, extra) = ssd_tier(dir);
    let (mut agent, addrs) = spawn_ssd_agent(dir, master, key_file, &extra);
    wait_ready(&addrs, &mut agent);
    (ssd_dir, extra, agent, addrs)
}

/// The agent of [`start_ssd_agent`] with the SSD tier config lines `extra` (to start it again on
/// the same directory), without waiting for it.
pub fn spawn_ssd_agent(
    dir: &Path,
    master: SocketAddr,
    key_file: &Path,
    extra: &str,
) -> (ChildProcess, AgentAddrs) {
    start_agent_with(dir, "agent-a", master, key_file, "1MiB", extra)
}

/// Polls the agent's count of SSD blocks adopted at start-up until `done` holds for it.
pub async fn ssd_blocks_adopted(
    agent: &AgentAddrs,
    proc: &mut ChildProcess,
    done: impl Fn(f64) -> bool,
) -> f64 {
    wait_metric(
        agent,
        proc,
        "kvpool_agent_pool_ssd_blocks_adopted_total",
        &[],
        done,
    )
    .await
}

/// Where a started agent can be reached.
pub struct AgentAddrs {
    pub admin: SocketAddr,
    pub socket: PathBuf,
}

/// An agent `name` of the pool behind `master` with `dram` of DRAM tier on the fixture machine,
/// in `dir/<name>` and logging into `dir/<name>.log`.
pub fn start_agent(
    dir: &Path,
    name: &str,
    master: SocketAddr,
    key_file: &Path,
    dram: &str,
) -> (ChildProcess, AgentAddrs) {
    start_agent_with(dir, name, master, key_file, dram, "")
}

/// Like [`start_agent`]; `extra` is appended to the config right after `pool:`'s own lines
/// (indented lines such as `"  replicas: 2\n"` continue it, others add sections such as
/// `ssd:`).
pub fn start_agent_with(
    dir: &Path,
    name: &str,
    master: SocketAddr,
    key_file: &Path,
    dram: &str,
    extra: &str,
) -> (ChildProcess, AgentAddrs) {
    start_agent_args(dir, name, master, key_file, dram, extra, &[])
}

/// Like [`start_agent_with`], with `args` after `run --config <file>`.
pub fn start_agent_args(
    dir: &Path,
    name: &str,
    master: SocketAddr,
    key_file: &Path,
    dram: &str,
    extra: &str,
    args: &[String],
) -> (ChildProcess, AgentAddrs) {
    let admin = free_addr().expect("port");
    let a = AgentSpec::new(KVPOOL, dir.join(name), name, dram)
        .fixture(&sysfs_fixture())
        .admin(admin)
        .pool(master, key_file, "200ms")
        .section(extra)
        .args(args.iter().cloned())
        .spawn(&Launcher::new(dir))
        .expect("kvpool agent");
    (
        a.process,
        AgentAddrs {
            admin,
            socket: a.socket,
        },
    )
}

/// Puts `value(i)` under the i-th key through a session `name` of the agent's engine API,
/// closed after (see [`put_each`]).
pub async fn put_through(
    agent: &AgentAddrs,
    name: &str,
    keys: &[Vec<u8>],
    value: impl Fn(usize) -> Vec<u8>,
) {
    let mut session = engine(agent, name).await;
    put_each(&mut session, keys, value).await;
}

/// `n` keys `<stem>-0`, `<stem>-1`, ...
pub fn numbered_keys(stem: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| format!("{stem}-{i}").into_bytes()).collect()
}

/// Puts `value(i)` under the i-th key through the engine API, asserting each put succeeds.
pub async fn put_each(
    engine: &mut EngineClient,
    keys: &[Vec<u8>],
    value: impl Fn(usize) -> Vec<u8>,
) {
    for (i, key) in keys.iter().enumerate() {
        let status = engine.put(key, &value(i)).await.expect("put");
        assert_eq!(status, kvpool_agent::proto::Status::Ok, "put {i}");
    }
}

/// Asserts that `key` is neither announced by the master nor served by the agent behind
/// `engine`; `what` names the key in the failure.
pub async fn assert_gone(client: &MasterClient, engine: &mut EngineClient, key: &[u8], what: &str) {
    assert!(
        !client.exists(&[key]).await.expect("exists")[0],
        "{what} is announced"
    );
    assert!(
        engine.get(key).await.expect("get").is_none(),
        "{what} is served"
    );
}

/// A local-only agent (no pool) with 16 MiB of DRAM in `dir`, once its engine-API socket
/// accepts connections; returns it and the socket.
pub fn start_local_agent(dir: &Path) -> (ChildProcess, PathBuf) {
    let mut a = AgentSpec::new(KVPOOL, dir, "test-node", "16MiB")
        .fixture(&sysfs_fixture())
        .spawn(&Launcher::new(dir))
        .expect("kvpool agent");
    a.process
        .wait_ready(&Probe::Unix(a.socket.clone()), DEADLINE)
        .expect("agent socket");
    (a.process, a.socket)
}

/// Blocks (off the async workers when on a multi-threaded runtime) until the agent's `/readyz`
/// answers 200.
pub fn wait_ready(agent: &AgentAddrs, proc: &mut ChildProcess) {
    tokio::task::block_in_place(|| proc.wait_ready(&Probe::readyz(agent.admin), DEADLINE))
        .expect("agent ready");
}

/// Waits for the process to exit (after a signal).
pub fn wait_exit(proc: &mut ChildProcess) {
    tokio::task::block_in_place(|| proc.wait_timeout(DEADLINE)).expect("exit");
}

/// `GET path`: (status code, body); None while nothing answers.
pub async fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    http::get_async(addr, path)
        .await
        .map(|r| (r.status, r.body))
}

/// A client of the master at `grpc`, keyed with `key`.
pub fn master_client(grpc: SocketAddr, key: impl AsRef<[u8]>) -> MasterClient {
    MasterClient::new(
        vec![grpc.to_string()],
        MasterKey::from_bytes(key.as_ref()).expect("master key"),
        ClientConfig::default(),
    )
    .expect("master client")
}

/// A transfer engine of a client node `node` keyed with `key`; `tune` changes its config.
pub fn client_engine(
    node: &str,
    key: &str,
    tune: impl FnOnce(&mut EngineConfig),
) -> TransferEngine {
    let mut config = EngineConfig {
        node: node.into(),
        ..EngineConfig::default()
    };
    tune(&mut config);
    TransferEngine::new(
        config,
        AuthKey::new(key.as_bytes().to_vec()).expect("transfer key"),
        Arc::new(StaticDirectory::new()),
        TransferMetrics::unregistered().expect("metrics"),
    )
    .expect("engine")
}

/// A pool client of node `node` on its own transfer engine (see [`client_engine`]).
pub fn pool_client(
    grpc: SocketAddr,
    key: &str,
    node: &str,
    tune: impl FnOnce(&mut EngineConfig),
) -> PoolClient {
    let engine = client_engine(node, key, tune);
    PoolClient::new(master_client(grpc, key), engine, node.into(), None)
}

/// An engine-API session with the agent.
pub async fn engine(agent: &AgentAddrs, name: &str) -> EngineClient {
    EngineClient::connect(&agent.socket, 4 << 20, name)
        .await
        .expect("engine session")
}

/// Polls the master's stats until `done` holds, while every one of `procs` runs.
pub async fn wait_stats(
    client: &MasterClient,
    what: &str,
    procs: &mut [&mut ChildProcess],
    done: impl Fn(&StatsResponse) -> bool,
) -> StatsResponse {
    let started = Instant::now();
    loop {
        for p in procs.iter_mut() {
            p.assert_running().expect("running");
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

/// Polls the agent's metrics until `done` holds for the value of `name{labels}` (0 if absent).
pub async fn wait_metric(
    agent: &AgentAddrs,
    proc: &mut ChildProcess,
    name: &str,
    labels: &[&str],
    done: impl Fn(f64) -> bool,
) -> f64 {
    let started = Instant::now();
    let mut last = None;
    loop {
        proc.assert_running().expect("running");
        if let Some((200, text)) = http_get(agent.admin, "/metrics").await {
            let v = metric(&text, name, labels).unwrap_or(0.0);
            if done(v) {
                return v;
            }
            last = Some(v);
        }
        if started.elapsed() > DEADLINE {
            panic!(
                "timed out waiting for {name}{labels:?} (last {last:?}); log:\n{}",
                proc.log_text()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A DRAM segment `dram0` of `capacity` bytes on `node`, listed at `tcp://<node>:7000` (a
/// segment the master only books: nothing listens there).
pub fn dram_segment(node: &str, capacity: u64) -> SegmentSpec {
    SegmentSpec {
        node: node.into(),
        name: "dram0".into(),
        tier: Tier::Dram,
        capacity_bytes: capacity,
        numa_node: 0,
        failure_domain: String::new(),
        endpoints: vec![format!("tcp://{node}:7000")],
        persistent: false,
    }
}

/// Mounts a [`dram_segment`] of `capacity` bytes for each of `nodes` through `client`.
pub async fn mount_dram(client: &MasterClient, nodes: &[&str], capacity: u64) {
    for n in nodes {
        client
            .mount_segment(&dram_segment(n, capacity))
            .await
            .unwrap_or_else(|e| panic!("mount {n}: {e}"));
    }
}

/// An error with its sources, `: `-separated.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let chain: Vec<String> = std::iter::successors(Some(e), |e| e.source())
        .map(ToString::to_string)
        .collect();
    chain.join(": ")
}

/// Reads each of `held` until the peer closes it (EOF or reset), asserting that every one is
/// closed within `limit` of when its wait starts.
pub async fn assert_closed_within(held: &mut [tokio::net::TcpStream], limit: Duration) {
    use tokio::io::AsyncReadExt;
    for s in held {
        let mut buf = [0u8; 256];
        let ended = tokio::time::timeout(limit, async {
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        })
        .await;
        assert!(ended.is_ok(), "a connection outlived the deadline");
    }
}

/// Starts a put of `size` bytes under `key` with `opts`, which the master must allocate: the
/// put's id and the replicas to write.
pub async fn put_allocated(
    client: &MasterClient,
    key: &[u8],
    size: u64,
    opts: &PutOptions,
) -> (u64, Vec<ReplicaInfo>) {
    match client.put_start(key, size, opts).await.expect("put_start") {
        PutStarted::Allocated { put_id, replicas } => (put_id, replicas),
        other => panic!("{} not allocated: {other:?}", String::from_utf8_lossy(key)),
    }
}

/// Asserts that `client` finds the committed `key` of `size` bytes, and not `missing`: what
/// the get located (its read lease is still held).
pub async fn assert_committed(
    client: &MasterClient,
    key: &[u8],
    missing: &[u8],
    size: u64,
) -> Located {
    assert_eq!(
        client.exists(&[key, missing]).await.expect("exists"),
        vec![true, false]
    );
    let located = client.get(key).await.expect("get");
    assert_eq!(located.size, size);
    located
}

/// The replicas of `key` as the master hands them out now (the read lease it takes is released
/// at once).
pub async fn replicas(client: &MasterClient, key: &[u8]) -> Result<Vec<ReplicaInfo>, ClientError> {
    let located = client.get(key).await?;
    client
        .release_lease(located.lease_id)
        .await
        .expect("release");
    Ok(located.replicas)
}

/// The nodes holding `key`'s replicas (see [`replicas`]), sorted.
pub async fn replica_nodes(client: &MasterClient, key: &[u8]) -> Result<Vec<String>, ClientError> {
    let mut nodes: Vec<String> = replicas(client, key)
        .await?
        .into_iter()
        .map(|r| r.node)
        .collect();
    nodes.sort();
    Ok(nodes)
}

/// Flips the byte at `at` of `file` (XOR with `mask`), as damage on disk would.
pub fn flip_byte(file: &Path, at: u64, mask: u8) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .unwrap_or_else(|e| panic!("open {}: {e}", file.display()));
    let mut byte = [0u8; 1];
    f.read_exact_at(&mut byte, at).expect("read");
    f.write_all_at(&[byte[0] ^ mask], at).expect("corrupt");
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
    let client = master_client(master.grpc_addr, key);
    InProcessMaster {
        _dir: dir,
        master,
        shutdown,
        client,
    }
}

/// A current-thread runtime with I/O and timers: what a Python thread drives a client fork on
/// (or, never driven, a parent runtime whose tasks do not run).
pub fn current_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("current-thread runtime")
}

/// Poll `cond` every 10 ms for at most `limit`; whether it came true.
pub async fn eventually(limit: Duration, cond: impl FnMut() -> bool) -> bool {
    kvpool_harness::poll::until_async(limit, Duration::from_millis(10), cond).await
}

//! `kvpool bench master`: metadata benchmark of the master. Loads N objects into an
//! in-process master (through the core, to measure resident memory per object), then drives
//! batched `exists` and `longest_prefix` calls over loopback gRPC from several clients, and
//! measures put_start+put_end throughput, optionally with etcd write-through, over TLS
//! (`--tls`), and Gets with the per-node hit accounting on and off (`--node-hits-ab`, in
//! `master/gets.rs`).
//! I/O boundary: loopback sockets, `/proc/self/statm`, an etcd child process with `--with-etcd`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use kvpool_client::master::{ClientConfig, ClientError, MasterClient, MasterTls};
use kvpool_core::master::types::{ObjectKey, PutOptions, PutStarted, SegmentSpec, Tier};
use kvpool_harness::tls::TlsFiles;
use kvpool_harness::{EtcdServer, HarnessError};
use kvpool_master::cmd::{CmdError, MasterArgs, RunningMaster, loopback_args, start};
use kvpool_proto::auth::AuthKey;

mod gets;

use gets::{NodeHitFigures, node_hits_ab};

/// Errors of the benchmark.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum BenchError {
    #[error("cannot start the master")]
    Master(#[source] CmdError),
    #[error("master call failed")]
    Client(#[source] ClientError),
    #[error("cannot start etcd")]
    Etcd(#[source] HarnessError),
    #[error("benchmark set-up failed: {0}")]
    Setup(String),
}

kvpool_runtime::error_category!(BenchError);

/// Flags of `kvpool bench master`.
#[derive(Debug, Clone, clap::Args)]
pub struct MasterBenchArgs {
    /// Objects loaded before measuring.
    #[arg(long, default_value_t = 1_000_000)]
    pub objects: u64,
    /// Keys per exists / longest-prefix call.
    #[arg(long, default_value_t = 100)]
    pub batch: usize,
    /// Client connections.
    #[arg(long, default_value_t = 4)]
    pub clients: usize,
    /// Calls in flight per connection.
    #[arg(long, default_value_t = 4)]
    pub depth: usize,
    /// Duration of each lookup phase.
    #[arg(long, default_value = "5s", value_parser = kvpool_core::flags::parse_duration)]
    pub duration: Duration,
    /// Puts (put_start + put_end) in the put phase.
    #[arg(long, default_value_t = 20_000)]
    pub puts: u64,
    /// Also measure puts against a master persisting to a local etcd (needs `etcd`).
    #[arg(long)]
    pub with_etcd: bool,
    /// Run the lookup and put phases again, in this run, against a master serving TLS (a
    /// throw-away CA and certificate for 127.0.0.1), to measure what TLS costs.
    #[arg(long)]
    pub tls: bool,
    /// Also measure Gets (on the core and over gRPC) with the per-node Get hit accounting on
    /// and off, in alternating rounds of --duration each, to measure what it costs.
    #[arg(long)]
    pub node_hits_ab: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Figures of one run.
#[derive(Debug, Clone, Serialize)]
pub struct MasterBenchReport {
    pub objects: u64,
    pub load_seconds: f64,
    pub rss_before_bytes: u64,
    pub rss_after_bytes: u64,
    pub rss_bytes_per_object: f64,
    pub batch: usize,
    pub exists_calls_per_second: f64,
    pub exists_key_lookups_per_second: f64,
    pub prefix_calls_per_second: f64,
    pub prefix_key_lookups_per_second: f64,
    pub puts_per_second: f64,
    pub puts_with_etcd_per_second: Option<f64>,
    /// With `--tls`: the same phases against a TLS master.
    pub tls: Option<TlsFigures>,
    /// With `--node-hits-ab`: Get rates with the per-node accounting on and off.
    pub node_hits: Option<NodeHitFigures>,
}

/// The phases of `--tls`, and each one's rate as a fraction of the plaintext one.
#[derive(Debug, Clone, Serialize)]
pub struct TlsFigures {
    pub exists_calls_per_second: f64,
    pub prefix_calls_per_second: f64,
    pub puts_per_second: f64,
    pub exists_vs_plaintext: f64,
    pub prefix_vs_plaintext: f64,
    pub puts_vs_plaintext: f64,
}

/// Resident set size of this process.
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

pub(crate) fn bench_key(i: u64) -> Vec<u8> {
    format!("bench/{i:012}").into_bytes()
}

/// The master of the benchmark: loopback ports, timeouts that never fire during a run.
fn master_args(key_file: std::path::PathBuf, etcd: Option<String>) -> MasterArgs {
    MasterArgs {
        etcd_endpoints: etcd.into_iter().collect(),
        etcd_prefix: "/kvpool/bench".into(),
        heartbeat_timeout: Duration::from_secs(3600),
        lease_ttl: Duration::from_secs(5),
        put_timeout: Duration::from_secs(600),
        task_timeout: Duration::from_secs(600),
        tick_interval: Duration::from_millis(200),
        max_replicas: 8,
        ..loopback_args(key_file)
    }
}

fn segment(node: usize) -> SegmentSpec {
    SegmentSpec {
        node: format!("node-{node}"),
        name: "dram0".into(),
        tier: Tier::Dram,
        capacity_bytes: 1 << 40,
        numa_node: 0,
        failure_domain: String::new(),
        endpoints: vec![format!("tcp://10.0.0.{node}:7000")],
        persistent: false,
    }
}

/// The batched call each worker of a lookup phase makes, over a chain of `batch` consecutive
/// keys.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Lookup {
    Exists,
    LongestPrefix,
    /// `get`, then the release of the leases it took, as a reader does.
    GetAndRelease,
}

impl Lookup {
    /// How many places a chain may start at. For `exists`, a fifth of the chains run past the
    /// loaded range so that misses are exercised too; for the others every chain is fully
    /// cached, so each call really looks up all `batch` keys.
    fn starts(self, objects: u64, batch: u64) -> u64 {
        match self {
            Lookup::Exists => (objects + objects / 5).max(1),
            Lookup::LongestPrefix | Lookup::GetAndRelease => objects.saturating_sub(batch).max(1),
        }
    }

    async fn call(self, c: &MasterClient, keys: &[&[u8]]) -> Result<(), ClientError> {
        match self {
            Lookup::Exists => c.exists(keys).await.map(drop),
            Lookup::LongestPrefix => c.longest_prefix(keys).await.map(drop),
            Lookup::GetAndRelease => {
                let leases: Vec<u64> = c
                    .get_batch(keys)
                    .await?
                    .into_iter()
                    .filter_map(|r| r.ok().map(|l| l.lease_id))
                    .collect();
                c.release_leases(&leases).await.map(drop)
            }
        }
    }
}

/// Calls per second of `lookup` from `args.depth` workers per client during `args.duration`,
/// each worker walking its own stride of chains over `objects` loaded keys.
pub(crate) async fn lookup_phase(
    clients: &[MasterClient],
    args: &MasterBenchArgs,
    objects: u64,
    lookup: Lookup,
) -> Result<f64, BenchError> {
    let calls = Arc::new(AtomicU64::new(0));
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    for (ci, c) in clients.iter().enumerate() {
        for d in 0..args.depth {
            let (c, calls, stop) = (c.clone(), calls.clone(), stop.clone());
            let batch = args.batch as u64;
            let mut next = (ci * args.depth + d) as u64 * 7919;
            tasks.push(tokio::spawn(async move {
                while !stop.is_cancelled() {
                    let start = next % lookup.starts(objects, batch);
                    next = next.wrapping_add(104_729);
                    let keys: Vec<Vec<u8>> = (start..start + batch).map(bench_key).collect();
                    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
                    lookup.call(&c, &refs).await?;
                    calls.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<(), ClientError>(())
            }));
        }
    }
    let started = Instant::now();
    tokio::time::sleep(args.duration).await;
    stop.cancel();
    join_workers(tasks).await?;
    Ok(calls.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

/// Waits for every worker of a phase, returning the first failure.
async fn join_workers(
    tasks: Vec<tokio::task::JoinHandle<Result<(), ClientError>>>,
) -> Result<(), BenchError> {
    for t in tasks {
        t.await
            .map_err(|e| BenchError::Setup(e.to_string()))?
            .map_err(BenchError::Client)?;
    }
    Ok(())
}

async fn put_phase(
    clients: &[MasterClient],
    puts: u64,
    depth: usize,
    tag: &str,
) -> Result<f64, BenchError> {
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in clients {
        for _ in 0..depth {
            let c = c.clone();
            let next = next.clone();
            let tag = tag.to_owned();
            tasks.push(tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= puts {
                        return Ok::<(), ClientError>(());
                    }
                    let key = format!("put/{tag}/{i}").into_bytes();
                    let opts = PutOptions {
                        replicas: 2,
                        ..PutOptions::default()
                    };
                    if let PutStarted::Allocated { put_id, .. } =
                        c.put_start(&key, 256 * 1024, &opts).await?
                    {
                        c.put_end(&key, put_id).await?;
                    }
                }
            }));
        }
    }
    join_workers(tasks).await?;
    Ok(puts as f64 / started.elapsed().as_secs_f64())
}

fn clients_for(
    addr: std::net::SocketAddr,
    key: &AuthKey,
    n: usize,
    tls: &MasterTls,
) -> Result<Vec<MasterClient>, BenchError> {
    let config = ClientConfig {
        tls: tls.clone(),
        ..ClientConfig::default()
    };
    (0..n.max(1))
        .map(|_| {
            MasterClient::new(vec![addr.to_string()], key.clone(), config.clone())
                .map_err(BenchError::Client)
        })
        .collect()
}

/// An in-process master on loopback (with etcd write-through when `etcd` is given, TLS with
/// `tls`).
async fn start_master(
    key_file: std::path::PathBuf,
    etcd: Option<String>,
    tls: Option<&TlsFiles>,
) -> Result<(RunningMaster, CancellationToken), BenchError> {
    let mut args = master_args(key_file, etcd);
    if let Some(t) = tls {
        args.tls_cert_file = Some(t.master_cert.clone());
        args.tls_key_file = Some(t.master_key.clone());
    }
    let validated = args.validate().map_err(BenchError::Master)?;
    let shutdown = CancellationToken::new();
    let master = start(validated, shutdown.clone())
        .await
        .map_err(BenchError::Master)?;
    Ok((master, shutdown))
}

/// Load `objects` objects through the core: the same code path as put_start/put_end, minus
/// gRPC.
fn load(master: &RunningMaster, objects: u64) -> Result<(), BenchError> {
    let mut st = master.core.state.lock();
    for n in 0..8 {
        st.mount(segment(n))
            .map_err(|e| BenchError::Setup(e.to_string()))?;
    }
    let opts = PutOptions::default();
    for i in 0..objects {
        let key = ObjectKey::from_bytes(&bench_key(i));
        match st.put_start(key, 64 * 1024, &opts) {
            Ok(PutStarted::Allocated { put_id, .. }) => st
                .put_end(key, put_id)
                .map_err(|e| BenchError::Setup(e.to_string()))?,
            Ok(PutStarted::AlreadyCommitted { .. }) => {}
            Err(e) => return Err(BenchError::Setup(e.to_string())),
        }
    }
    Ok(())
}

/// The lookup and put phases against a master serving TLS with throw-away certificates in
/// `dir`; `plain` = (exists, prefix, puts) of the plaintext master, for the ratios.
async fn tls_phases(
    args: &MasterBenchArgs,
    dir: &std::path::Path,
    key_file: std::path::PathBuf,
    key: &AuthKey,
    plain: (f64, f64, f64),
) -> Result<TlsFigures, BenchError> {
    let files = kvpool_harness::tls::write_throwaway(dir, "kvpool bench CA", &["127.0.0.1"])
        .map_err(|e| BenchError::Setup(format!("TLS certificates: {e}")))?;
    let (master, shutdown) = start_master(key_file, None, Some(&files)).await?;
    load(&master, args.objects)?;
    let tls = MasterTls {
        ca_file: Some(files.ca.clone()),
        ..MasterTls::default()
    };
    let clients = clients_for(master.grpc_addr, key, args.clients, &tls)?;
    let exists = lookup_phase(&clients, args, args.objects, Lookup::Exists).await?;
    let prefix = lookup_phase(&clients, args, args.objects, Lookup::LongestPrefix).await?;
    let puts = put_phase(&clients, args.puts, args.depth, "tls").await?;
    shutdown.cancel();
    master.join().await.map_err(BenchError::Master)?;
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    Ok(TlsFigures {
        exists_calls_per_second: exists,
        prefix_calls_per_second: prefix,
        puts_per_second: puts,
        exists_vs_plaintext: ratio(exists, plain.0),
        prefix_vs_plaintext: ratio(prefix, plain.1),
        puts_vs_plaintext: ratio(puts, plain.2),
    })
}

/// Run the benchmark and print its report.
/// [`run`] on `runtime`: what `kvpool bench master` calls.
pub fn run_blocking(
    runtime: &tokio::runtime::Runtime,
    args: MasterBenchArgs,
) -> Result<MasterBenchReport, BenchError> {
    runtime.block_on(run(args))
}

pub async fn run(args: MasterBenchArgs) -> Result<MasterBenchReport, BenchError> {
    let dir = tempfile::tempdir().map_err(|e| BenchError::Setup(e.to_string()))?;
    let key_file = dir.path().join("key");
    let secret = format!("{:032x}", rand::random::<u128>());
    std::fs::write(&key_file, &secret).map_err(|e| BenchError::Setup(e.to_string()))?;
    let key = AuthKey::from_bytes(secret.as_bytes())
        .ok_or_else(|| BenchError::Setup("generated key too short".into()))?;
    let (master, shutdown) = start_master(key_file.clone(), None, None).await?;
    let rss_before = rss_bytes();
    let started = Instant::now();
    load(&master, args.objects)?;
    let load_seconds = started.elapsed().as_secs_f64();
    let rss_after = rss_bytes();

    let plaintext = MasterTls::default();
    let clients = clients_for(master.grpc_addr, &key, args.clients, &plaintext)?;
    let exists = lookup_phase(&clients, &args, args.objects, Lookup::Exists).await?;
    let prefix = lookup_phase(&clients, &args, args.objects, Lookup::LongestPrefix).await?;
    let puts = put_phase(&clients, args.puts, args.depth, "plain").await?;
    let node_hits = if args.node_hits_ab {
        Some(node_hits_ab(&master, &clients, &args, args.objects).await?)
    } else {
        None
    };
    shutdown.cancel();
    master.join().await.map_err(BenchError::Master)?;

    let puts_with_etcd = if args.with_etcd {
        let etcd = EtcdServer::start(dir.path()).map_err(BenchError::Etcd)?;
        let etcd_url = Some(etcd.client_url.clone());
        let (master, shutdown) = start_master(key_file.clone(), etcd_url, None).await?;
        let clients = clients_for(master.grpc_addr, &key, args.clients, &plaintext)?;
        let admin = &clients[0];
        for n in 0..8 {
            admin
                .mount_segment(&segment(n))
                .await
                .map_err(BenchError::Client)?;
        }
        let r = put_phase(&clients, args.puts, args.depth, "etcd").await?;
        shutdown.cancel();
        master.join().await.map_err(BenchError::Master)?;
        Some(r)
    } else {
        None
    };

    let tls = if args.tls {
        let plain = (exists, prefix, puts);
        Some(tls_phases(&args, dir.path(), key_file, &key, plain).await?)
    } else {
        None
    };

    let objects = args.objects.max(1);
    let report = MasterBenchReport {
        objects: args.objects,
        load_seconds,
        rss_before_bytes: rss_before,
        rss_after_bytes: rss_after,
        rss_bytes_per_object: rss_after.saturating_sub(rss_before) as f64 / objects as f64,
        batch: args.batch,
        exists_calls_per_second: exists,
        exists_key_lookups_per_second: exists * args.batch as f64,
        prefix_calls_per_second: prefix,
        prefix_key_lookups_per_second: prefix * args.batch as f64,
        puts_per_second: puts,
        puts_with_etcd_per_second: puts_with_etcd,
        tls,
        node_hits,
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        );
    } else {
        println!("objects loaded            {}", report.objects);
        println!(
            "master RSS per object     {:.1} bytes ({} -> {} bytes)",
            report.rss_bytes_per_object, rss_before, rss_after
        );
        println!(
            "exists x{}               {:.0} calls/s = {:.0} key lookups/s",
            report.batch, exists, report.exists_key_lookups_per_second
        );
        println!(
            "longest_prefix x{}       {:.0} calls/s = {:.0} key lookups/s",
            report.batch, prefix, report.prefix_key_lookups_per_second
        );
        println!("put_start+put_end         {puts:.0} puts/s (in memory)");
        if let Some(p) = puts_with_etcd {
            println!("put_start+put_end         {p:.0} puts/s (etcd write-through)");
        }
        if let Some(t) = &report.tls {
            println!(
                "over TLS: exists {:.0} calls/s ({:.2}x), longest_prefix {:.0} calls/s ({:.2}x), \
                 puts {:.0}/s ({:.2}x)",
                t.exists_calls_per_second,
                t.exists_vs_plaintext,
                t.prefix_calls_per_second,
                t.prefix_vs_plaintext,
                t.puts_per_second,
                t.puts_vs_plaintext
            );
        }
        if let Some(n) = &report.node_hits {
            println!(
                "get, per-node hits on/off: core {:.0}/{:.0} gets/s ({:.3}x), gRPC x{} \
                 {:.0}/{:.0} calls/s ({:.3}x)",
                n.core_gets_per_second_on,
                n.core_gets_per_second_off,
                n.core_off_vs_on,
                report.batch,
                n.grpc_get_calls_per_second_on,
                n.grpc_get_calls_per_second_off,
                n.grpc_off_vs_on
            );
        }
    }
    Ok(report)
}

//! `kvpool bench store`: the pool's data path end to end on 127.0.0.1. Starts a `kvpool master`,
//! M `kvpool agent run` processes in pool mode and N client processes (this binary re-executed
//! with the hidden `--worker` flag), drives put/get phases per value size and `exists` /
//! `longest_prefix` phases through a stdin/stdout barrier, and measures Debian's `redis-server`
//! with `redis-benchmark` in the same run as the baseline. The flags and the coordinator live
//! here; `plan`, `values` and `report` are pure, `procs` starts the children (through the
//! process harness), `worker` is a client process, `redis` the baseline.
//! I/O boundary: child processes, their pipes and log files, loopback sockets, stdout.

mod plan;
pub(crate) mod procs;
mod redis;
mod report;
mod values;
pub(crate) mod vs_mooncake;
mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use serde::Serialize;

use super::transfer::parse_size;
use kvpool_client::master::{ClientConfig, ClientError, MasterClient};
use kvpool_proto::auth::AuthKey as MasterKey;
use kvpool_transfer as transfer;

pub use self::plan::{Phase, plan};
use self::procs::{start_agent, start_master, start_worker, wait_for_agents, write_topology};
pub use self::redis::parse_redis_csv;
use self::report::print_text;
pub use self::report::{
    LookupFigures, PhaseFigures, PhaseResult, Ratio, RedisFigures, SizeFigures, StoreBenchReport,
    aggregate, report,
};
pub use self::values::{template, verify};
pub use self::vs_mooncake::{CellRatio, MooncakeStore, parse_driver_output};

/// How long child processes get to come up.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Flags of `kvpool bench store`.
#[derive(Clone, Debug, Args)]
pub struct StoreBenchArgs {
    /// Agent processes (`kvpool agent run` in pool mode).
    #[arg(long, default_value_t = 2)]
    pub agents: usize,
    /// Client processes. One process with 8 operations in flight measured faster on the
    /// 2-core machine than two with 4 each (fewer threads competing for the cores), and is the
    /// shape of the Redis baseline: one `redis-benchmark` process.
    #[arg(long, default_value_t = 1)]
    pub clients: usize,
    /// Puts or gets in flight per client process.
    #[arg(long, default_value_t = 8)]
    pub depth: usize,
    /// Value sizes measured (comma separated; K/M/G suffixes are powers of 1024).
    #[arg(long, value_delimiter = ',', default_value = "64KiB,1MiB,4MiB", value_parser = parse_size)]
    pub sizes: Vec<u64>,
    /// Bytes put (and then got) per value size, over all clients.
    #[arg(long, default_value = "384MiB", value_parser = parse_size)]
    pub bytes_per_size: u64,
    /// Operations per client per size and round; overrides --bytes-per-size.
    #[arg(long)]
    pub ops: Option<u64>,
    /// Rounds of put, get and remove per size (each round moves --bytes-per-size); a 1 MiB
    /// round lasts about 0.2 s, so 8 rounds time about as long as the Redis baseline runs.
    #[arg(long, default_value_t = 8)]
    pub rounds: u32,
    /// Replicas per object.
    #[arg(long, default_value_t = 1)]
    pub replicas: u8,
    /// DRAM capacity of each agent.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub agent_capacity: u64,
    /// TCP lanes of each client's transfer engine (per agent).
    #[arg(long, default_value_t = 4)]
    pub lanes: usize,
    /// Keys per `exists` / `longest_prefix` call.
    #[arg(long, default_value_t = 100)]
    pub batch: usize,
    /// Duration of each metadata phase.
    #[arg(long, default_value = "3s", value_parser = kvpool_core::flags::parse_duration)]
    pub lookup_duration: Duration,
    /// Let agents discover the host (/sys, /proc). By default they get a one-NUMA-node
    /// description of this host whose free memory is MemAvailable (page cache included), so
    /// that a busy build machine's small MemFree does not stop them.
    #[arg(long)]
    pub host_topology: bool,
    /// Skip the Redis baseline.
    #[arg(long)]
    pub no_redis: bool,
    /// Requests per `redis-benchmark` test (1 MiB values, 4 connections).
    #[arg(long, default_value_t = 3000)]
    pub redis_requests: u64,
    /// Client API measured: `registered` puts from and gets straight into a buffer registered
    /// with the engine (`put_from` / `get_to`, no staging copy); `copy` uses `put(&[u8])` and
    /// `get() -> Vec<u8>`.
    #[arg(long, value_enum, default_value = "registered")]
    pub api: Api,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// `--vs-mooncake` and `--mooncake-venv`.
    #[command(flatten)]
    pub mooncake: crate::mooncake::VsMooncakeArgs,
    /// Internal: run as client process number N of a benchmark.
    #[arg(long, hide = true)]
    pub worker: Option<usize>,
    /// Internal (worker): the master's gRPC address.
    #[arg(long, hide = true)]
    pub master: Option<SocketAddr>,
    /// Internal (worker): the pool's key file.
    #[arg(long, hide = true)]
    pub key_file: Option<PathBuf>,
    /// Internal (worker, `--api engine`): the engine API socket of the agent to go through.
    #[arg(long, hide = true)]
    pub engine_socket: Option<PathBuf>,
}

/// Which client calls the data phases use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    Registered,
    Copy,
    /// Through a node agent's engine API (gRPC on its Unix socket, bytes in the session's
    /// shared staging area), as an inference engine on the agent's node uses the pool.
    Engine,
}

impl Api {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Api::Registered => "registered",
            Api::Copy => "copy",
            Api::Engine => "engine",
        }
    }
}

/// Errors of `kvpool bench store`.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum StoreBenchError {
    #[error("invalid arguments: {0}")]
    Args(String),
    #[error(transparent)]
    Process(kvpool_harness::HarnessError),
    #[error("{what} did not become ready within {timeout:?}")]
    NotReady { what: String, timeout: Duration },
    #[error("I/O on the benchmark's files or pipes")]
    Io(#[source] std::io::Error),
    #[error("master call failed")]
    Master(#[source] ClientError),
    #[error("client set-up failed")]
    Client(#[source] transfer::TransferError),
    #[error("worker protocol: {0}")]
    Protocol(String),
    #[error("redis baseline failed: {0}")]
    Redis(String),
    #[error("a benchmark task was lost: {0}")]
    Join(String),
}

kvpool_runtime::error_category!(StoreBenchError);

impl StoreBenchArgs {
    /// Operations per client for values of `size` bytes.
    pub fn ops_for(&self, size: u64) -> u64 {
        self.ops.unwrap_or_else(|| {
            let per_client = self.bytes_per_size / size.max(1) / self.clients.max(1) as u64;
            per_client.max(self.depth as u64)
        })
    }

    fn validate(&self) -> Result<(), StoreBenchError> {
        let bad = |m: String| Err(StoreBenchError::Args(m));
        if self.agents == 0 || self.clients == 0 || self.depth == 0 {
            return bad("--agents, --clients and --depth must be > 0".into());
        }
        if self.sizes.is_empty() {
            return bad("--sizes needs at least one size".into());
        }
        if self.rounds == 0 {
            return bad("--rounds must be > 0".into());
        }
        if self.ops == Some(0) {
            return bad("--ops must be > 0".into());
        }
        if self.replicas == 0 || usize::from(self.replicas) > self.agents {
            return bad(format!(
                "--replicas {} must be between 1 and --agents ({})",
                self.replicas, self.agents
            ));
        }
        if self.batch == 0 || self.batch > 16_384 {
            return bad("--batch must be between 1 and 16384".into());
        }
        if self.lanes == 0 || self.lanes > 64 {
            return bad("--lanes must be between 1 and 64".into());
        }
        // Everything of one size is live at once; stay under the master's eviction watermark
        // (0.95) with some slack for allocation granularity.
        let total = self.agent_capacity.saturating_mul(self.agents as u64);
        for &s in &self.sizes {
            let need = self
                .ops_for(s)
                .saturating_mul(self.clients as u64)
                .saturating_mul(s.div_ceil(4096) * 4096)
                .saturating_mul(u64::from(self.replicas));
            if need > total / 10 * 9 {
                return bad(format!(
                    "values of {s} bytes need {need} bytes of pool DRAM but {} agents x \
                     --agent-capacity {} hold {total}; lower --bytes-per-size/--ops or raise \
                     --agent-capacity",
                    self.agents, self.agent_capacity
                ));
            }
            if s > self.agent_capacity {
                return bad(format!("value size {s} exceeds --agent-capacity"));
            }
        }
        Ok(())
    }
}

async fn coordinate(args: StoreBenchArgs) -> Result<StoreBenchReport, StoreBenchError> {
    args.validate()?;
    let exe = std::env::current_exe().map_err(StoreBenchError::Io)?;
    let dir = tempfile::tempdir().map_err(StoreBenchError::Io)?;
    let key_file = dir.path().join("pool.key");
    let secret = format!(
        "{:032x}{:032x}",
        rand::random::<u128>(),
        rand::random::<u128>()
    );
    std::fs::write(&key_file, &secret).map_err(StoreBenchError::Io)?;
    let key = MasterKey::from_bytes(secret.as_bytes())
        .ok_or_else(|| StoreBenchError::Args("generated key too short".into()))?;

    let mut master = start_master(&exe, dir.path(), &key_file)?;
    let grpc = master.grpc;
    let topology = if args.host_topology {
        None
    } else {
        Some(write_topology(dir.path())?)
    };
    let mut agents = (0..args.agents)
        .map(|i| {
            start_agent(
                &exe,
                dir.path(),
                i,
                grpc,
                &key_file,
                args.agent_capacity,
                topology.as_ref(),
                &[],
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let client = MasterClient::new(vec![grpc.to_string()], key, ClientConfig::default())
        .map_err(StoreBenchError::Master)?;
    wait_for_agents(&client, &mut agents, &mut master, args.agents).await?;

    let mut workers = (0..args.clients)
        .map(|id| {
            // Engine-API clients go through the agents in turn, as engines on their nodes.
            let socket =
                (args.api == Api::Engine).then(|| agents[id % agents.len()].socket.clone());
            start_worker(
                &exe,
                dir.path(),
                id,
                &args,
                grpc,
                &key_file,
                socket.as_deref(),
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let phases = plan(&args.sizes, args.rounds);
    let results = tokio::task::block_in_place(|| procs::drive(&mut workers, &phases))?;
    for w in &mut workers {
        // After the last phase the worker exits; drop kills whatever is left.
        let _ = w.proc.wait_timeout(START_TIMEOUT);
    }
    drop(workers);
    drop(agents);
    drop(master);

    let redis = if args.no_redis {
        None
    } else {
        Some(redis::redis_baseline(dir.path(), args.redis_requests)?)
    };
    let mooncake = if args.mooncake.vs_mooncake {
        Some(tokio::task::block_in_place(|| {
            vs_mooncake::run(&args, dir.path())
        })?)
    } else {
        None
    };
    let mut r = report(&args, &results, redis);
    if let Some(m) = mooncake {
        r.ratio_vs_mooncake = vs_mooncake::ratios(&r.values, &m);
        r.mooncake = Some(m);
    }
    Ok(r)
}

/// Entry point of `kvpool bench store` (coordinator or, with `--worker`, a client process).
pub fn run(args: StoreBenchArgs) -> Result<(), StoreBenchError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(StoreBenchError::Io)?;
    if let Some(id) = args.worker {
        return rt.block_on(worker::run_worker(id, args));
    }
    let json = args.json;
    let r = rt.block_on(coordinate(args))?;
    if json {
        let text = serde_json::to_string_pretty(&r)
            .map_err(|e| StoreBenchError::Protocol(e.to_string()))?;
        println!("{text}");
    } else {
        print_text(&r);
    }
    Ok(())
}

#[cfg(test)]
mod tests;

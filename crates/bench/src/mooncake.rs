//! Mooncake as the peer that `--vs-mooncake` measures against in the same run: finding its PyPI
//! wheel (`mooncake-transfer-engine-non-cuda`) in a virtual environment, or installing it there,
//! and running its programs as children that die with this process. The drivers that use it are
//! `transfer::vs_mooncake` (Mooncake's own `transfer_engine_bench`) and `store::vs_mooncake`
//! (a Python caller of `mooncake.store` written here against its public API).
//! I/O boundary: the file system (the venv), `python3 -m venv` and pip, Mooncake's processes.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kvpool_harness::process::{ChildProcess, Launcher};

/// The PyPI distribution with Mooncake's transfer engine, store and master, built without CUDA.
pub const WHEEL: &str = "mooncake-transfer-engine-non-cuda";
/// The version installed when none is found (the one docs/benchmarks.md was measured with).
pub const DEFAULT_VERSION: &str = "0.3.13.post1";
/// Where a venv is made when none is given or found.
pub const DEFAULT_VENV: &str = ".tools/mooncake";

/// `--vs-mooncake` and `--mooncake-venv`: the flags of a benchmark that also measures Mooncake,
/// in the same run, on the same workload as kvpool.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct VsMooncakeArgs {
    /// Also measure Mooncake (PyPI `mooncake-transfer-engine-non-cuda`, found or installed in a
    /// venv) on the same workload, after kvpool's run, and report both and their ratios.
    /// `bench transfer` runs Mooncake's `transfer_engine_bench` with the same operation, sizes,
    /// threads and duration over TCP loopback (`--mode both --protocol tcp` only); `bench store`
    /// runs Mooncake Store with the same sizes, operations, operations in flight, holders (one
    /// per agent) and capacity.
    #[arg(long = "vs-mooncake", alias = "vs_mooncake")]
    pub vs_mooncake: bool,
    /// The venv holding Mooncake (default: KVPOOL_MOONCAKE_VENV, else .tools/py or
    /// .tools/mooncake, made and filled from PyPI when neither has it).
    #[arg(long = "mooncake-venv", alias = "mooncake_venv")]
    pub mooncake_venv: Option<PathBuf>,
}

/// A virtual environment holding Mooncake.
#[derive(Clone, Debug)]
pub struct Mooncake {
    pub venv: PathBuf,
    /// The installed version of [`WHEEL`].
    pub version: String,
}

/// Why Mooncake could not be made ready.
#[derive(Debug, thiserror::Error)]
pub enum MooncakeError {
    #[error("running {what} failed: {source}")]
    Spawn {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} failed ({status}): {output}")]
    Failed {
        what: String,
        status: String,
        output: String,
    },
    #[error("{0}")]
    Peer(String),
}

impl Mooncake {
    /// The venv to use: `explicit`, else `KVPOOL_MOONCAKE_VENV`, else the first of the project's
    /// Python venv (`.tools/py`, made by scripts/python-env.sh) and [`DEFAULT_VENV`] that has
    /// Mooncake; when none has it, [`DEFAULT_VENV`] (or `explicit`) is made and Mooncake
    /// installed into it from PyPI.
    pub fn find_or_install(explicit: Option<&Path>) -> Result<Mooncake, MooncakeError> {
        let chosen = explicit
            .map(Path::to_path_buf)
            .or_else(|| std::env::var_os("KVPOOL_MOONCAKE_VENV").map(PathBuf::from));
        let candidates: Vec<PathBuf> = match &chosen {
            Some(v) => vec![v.clone()],
            None => vec![PathBuf::from(".tools/py"), PathBuf::from(DEFAULT_VENV)],
        };
        for venv in &candidates {
            if let Some(version) = installed_version(venv) {
                return Ok(Mooncake {
                    venv: venv.clone(),
                    version,
                });
            }
        }
        let venv = chosen.unwrap_or_else(|| PathBuf::from(DEFAULT_VENV));
        install(&venv)?;
        let version = installed_version(&venv).ok_or_else(|| {
            MooncakeError::Peer(format!(
                "{WHEEL} is still not importable from {} after installing it",
                venv.display()
            ))
        })?;
        Ok(Mooncake { venv, version })
    }

    /// A program of the venv (`transfer_engine_bench`, `mooncake_master`, `python`).
    pub fn bin(&self, name: &str) -> PathBuf {
        self.venv.join("bin").join(name)
    }
}

fn installed_version(venv: &Path) -> Option<String> {
    let python = venv.join("bin").join("python");
    if !python.exists() {
        return None;
    }
    let out = Command::new(&python)
        .args([
            "-c",
            &format!("import importlib.metadata as m; print(m.version({WHEEL:?}))"),
        ])
        .output()
        .ok()?;
    let version = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    (out.status.success() && !version.is_empty() && venv.join("bin/transfer_engine_bench").exists())
        .then_some(version)
}

fn install(venv: &Path) -> Result<(), MooncakeError> {
    tracing::info!(venv = %venv.display(), "installing {WHEEL}=={DEFAULT_VERSION} from PyPI");
    if !venv.join("bin/python").exists() {
        run(
            Command::new("python3").arg("-m").arg("venv").arg(venv),
            "python3 -m venv",
        )?;
    }
    run(
        Command::new(venv.join("bin/pip"))
            .args(["install", "--quiet", "--disable-pip-version-check"])
            .arg(format!("{WHEEL}=={DEFAULT_VERSION}")),
        "pip install",
    )
}

/// Runs `cmd` to its end; its output (tail) in the error when it fails.
pub(crate) fn run(cmd: &mut Command, what: &str) -> Result<(), MooncakeError> {
    let out = cmd.output().map_err(|source| MooncakeError::Spawn {
        what: what.into(),
        source,
    })?;
    if out.status.success() {
        return Ok(());
    }
    let mut text = String::from_utf8_lossy(&out.stderr).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stdout));
    Err(MooncakeError::Failed {
        what: what.into(),
        status: out.status.to_string(),
        output: tail(&text, 2000),
    })
}

/// The last `max` bytes of `s` (on a character boundary).
pub(crate) fn tail(s: &str, max: usize) -> String {
    let mut start = s.len().saturating_sub(max);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    s[start..].to_owned()
}

/// A launcher for Mooncake's children: logs under `dir`, killed if this process dies.
pub(crate) fn launcher(dir: &Path) -> Launcher {
    Launcher::new(dir).parent_death_signal(nix::sys::signal::Signal::SIGKILL)
}

/// Wait until `find` finds what it looks for in the child's log, or the child exits, or
/// `timeout` passes.
pub(crate) fn wait_for_log<T>(
    child: &mut ChildProcess,
    timeout: Duration,
    what: &str,
    mut find: impl FnMut(&str) -> Option<T>,
) -> Result<T, MooncakeError> {
    let deadline = Instant::now() + timeout;
    loop {
        let log = child.log_text();
        if let Some(v) = find(&log) {
            return Ok(v);
        }
        if let Ok(Some(status)) = child.try_status() {
            return Err(MooncakeError::Peer(format!(
                "{} exited ({status}) before {what}: {}",
                child.name(),
                tail(&log, 1500)
            )));
        }
        if Instant::now() > deadline {
            return Err(MooncakeError::Peer(format!(
                "{} showed no sign of {what} within {timeout:?}: {}",
                child.name(),
                tail(&log, 1500)
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The median of `v` (the mean of the middle two for an even count); 0 for none.
pub fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_of_odd_even_and_empty_runs() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[f64::NAN, 5.0]), 5.0);
    }

    #[test]
    fn tails_cut_on_character_boundaries() {
        assert_eq!(tail("abcdef", 3), "def");
        assert_eq!(tail("ab", 9), "ab");
        assert_eq!(tail("aé", 1), "");
    }

    #[test]
    fn a_venv_without_mooncake_is_not_taken_for_one() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(installed_version(dir.path()), None);
    }
}

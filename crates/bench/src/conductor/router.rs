//! sglang-router as the peer of `kvpool bench conductor --vs-sglang-router`: finding its PyPI
//! package (`sglang-router`, the Rust router SGLang users run, as a Python extension) in a
//! virtual environment or installing the pinned version there, and starting it in its
//! prefill/decode mode in front of the engines `kvpool up` started. The venv helpers are
//! Mooncake's (`crate::mooncake`). I/O boundary: the file system (the venv), `python3 -m venv`
//! and pip, the router's process.

use std::path::{Path, PathBuf};
use std::process::Command;

use kvpool_harness::process::ChildProcess;

use super::ConductorBenchError;
use crate::mooncake;

/// The PyPI distribution.
pub const PACKAGE: &str = "sglang-router";
/// The version installed when none is found (the one docs/benchmarks.md was measured with;
/// scripts/python-env.sh pins the same).
pub const DEFAULT_VERSION: &str = "0.3.2";
/// Where the venv is when neither `--router-venv` nor `KVPOOL_ROUTER_VENV` says.
pub const DEFAULT_VENV: &str = ".tools/router";
/// The bootstrap port the router is told for each prefill engine: the conductor's default
/// (SGLang's `--disaggregation-bootstrap-port` default). The synthetic engines hand the KV
/// over through the pool and run no bootstrap server; both front doors only pass it on.
pub const BOOTSTRAP_PORT: u16 = 8998;

/// A virtual environment holding sglang-router.
#[derive(Clone, Debug)]
pub struct SglangRouter {
    pub venv: PathBuf,
    pub version: String,
}

fn peer(e: impl std::fmt::Display) -> ConductorBenchError {
    ConductorBenchError::Router(e.to_string())
}

impl SglangRouter {
    /// The venv: `explicit`, else `KVPOOL_ROUTER_VENV`, else [`DEFAULT_VENV`]; when it lacks
    /// sglang-router, it is made (if need be) and [`DEFAULT_VERSION`] installed from PyPI.
    pub fn find_or_install(explicit: Option<&Path>) -> Result<SglangRouter, ConductorBenchError> {
        let venv = explicit
            .map(Path::to_path_buf)
            .or_else(|| std::env::var_os("KVPOOL_ROUTER_VENV").map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from(DEFAULT_VENV));
        if let Some(version) = installed_version(&venv) {
            return Ok(SglangRouter { venv, version });
        }
        tracing::info!(venv = %venv.display(), "installing {PACKAGE}=={DEFAULT_VERSION} from PyPI");
        if !venv.join("bin/python").exists() {
            mooncake::run(
                Command::new("python3").arg("-m").arg("venv").arg(&venv),
                "python3 -m venv",
            )
            .map_err(peer)?;
        }
        mooncake::run(
            Command::new(venv.join("bin/pip"))
                .args(["install", "--quiet", "--disable-pip-version-check"])
                .arg(format!("{PACKAGE}=={DEFAULT_VERSION}")),
            "pip install",
        )
        .map_err(peer)?;
        let version = installed_version(&venv).ok_or_else(|| {
            peer(format!(
                "{PACKAGE} is still not importable from {} after installing it",
                venv.display()
            ))
        })?;
        Ok(SglangRouter { venv, version })
    }

    /// The router's command line in prefill/decode mode in front of `prefill` and `decode`
    /// (engine base URLs), listening on 127.0.0.1:`port` with its metrics on `metrics_port`.
    /// Everything else is the router's default (cache-aware policy, retries, circuit breaker,
    /// health checks) but the log level: `warn`, so that it does not write two lines per
    /// request (the conductor logs none at its default level either).
    pub fn args(
        &self,
        prefill: &[String],
        decode: &[String],
        port: u16,
        metrics_port: u16,
    ) -> Vec<String> {
        let mut a: Vec<String> = ["-m", "sglang_router.launch_router", "--pd-disaggregation"]
            .map(String::from)
            .into();
        for url in prefill {
            a.extend(["--prefill".into(), url.clone(), BOOTSTRAP_PORT.to_string()]);
        }
        for url in decode {
            a.extend(["--decode".into(), url.clone()]);
        }
        a.extend(
            [
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                &metrics_port.to_string(),
                "--log-level",
                "warn",
            ]
            .map(String::from),
        );
        a
    }

    /// Starts the router as a child that dies with this thread, its output in `logs`.
    pub fn spawn(&self, logs: &Path, args: &[String]) -> Result<ChildProcess, ConductorBenchError> {
        mooncake::launcher(logs)
            .spawn("sglang-router", Command::new(self.python()).args(args))
            .map_err(ConductorBenchError::Process)
    }

    /// The venv's Python.
    pub fn python(&self) -> PathBuf {
        self.venv.join("bin/python")
    }
}

/// The installed version of [`PACKAGE`] in `venv`, when its module imports.
fn installed_version(venv: &Path) -> Option<String> {
    let python = venv.join("bin/python");
    if !python.exists() {
        return None;
    }
    let out = Command::new(&python)
        .args([
            "-c",
            &format!(
                "import importlib.metadata as m, sglang_router; print(m.version({PACKAGE:?}))"
            ),
        ])
        .output()
        .ok()?;
    let version = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    (out.status.success() && !version.is_empty()).then_some(version)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_venv_without_the_router_is_not_taken_for_one() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(installed_version(dir.path()), None);
    }

    #[test]
    fn the_router_runs_in_pd_mode_in_front_of_every_engine_on_loopback() {
        let r = SglangRouter {
            venv: "/v".into(),
            version: DEFAULT_VERSION.into(),
        };
        let a = r
            .args(
                &["http://127.0.0.1:1".into(), "http://127.0.0.1:2".into()],
                &["http://127.0.0.1:3".into()],
                4,
                5,
            )
            .join(" ");
        assert_eq!(
            a,
            "-m sglang_router.launch_router --pd-disaggregation \
             --prefill http://127.0.0.1:1 8998 --prefill http://127.0.0.1:2 8998 \
             --decode http://127.0.0.1:3 --host 127.0.0.1 --port 4 \
             --prometheus-host 127.0.0.1 --prometheus-port 5 --log-level warn"
        );
        assert_eq!(r.python(), Path::new("/v/bin/python"));
    }
}

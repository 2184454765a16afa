//! The child processes of `kvpool up`: started through the harness in their own process groups
//! with their output in log files and the parent-death signal set (so they go away even if `up`
//! is killed), stopped in reverse start order with SIGTERM, a grace period, then SIGKILL.
//! Dropping the set stops whatever still runs, so an error halfway through start-up leaves no
//! process behind. I/O boundary: the agents' config files; the processes through
//! `kvpool_harness`.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use kvpool_harness::{ChildProcess, HarnessError, Launcher, kvpool_command};
use nix::sys::signal::Signal;

pub use kvpool_harness::Stopped;

use super::plan::ChildSpec;

/// Errors of starting children.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum ChildError {
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Spawn(HarnessError),
}

kvpool_runtime::error_category!(ChildError);

/// The running children, in start order.
pub struct Children {
    running: Vec<ChildProcess>,
    launcher: Launcher,
    /// Variables set in every child's environment (the master's CA with `--tls`).
    env: Vec<(&'static str, PathBuf)>,
    logs: PathBuf,
    grace: Duration,
}

impl std::fmt::Debug for Children {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Children")
            .field("names", &self.names())
            .field("logs", &self.logs)
            .finish()
    }
}

fn write_file(path: &Path, contents: &str) -> Result<(), ChildError> {
    let err = |source| ChildError::Write {
        path: path.to_owned(),
        source,
    };
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(err)?;
    }
    std::fs::write(path, contents).map_err(err)
}

impl Children {
    /// An empty set whose children log into `logs/<name>.log`.
    pub fn new(logs: PathBuf, grace: Duration) -> Self {
        // Its own process group keeps a terminal's Ctrl-C away from each child, so `up` alone
        // decides the stop order; the parent-death signal covers a killed `up`.
        let launcher = Launcher::new(logs.clone())
            .own_process_group()
            .parent_death_signal(Signal::SIGTERM);
        Self {
            running: Vec::new(),
            launcher,
            env: Vec::new(),
            logs,
            grace,
        }
    }

    /// Set `var` to `path` in the environment of every child started from now on.
    pub fn set_env(&mut self, var: &'static str, path: PathBuf) {
        self.env.push((var, path));
    }

    pub fn names(&self) -> Vec<&str> {
        self.running.iter().map(ChildProcess::name).collect()
    }

    /// Process ids of the running children, in start order.
    pub fn pids(&self) -> Vec<u32> {
        self.running.iter().map(ChildProcess::id).collect()
    }

    /// The log file of child `name`.
    pub fn log_path(&self, name: &str) -> PathBuf {
        self.launcher.log_path(name)
    }

    /// Writes the child's config file, if any, and starts it (its settings come from the
    /// command line, and the variables of [`Self::set_env`]). Must be called from the thread that stays alive as long as the
    /// children (the parent-death signal follows the thread).
    pub fn start(&mut self, spec: &ChildSpec) -> Result<u32, ChildError> {
        if let Some((path, contents)) = &spec.config_file {
            write_file(path, contents)?;
        }
        let mut cmd = kvpool_command(&spec.program);
        cmd.args(&spec.args);
        for (var, path) in &self.env {
            cmd.env(var, path);
        }
        for (var, value) in &spec.env {
            cmd.env(var, value);
        }
        let child = self
            .launcher
            .spawn(&spec.name, &mut cmd)
            .map_err(ChildError::Spawn)?;
        let pid = child.id();
        self.running.push(child);
        Ok(pid)
    }

    /// The first child that has exited, with its status.
    pub fn exited(&mut self) -> Option<(String, ExitStatus)> {
        self.running.iter_mut().find_map(|c| match c.try_status() {
            Ok(Some(status)) => Some((c.name().to_owned(), status)),
            _ => None,
        })
    }

    /// Stops every child, last started first: SIGTERM, wait up to the grace period, SIGKILL.
    /// Blocks the calling thread.
    pub fn stop_all(&mut self) -> Vec<Stopped> {
        let mut out = Vec::new();
        while let Some(mut c) = self.running.pop() {
            out.push(c.stop(self.grace));
        }
        out.reverse();
        out
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        if !self.running.is_empty() {
            self.stop_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::up::plan::Role;
    use nix::sys::signal::kill;
    use nix::unistd::Pid;

    fn spec(name: &str, program: &str, args: &[&str]) -> ChildSpec {
        ChildSpec {
            name: name.into(),
            role: Role::Master,
            program: program.into(),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            admin: "127.0.0.1:1".parse().unwrap(),
            endpoint: None,
            config_file: None,
            env: Vec::new(),
            ready_path: "/readyz",
        }
    }

    #[test]
    fn stop_terms_then_kills_and_reports() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Children::new(dir.path().join("logs"), Duration::from_millis(500));
        // Exits 0 on SIGTERM; ignores SIGTERM; exits early with 3.
        c.start(&spec(
            "polite",
            "sh",
            &["-c", "trap 'exit 0' TERM; while :; do sleep 0.05; done"],
        ))
        .unwrap();
        c.start(&spec(
            "stubborn",
            "sh",
            &["-c", "trap '' TERM; while :; do sleep 0.05; done"],
        ))
        .unwrap();
        c.start(&spec("quitter", "sh", &["-c", "echo bye; exit 3"]))
            .unwrap();
        let pids = c.pids();
        // Wait (bounded) for the quitter to exit.
        let mut exited = None;
        for _ in 0..500 {
            exited = c.exited();
            if exited.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let (name, status) = exited.unwrap();
        assert_eq!((name.as_str(), status.code()), ("quitter", Some(3)));
        // Give the shells time to install their traps.
        std::thread::sleep(Duration::from_millis(200));
        let stopped = c.stop_all();
        let by_name = |n: &str| stopped.iter().find(|s| s.name == n).unwrap().clone();
        assert!(by_name("polite").clean());
        assert_eq!(by_name("stubborn").status, None);
        assert!(by_name("quitter").early);
        // Every child was waited for: no process with those ids is left.
        for pid in pids {
            let pid = Pid::from_raw(i32::try_from(pid).unwrap());
            assert_eq!(kill(pid, None), Err(nix::errno::Errno::ESRCH));
        }
        assert_eq!(
            std::fs::read_to_string(c.log_path("quitter")).unwrap(),
            "bye\n"
        );
    }

    #[test]
    fn missing_program_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Children::new(dir.path().to_owned(), Duration::from_millis(100));
        let err = c
            .start(&spec("ghost", "/nonexistent/kvpool-agent", &[]))
            .unwrap_err();
        assert!(err.to_string().contains("ghost"), "{err}");
        assert_eq!(err.category(), "spawn");
    }
}

//! The child processes of `kvpool up`: started in their own process groups with their output in
//! log files and the parent-death signal set (so they go away even if `up` is killed), stopped
//! in reverse start order
//! with SIGTERM, a grace period, then SIGKILL. Dropping the set stops whatever still runs, so an
//! error halfway through start-up leaves no process behind. I/O boundary: fork/exec, signals,
//! the log files.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

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
    #[error("cannot start {name} ({program})")]
    Spawn {
        name: String,
        program: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl ChildError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// How a child ended when it was stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stopped {
    pub name: String,
    /// Exit status after SIGTERM, or `None` when it had to be killed.
    pub status: Option<ExitStatus>,
    /// It had already exited before the stop.
    pub early: bool,
}

impl Stopped {
    /// Exited 0 on its own after SIGTERM.
    pub fn clean(&self) -> bool {
        !self.early && self.status.is_some_and(|s| s.success())
    }
}

struct Running {
    name: String,
    child: Child,
}

/// The running children, in start order.
pub struct Children {
    running: Vec<Running>,
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
        Self {
            running: Vec::new(),
            logs,
            grace,
        }
    }

    pub fn names(&self) -> Vec<&str> {
        self.running.iter().map(|r| r.name.as_str()).collect()
    }

    /// Process ids of the running children, in start order.
    pub fn pids(&self) -> Vec<u32> {
        self.running.iter().map(|r| r.child.id()).collect()
    }

    /// The log file of child `name`.
    pub fn log_path(&self, name: &str) -> PathBuf {
        self.logs.join(format!("{name}.log"))
    }

    /// Writes the child's config file, if any, and starts it. Must be called from the thread
    /// that stays alive as long as the children (the parent-death signal follows the thread).
    pub fn start(&mut self, spec: &ChildSpec) -> Result<u32, ChildError> {
        if let Some((path, contents)) = &spec.config_file {
            write_file(path, contents)?;
        }
        let log_path = self.log_path(&spec.name);
        write_file(&log_path, "")?;
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(&log_path)
            .map_err(|source| ChildError::Write {
                path: log_path.clone(),
                source,
            })?;
        let log2 = log.try_clone().map_err(|source| ChildError::Write {
            path: log_path.clone(),
            source,
        })?;
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2))
            // The children get their settings from the command line only.
            .env_remove("KVPOOL_MASTER")
            .env_remove("KVPOOL_AUTH_KEY_FILE")
            .env_remove("KVPOOL_AGENT_SOCKET")
            .env_remove("KVPOOL_MODEL_CONFIG")
            .env_remove("KVPOOL_KV_BYTES_PER_TOKEN")
            .env_remove("POD_IP");
        // SAFETY: the closure runs in the forked child before exec and only makes the setpgid
        // and prctl system calls (async-signal-safe); it touches no memory shared with the
        // parent. Its own process group keeps a terminal's Ctrl-C away from the child, so
        // `up` alone decides the stop order; the parent-death signal covers a killed `up`.
        unsafe {
            cmd.pre_exec(|| {
                nix::unistd::setpgid(Pid::from_raw(0), Pid::from_raw(0))
                    .map_err(std::io::Error::from)?;
                nix::sys::prctl::set_pdeathsig(Signal::SIGTERM).map_err(std::io::Error::from)
            });
        }
        let child = cmd.spawn().map_err(|source| ChildError::Spawn {
            name: spec.name.clone(),
            program: spec.program.clone(),
            source,
        })?;
        let pid = child.id();
        self.running.push(Running {
            name: spec.name.clone(),
            child,
        });
        Ok(pid)
    }

    /// The first child that has exited, with its status.
    pub fn exited(&mut self) -> Option<(String, ExitStatus)> {
        self.running
            .iter_mut()
            .find_map(|r| match r.child.try_wait() {
                Ok(Some(status)) => Some((r.name.clone(), status)),
                _ => None,
            })
    }

    /// Stops every child, last started first: SIGTERM, wait up to the grace period, SIGKILL.
    /// Blocks the calling thread.
    pub fn stop_all(&mut self) -> Vec<Stopped> {
        let mut out = Vec::new();
        while let Some(mut r) = self.running.pop() {
            out.push(stop_one(&mut r, self.grace));
        }
        out.reverse();
        out
    }
}

fn stop_one(r: &mut Running, grace: Duration) -> Stopped {
    if let Ok(Some(status)) = r.child.try_wait() {
        return Stopped {
            name: r.name.clone(),
            status: Some(status),
            early: true,
        };
    }
    if let Ok(raw) = i32::try_from(r.child.id()) {
        let _ = kill(Pid::from_raw(raw), Signal::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(status)) = r.child.try_wait() {
            return Stopped {
                name: r.name.clone(),
                status: Some(status),
                early: false,
            };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    tracing::warn!(child = %r.name, "did not stop within the grace period; killing it");
    let _ = r.child.kill();
    let _ = r.child.wait();
    Stopped {
        name: r.name.clone(),
        status: None,
        early: false,
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

    fn spec(name: &str, program: &str, args: &[&str]) -> ChildSpec {
        ChildSpec {
            name: name.into(),
            role: Role::Master,
            program: program.into(),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            admin: "127.0.0.1:1".parse().unwrap(),
            endpoint: None,
            config_file: None,
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

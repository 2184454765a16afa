//! Child processes of tests, benchmarks and `kvpool up`. A [`Launcher`] starts each child with
//! its stdout and stderr in `<logs>/<name>.log` (stdin and stdout may be pipes instead),
//! optionally in its own process group and with a parent-death signal. A [`ChildProcess`] is
//! killed and reaped when dropped, stops gracefully (SIGTERM, a grace period, SIGKILL), waits
//! with a timeout, and reports an early exit or a readiness timeout with the tail of its log.
//! I/O boundary: fork/exec, signals, the log files.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::error::HarnessError;
use crate::probe::Probe;

/// How often exits, probes and log lines are polled.
const POLL: Duration = Duration::from_millis(20);
/// Log lines quoted in an error.
pub const TAIL_LINES: usize = 20;

/// Starts children with their output in one log directory.
#[derive(Clone, Debug)]
pub struct Launcher {
    logs: PathBuf,
    own_process_group: bool,
    parent_death_signal: Option<Signal>,
    pipe_stdin: bool,
    pipe_stdout: bool,
}

impl Launcher {
    /// Children log into `logs/<name>.log` (the directory is created on the first start).
    pub fn new(logs: impl Into<PathBuf>) -> Self {
        Self {
            logs: logs.into(),
            own_process_group: false,
            parent_death_signal: None,
            pipe_stdin: false,
            pipe_stdout: false,
        }
    }

    /// Each child leads its own process group, so a terminal's Ctrl-C reaches only the parent,
    /// which alone decides the stop order.
    pub fn own_process_group(mut self) -> Self {
        self.own_process_group = true;
        self
    }

    /// Each child gets `signal` when the thread that started it ends (PR_SET_PDEATHSIG): start
    /// children from the thread that lives as long as they should.
    pub fn parent_death_signal(mut self, signal: Signal) -> Self {
        self.parent_death_signal = Some(signal);
        self
    }

    /// Stdin is a pipe ([`ChildProcess::take_stdin`]) instead of /dev/null.
    pub fn pipe_stdin(mut self) -> Self {
        self.pipe_stdin = true;
        self
    }

    /// Stdout is a pipe ([`ChildProcess::take_stdout`]) instead of the log file.
    pub fn pipe_stdout(mut self) -> Self {
        self.pipe_stdout = true;
        self
    }

    /// The log file of child `name`.
    pub fn log_path(&self, name: &str) -> PathBuf {
        self.logs.join(format!("{name}.log"))
    }

    /// Starts `cmd` as child `name`. Its stdio is set here; everything else (arguments,
    /// environment, working directory) is the caller's.
    pub fn spawn(&self, name: &str, cmd: &mut Command) -> Result<ChildProcess, HarnessError> {
        let log = self.log_path(name);
        let write_err = |source| HarnessError::Write {
            path: log.clone(),
            source,
        };
        std::fs::create_dir_all(&self.logs).map_err(|source| HarnessError::Write {
            path: self.logs.clone(),
            source,
        })?;
        let out = File::create(&log).map_err(write_err)?;
        let err = out.try_clone().map_err(write_err)?;
        cmd.stdin(if self.pipe_stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(if self.pipe_stdout {
            Stdio::piped()
        } else {
            Stdio::from(out)
        })
        .stderr(Stdio::from(err));
        let (group, death) = (self.own_process_group, self.parent_death_signal);
        if group || death.is_some() {
            // SAFETY: the closure runs in the forked child before exec and only makes the
            // setpgid and prctl system calls (async-signal-safe); it touches no memory shared
            // with the parent (`group` and `death` are copies).
            unsafe {
                cmd.pre_exec(move || {
                    if group {
                        nix::unistd::setpgid(Pid::from_raw(0), Pid::from_raw(0))
                            .map_err(std::io::Error::from)?;
                    }
                    if let Some(signal) = death {
                        nix::sys::prctl::set_pdeathsig(signal).map_err(std::io::Error::from)?;
                    }
                    Ok(())
                });
            }
        }
        let child = cmd.spawn().map_err(|source| HarnessError::Spawn {
            name: name.to_owned(),
            program: PathBuf::from(cmd.get_program()),
            source,
        })?;
        Ok(ChildProcess {
            name: name.to_owned(),
            child,
            log,
            status: None,
        })
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

/// A running (or reaped) child with its log file; killed and reaped on drop.
#[derive(Debug)]
pub struct ChildProcess {
    name: String,
    child: Child,
    log: PathBuf,
    /// Set once the exit status was collected: the pid is no longer ours to signal.
    status: Option<ExitStatus>,
}

impl ChildProcess {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The whole log so far (empty when it cannot be read).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `lines` lines of the log, stack backtraces left out (with `RUST_BACKTRACE` set,
    /// a child's frames would otherwise push its error message out of the tail).
    pub fn log_tail(&self, lines: usize) -> String {
        tail_without_backtraces(&self.log_text(), lines)
    }

    /// The write end of a piped stdin ([`Launcher::pipe_stdin`]); dropping it closes the pipe.
    pub fn take_stdin(&mut self) -> Option<ChildStdin> {
        self.child.stdin.take()
    }

    /// The read end of a piped stdout ([`Launcher::pipe_stdout`]).
    pub fn take_stdout(&mut self) -> Option<ChildStdout> {
        self.child.stdout.take()
    }

    /// The exit status if the child has exited (without blocking).
    pub fn try_status(&mut self) -> Result<Option<ExitStatus>, HarnessError> {
        if self.status.is_none() {
            self.status = self
                .child
                .try_wait()
                .map_err(|source| self.wait_error(source))?;
        }
        Ok(self.status)
    }

    /// Ok while the child runs; its exit (status and log tail) as the error once it ended.
    pub fn assert_running(&mut self) -> Result<(), HarnessError> {
        match self.try_status()? {
            None => Ok(()),
            Some(status) => Err(self.exited_error(status)),
        }
    }

    /// The child closed its pipes or its work is over: wait (up to `timeout`) for its exit and
    /// describe it as an error.
    pub fn exit_error(&mut self, timeout: Duration) -> HarnessError {
        match self.wait_timeout(timeout) {
            Ok(status) => self.exited_error(status),
            Err(e) => e,
        }
    }

    /// Blocks until the child exits.
    pub fn wait(&mut self) -> Result<ExitStatus, HarnessError> {
        if let Some(status) = self.status {
            return Ok(status);
        }
        let status = self
            .child
            .wait()
            .map_err(|source| self.wait_error(source))?;
        self.status = Some(status);
        Ok(status)
    }

    /// Waits up to `timeout` for the child to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<ExitStatus, HarnessError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_status()? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                return Err(HarnessError::StillRunning {
                    name: self.name.clone(),
                    timeout,
                    log: self.log.clone(),
                    tail: self.log_tail(TAIL_LINES),
                });
            }
            std::thread::sleep(POLL);
        }
    }

    /// Sends `signal` to the child; nothing once it has been reaped (its pid may be reused
    /// then; until then an exited child's pid stays its own).
    pub fn signal(&self, signal: Signal) -> Result<(), HarnessError> {
        if self.status.is_some() {
            return Ok(());
        }
        let err = |source| HarnessError::Signal {
            name: self.name.clone(),
            source,
        };
        let pid = i32::try_from(self.child.id()).map_err(|_| err(nix::Error::ESRCH))?;
        kill(Pid::from_raw(pid), signal).map_err(err)
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) -> Result<ExitStatus, HarnessError> {
        self.signal(Signal::SIGKILL)?;
        self.wait()
    }

    /// SIGTERM, `timeout` to exit, and its exit status (the child is still killed on drop when
    /// it does not exit).
    pub fn terminate(&mut self, timeout: Duration) -> Result<ExitStatus, HarnessError> {
        self.signal(Signal::SIGTERM)?;
        self.wait_timeout(timeout)
    }

    /// Stops the child: SIGTERM, up to `grace` to exit, then SIGKILL. Blocks the calling thread.
    pub fn stop(&mut self, grace: Duration) -> Stopped {
        let name = self.name.clone();
        let stopped = |status, early| Stopped {
            name,
            status,
            early,
        };
        if let Ok(Some(status)) = self.try_status() {
            return stopped(Some(status), true);
        }
        match self.terminate(grace) {
            Ok(status) => stopped(Some(status), false),
            Err(_) => {
                tracing::warn!(child = %self.name, "did not stop within the grace period; killing it");
                let _ = self.kill();
                stopped(None, false)
            }
        }
    }

    /// Polls `probe` until it succeeds; fails when the child exits first or `timeout` passes.
    pub fn wait_ready(&mut self, probe: &Probe, timeout: Duration) -> Result<(), HarnessError> {
        self.poll_until(&probe.to_string(), timeout, || probe.check().then_some(()))
    }

    /// Polls the log until a line satisfies `matches` and returns that line; fails when the
    /// child exits first or `timeout` passes. `what` names the line in the error.
    pub fn wait_for_log_line(
        &mut self,
        what: &str,
        timeout: Duration,
        mut matches: impl FnMut(&str) -> bool,
    ) -> Result<String, HarnessError> {
        let log = self.log.clone();
        self.poll_until(what, timeout, || log_lines(&log).find(|l| matches(l)))
    }

    fn poll_until<T>(
        &mut self,
        what: &str,
        timeout: Duration,
        mut done: impl FnMut() -> Option<T>,
    ) -> Result<T, HarnessError> {
        let deadline = Instant::now() + timeout;
        loop {
            self.assert_running()?;
            if let Some(v) = done() {
                return Ok(v);
            }
            if Instant::now() >= deadline {
                return Err(HarnessError::NotReady {
                    name: self.name.clone(),
                    what: what.to_owned(),
                    timeout,
                    log: self.log.clone(),
                    tail: self.log_tail(TAIL_LINES),
                });
            }
            std::thread::sleep(POLL);
        }
    }

    fn exited_error(&self, status: ExitStatus) -> HarnessError {
        HarnessError::Exited {
            name: self.name.clone(),
            status,
            log: self.log.clone(),
            tail: self.log_tail(TAIL_LINES),
        }
    }

    fn wait_error(&self, source: std::io::Error) -> HarnessError {
        HarnessError::Wait {
            name: self.name.clone(),
            source,
        }
    }
}

/// The lines of the log at `path` as they are now.
fn log_lines(path: &Path) -> impl Iterator<Item = String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect::<Vec<_>>()
        .into_iter()
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The last `lines` lines of `text` that are not part of a Rust stack backtrace (the
/// `stack backtrace:`/`Stack backtrace:` header, numbered frames, their `at` lines and the
/// closing note).
fn tail_without_backtraces(text: &str, lines: usize) -> String {
    let mut kept: Vec<&str> = Vec::new();
    let mut in_trace = false;
    for line in text.lines() {
        let t = line.trim_start();
        if t.eq_ignore_ascii_case("stack backtrace:") {
            in_trace = true;
            continue;
        }
        if in_trace {
            let frame = t
                .split_once(':')
                .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
            if frame || t.starts_with("at ") || t.starts_with("note: Some details are omitted") {
                continue;
            }
            in_trace = false;
        }
        kept.push(line);
    }
    let start = kept.len().saturating_sub(lines);
    kept[start..].join("\n")
}

#[cfg(test)]
mod tail_tests {
    use super::tail_without_backtraces;

    #[test]
    fn the_error_survives_a_long_backtrace() {
        let mut log = String::from(
            "starting\nError: admin server: bind 127.0.0.1:1: Address in use\n\nStack backtrace:\n",
        );
        for i in 0..40 {
            log.push_str(&format!(
                "  {i}: frame::{i}\n             at ./src/x.rs:{i}:1\n"
            ));
        }
        log.push_str("note: Some details are omitted, run with `RUST_BACKTRACE=full`\nlast line\n");
        let tail = tail_without_backtraces(&log, 3);
        assert_eq!(
            tail,
            "Error: admin server: bind 127.0.0.1:1: Address in use\n\nlast line"
        );
        assert_eq!(tail_without_backtraces("a\nb\nc", 2), "b\nc");
    }
}

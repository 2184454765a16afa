//! The one error type of the harness: every variant names the process (or the port, file or
//! binary) it is about, and the ones about a child carry its log file and the last lines of it,
//! so that a failing test or benchmark says why without a second look. I/O boundary: none.

use std::fmt;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

/// Errors of starting, watching and stopping child processes and throw-away servers.
#[derive(thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum HarnessError {
    #[error("no free port on 127.0.0.1")]
    Port(#[source] std::io::Error),
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
    #[error("{binary} not found on PATH (install the Debian package {package})")]
    Missing {
        binary: &'static str,
        package: &'static str,
    },
    #[error("{name} exited early ({status}); last lines of {}:\n{tail}", log.display())]
    Exited {
        name: String,
        status: ExitStatus,
        log: PathBuf,
        tail: String,
    },
    #[error("{name}: {what} not seen within {timeout:?}; last lines of {}:\n{tail}", log.display())]
    NotReady {
        name: String,
        what: String,
        timeout: Duration,
        log: PathBuf,
        tail: String,
    },
    #[error("{name} did not exit within {timeout:?}; last lines of {}:\n{tail}", log.display())]
    StillRunning {
        name: String,
        timeout: Duration,
        log: PathBuf,
        tail: String,
    },
    #[error("cannot signal {name}")]
    Signal {
        name: String,
        #[source]
        source: nix::Error,
    },
    #[error("{command} failed ({status}); its stderr:\n{stderr}")]
    Failed {
        command: String,
        status: ExitStatus,
        stderr: String,
    },
    #[error("{command} printed no JSON on stdout")]
    NotJson {
        command: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("cannot wait for {name}")]
    Wait {
        name: String,
        #[source]
        source: std::io::Error,
    },
}

impl HarnessError {
    /// Short label for metrics and logs.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// The message and its sources, as `Display` shows them: `expect()` in a test then prints the
/// log tail as lines rather than an escaped struct.
impl fmt::Debug for HarnessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")?;
        let mut source = std::error::Error::source(self);
        while let Some(s) = source {
            write!(f, ": {s}")?;
            source = s.source();
        }
        Ok(())
    }
}

/// The former name of [`HarnessError`], from when the crate only held test helpers.
pub type TestingError = HarnessError;

//! A Python script of `tests/python/` run with the pinned venv (`.tools/py`, made by
//! `scripts/python-env.sh --tools`, which `scripts/test.sh` runs) and driven one JSON line per
//! command: its first line is a JSON greeting, each command gets one JSON answer. A missing venv
//! fails the test (never a skip). Killed when dropped. I/O boundary: the child process.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use serde_json::Value;

/// The venv's interpreter; panics naming the command that makes it when it is missing.
pub fn python() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(".tools/py/bin/python");
    assert!(
        p.exists(),
        "{} is missing: run scripts/python-env.sh --tools (scripts/test.sh does)",
        p.display()
    );
    p
}

/// A running script and its JSON-lines conversation.
pub struct PyChild {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// The script's first line.
    pub greeting: Value,
}

impl PyChild {
    /// Starts `tests/python/<script>` with `args` and reads its greeting line.
    pub fn start(script: &str, args: &[String]) -> Self {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut child = Command::new(python())
            .arg(root.join("tests/python").join(script))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start {script}: {e}"));
        let stdin = child.stdin.take().expect("stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("greeting line");
        let greeting = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("{script}: greeting {line:?}: {e}"));
        Self {
            child,
            stdin,
            stdout,
            greeting,
        }
    }

    /// Sends one command and reads its answer.
    pub fn send(&mut self, cmd: Value) -> Value {
        writeln!(self.stdin, "{cmd}").expect("command");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("answer");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{cmd}: {e}: {line:?}"))
    }
}

impl Drop for PyChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

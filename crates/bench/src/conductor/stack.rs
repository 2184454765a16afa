//! The engines and the conductor of `kvpool bench conductor`: one `kvpool up --json
//! --engine-protocol sglang` child (this executable again), whose ready line names the
//! conductor and the engines, all on 127.0.0.1. I/O boundary: the child process and its log.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use kvpool_harness::process::ChildProcess;
use serde_json::Value;

use super::{ConductorBenchArgs, ConductorBenchError};
use crate::mooncake;

/// How long `kvpool up` gets to report ready (master, agents, engines, conductor).
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// What `kvpool up --json` said once everything was ready.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stack {
    /// The conductor's base URL.
    pub conductor: String,
    /// Base URLs of the prefill and decode engines.
    pub prefill: Vec<String>,
    pub decode: Vec<String>,
}

/// Parses `kvpool up --json`'s ready line: `{"ready": true, "conductor": URL, "children":
/// [{"name", "role", "endpoint", "admin"}, ...], ...}`. `None` for any other line.
pub fn parse_ready(line: &str) -> Option<Stack> {
    let v: Value = serde_json::from_str(line.trim()).ok()?;
    if v["ready"] != Value::Bool(true) {
        return None;
    }
    let endpoints = |role: &str| -> Vec<String> {
        v["children"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|c| c["role"] == role)
            .filter_map(|c| c["endpoint"].as_str().map(str::to_owned))
            .collect()
    };
    let stack = Stack {
        conductor: v["conductor"].as_str()?.to_owned(),
        prefill: endpoints("prefill"),
        decode: endpoints("decode"),
    };
    (!stack.prefill.is_empty() && !stack.decode.is_empty()).then_some(stack)
}

/// `kvpool up`'s arguments for the bench's engines.
pub(super) fn up_args(args: &ConductorBenchArgs, dir: &Path) -> Vec<String> {
    let mut a: Vec<String> = ["up", "--json", "--engine-protocol", "sglang"]
        .map(String::from)
        .into();
    for (flag, value) in [
        ("--prefill", args.prefill.to_string()),
        ("--decode", args.decode.to_string()),
        ("--agents", args.agents.to_string()),
        ("--time-scale", args.time_scale.to_string()),
        ("--model", args.model.clone()),
        ("--dir", dir.display().to_string()),
    ] {
        a.extend([flag.to_owned(), value]);
    }
    a
}

/// Starts `kvpool up` with `args` and waits for its ready line.
pub(super) fn start(
    up_args: &[String],
    logs: &Path,
) -> Result<(ChildProcess, Stack), ConductorBenchError> {
    let exe = std::env::current_exe().map_err(ConductorBenchError::Io)?;
    let mut child = mooncake::launcher(logs)
        .spawn("kvpool-up", Command::new(exe).args(up_args))
        .map_err(ConductorBenchError::Process)?;
    let line = child
        .wait_for_log_line("the ready line", READY_TIMEOUT, |l| {
            parse_ready(l).is_some()
        })
        .map_err(ConductorBenchError::Process)?;
    let stack = parse_ready(&line)
        .ok_or_else(|| ConductorBenchError::Up(format!("unreadable ready line: {line}")))?;
    Ok((child, stack))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ready_line_names_the_conductor_and_the_engines_by_role() {
        let line = r#"{"auth_key_file":"/d/auth.key","children":[
            {"admin":"http://127.0.0.1:1","endpoint":"127.0.0.1:9","name":"master","role":"master"},
            {"admin":"http://127.0.0.1:2","endpoint":"http://127.0.0.1:3","name":"prefill-0","role":"prefill"},
            {"admin":"http://127.0.0.1:4","endpoint":"http://127.0.0.1:5","name":"decode-0","role":"decode"},
            {"admin":"http://127.0.0.1:6","endpoint":"http://127.0.0.1:7","name":"decode-1","role":"decode"},
            {"admin":"http://127.0.0.1:8","endpoint":"http://127.0.0.1:10","name":"conductor","role":"conductor"}],
            "conductor":"http://127.0.0.1:10","dir":"/d","master":"127.0.0.1:9","ready":true}"#
            .replace('\n', "");
        assert_eq!(
            parse_ready(&line),
            Some(Stack {
                conductor: "http://127.0.0.1:10".into(),
                prefill: vec!["http://127.0.0.1:3".into()],
                decode: vec!["http://127.0.0.1:5".into(), "http://127.0.0.1:7".into()],
            })
        );
    }

    #[test]
    fn other_lines_and_stacks_without_engines_are_not_ready_lines() {
        assert_eq!(parse_ready("2026-12-02 INFO kvpool up: starting"), None);
        assert_eq!(parse_ready(r#"{"ready":false,"conductor":"x"}"#), None);
        assert_eq!(
            parse_ready(r#"{"ready":true,"conductor":"x","children":[]}"#),
            None
        );
    }
}

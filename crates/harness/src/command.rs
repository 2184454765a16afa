//! The command line of a kvpool child: the `kvpool` executable (the caller names it: `kvpool
//! up` and the benchmarks pass `std::env::current_exe()`, tests `env!("CARGO_BIN_EXE_kvpool")`)
//! with the environment variables that would override its flags removed, so that a child gets
//! its settings from the command line only; and running a short-lived command to completion
//! ([`output_ok`], [`output_json`]). I/O boundary: the commands [`output_ok`] runs.

use std::path::Path;
use std::process::{Command, Output};

use crate::error::HarnessError;

/// Variables a kvpool role reads as defaults of its flags, which a parent's environment (an
/// operator pod, a developer's shell) must not leak into its children.
pub const CLEARED_ENV: [&str; 16] = [
    "KVPOOL_MASTER",
    // TLS of the master's port and of its clients (`kvpool up --tls` sets the clients' own).
    "KVPOOL_MASTER_TLS_CERT_FILE",
    "KVPOOL_MASTER_TLS_KEY_FILE",
    "KVPOOL_MASTER_TLS_CLIENT_CA_FILE",
    "KVPOOL_MASTER_CA_FILE",
    "KVPOOL_MASTER_CLIENT_CERT_FILE",
    "KVPOOL_MASTER_CLIENT_KEY_FILE",
    "KVPOOL_MASTER_SERVER_NAME",
    // TLS of the clients' own transfer engines (`kvpool up --tls` sets them).
    "KVPOOL_TRANSFER_TLS",
    "KVPOOL_TRANSFER_CA_FILE",
    "KVPOOL_TRANSFER_SERVER_NAME",
    "KVPOOL_AUTH_KEY_FILE",
    "KVPOOL_AGENT_SOCKET",
    "KVPOOL_MODEL_CONFIG",
    "KVPOOL_KV_BYTES_PER_TOKEN",
    "POD_IP",
];

/// `exe` with [`CLEARED_ENV`] removed; the caller adds the role and its flags.
pub fn kvpool_command(exe: &Path) -> Command {
    let mut cmd = Command::new(exe);
    for var in CLEARED_ENV {
        cmd.env_remove(var);
    }
    cmd
}

fn describe(cmd: &Command) -> String {
    let mut words = vec![cmd.get_program().to_string_lossy().into_owned()];
    words.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
    words.join(" ")
}

/// Runs `cmd` to completion; its output when it exits 0, else an error with its stderr.
pub fn output_ok(cmd: &mut Command) -> Result<Output, HarnessError> {
    let out = cmd.output().map_err(|source| HarnessError::Spawn {
        name: describe(cmd),
        program: cmd.get_program().into(),
        source,
    })?;
    if !out.status.success() {
        return Err(HarnessError::Failed {
            command: describe(cmd),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(out)
}

/// Like [`output_ok`], and parses what the command printed on stdout as one JSON document.
pub fn output_json(cmd: &mut Command) -> Result<serde_json::Value, HarnessError> {
    let out = output_ok(cmd)?;
    serde_json::from_slice(&out.stdout).map_err(|source| HarnessError::NotJson {
        command: describe(cmd),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_name_the_command_and_carry_its_stderr() {
        let e = output_ok(Command::new("sh").args(["-c", "echo oops >&2; exit 3"])).unwrap_err();
        let text = e.to_string();
        assert!(text.starts_with("sh -c echo oops"), "{text}");
        assert!(text.contains("oops\n"), "{text}");
        let v = output_json(Command::new("sh").args(["-c", "echo '{\"a\": 1}'"])).expect("json");
        assert_eq!(v["a"], 1);
        assert!(matches!(
            output_json(Command::new("sh").args(["-c", "echo nope"])),
            Err(HarnessError::NotJson { .. })
        ));
    }
}

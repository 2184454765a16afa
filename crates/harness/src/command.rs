//! The command line of a kvpool child: the `kvpool` executable (the caller names it: `kvpool
//! up` and the benchmarks pass `std::env::current_exe()`, tests `env!("CARGO_BIN_EXE_kvpool")`)
//! with the environment variables that would override its flags removed, so that a child gets
//! its settings from the command line only. I/O boundary: none (builds a `Command`).

use std::path::Path;
use std::process::Command;

/// Variables a kvpool role reads as defaults of its flags, which a parent's environment (an
/// operator pod, a developer's shell) must not leak into its children.
pub const CLEARED_ENV: [&str; 6] = [
    "KVPOOL_MASTER",
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

//! The `kvpool` executable's library: its command line (one subcommand per role, dispatched to
//! the crates that implement them), `kvpool up` (every component on one machine), and the
//! command-line front ends of the pure simulators. The binary in `main.rs` only parses and calls
//! [`cli::run`]. Kept as a library so that tests parse container arguments with exactly the
//! binary's parser (the operator's contract test) and drive `up` in-process.

pub mod cli;
pub mod simulate;
pub mod simulate_cache;
pub mod up;

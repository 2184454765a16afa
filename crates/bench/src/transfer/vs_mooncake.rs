//! `kvpool bench transfer --vs_mooncake`: Mooncake's own `transfer_engine_bench` (from its PyPI
//! wheel) run with the same operation, block size, batch size, threads, duration and buffer
//! over TCP on loopback, in the same command as kvpool's run, in alternating order.
//! Mooncake's two processes are fresh for every round: a target serving its buffer through
//! its P2P handshake (no metadata server), and an initiator driving it.
//! I/O boundary: Mooncake's child processes and their logs.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::mooncake::{self, Mooncake, MooncakeError};

use super::{OperationArg, TransferBenchArgs};

/// One run of Mooncake's initiator.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MooncakeRun {
    pub gb_per_s: f64,
    pub seconds: f64,
    pub batches: u64,
}

/// What Mooncake's initiator printed at the end: `(duration s, batch count, throughput)`.
pub(super) fn parse_completed(log: &str) -> Option<(f64, u64, f64)> {
    let line = log.lines().rev().find(|l| l.contains("Test completed:"))?;
    let field = |name: &str| -> Option<&str> {
        let rest = &line[line.find(name)? + name.len()..];
        rest.trim_start().split([',', ' ']).next()
    };
    let duration = field("duration")?.parse().ok()?;
    let batches = field("batch count")?.parse().ok()?;
    let throughput = field("throughput")?.parse().ok()?;
    Some((duration, batches, throughput))
}

/// The port the target's P2P handshake listens on, from its log.
pub(super) fn parse_handshake_port(log: &str) -> Option<u16> {
    let at = log.find("listening on ")?;
    let addr = log[at + "listening on ".len()..]
        .split_whitespace()
        .next()?;
    addr.rsplit(':').next()?.parse().ok()
}

/// The buffer Mooncake needs: its initiator addresses `threads x batch_size` blocks.
fn buffer_size(args: &TransferBenchArgs) -> u64 {
    let needed = args.threads as u64 * args.batch_size as u64 * args.block_size;
    needed.max(args.buffer_size)
}

/// The flags both of Mooncake's processes share.
fn common(args: &TransferBenchArgs, port: u16) -> Vec<String> {
    vec![
        "--metadata_server=P2PHANDSHAKE".into(),
        "--protocol=tcp".into(),
        format!("--local_server_name=127.0.0.1:{port}"),
        format!("--buffer_size={}", buffer_size(args)),
    ]
}

/// The initiator's command line (without the program), for the report.
pub(super) fn initiator_flags(args: &TransferBenchArgs, port: u16, target: &str) -> Vec<String> {
    let mut flags = vec!["--mode=initiator".to_owned()];
    flags.extend(common(args, port));
    flags.extend([
        format!("--segment_id={target}"),
        format!(
            "--operation={}",
            match args.operation {
                OperationArg::Read => "read",
                OperationArg::Write => "write",
            }
        ),
        format!("--block_size={}", args.block_size),
        format!("--batch_size={}", args.batch_size),
        format!("--threads={}", args.threads),
        // Mooncake takes whole seconds.
        format!(
            "--duration={}",
            args.duration
                .unwrap_or(super::DEFAULT_DURATION)
                .as_secs_f64()
                .ceil()
                .max(1.0)
        ),
        "--report_precision=4".into(),
    ]);
    flags
}

/// One round of Mooncake: a fresh target and an initiator against it.
pub(super) fn run_round(
    mc: &Mooncake,
    args: &TransferBenchArgs,
    logs: &Path,
    round: usize,
) -> Result<MooncakeRun, MooncakeError> {
    let bench = mc.bin("transfer_engine_bench");
    let ports = kvpool_harness::ports::free_ports(2)
        .map_err(|e| MooncakeError::Peer(format!("no free port: {e}")))?;
    let launcher = mooncake::launcher(logs);
    let mut target_cmd = Command::new(&bench);
    target_cmd.arg("--mode=target").args(common(args, ports[0]));
    let mut target = launcher
        .spawn(&format!("mooncake-target-{round}"), &mut target_cmd)
        .map_err(|e| MooncakeError::Peer(e.to_string()))?;
    let port = mooncake::wait_for_log(
        &mut target,
        Duration::from_secs(20),
        "its handshake port",
        parse_handshake_port,
    )?;
    // The buffer is allocated and registered after the port is bound.
    mooncake::wait_for_log(&mut target, Duration::from_secs(60), "its buffer", |l| {
        l.contains("numa node num").then_some(())
    })?;
    let flags = initiator_flags(args, ports[1], &format!("127.0.0.1:{port}"));
    let timeout = args.duration.unwrap_or(super::DEFAULT_DURATION) + Duration::from_secs(60);
    // The target may still be registering its buffer when the first initiator asks for it:
    // that initiator fails at once ("Unable to get target segment ID") and is run again.
    for attempt in 0..3 {
        let mut cmd = Command::new(&bench);
        cmd.args(&flags);
        let mut init = launcher
            .spawn(&format!("mooncake-initiator-{round}-{attempt}"), &mut cmd)
            .map_err(|e| MooncakeError::Peer(e.to_string()))?;
        let status = init
            .wait_timeout(timeout)
            .map_err(|e| MooncakeError::Peer(e.to_string()))?;
        let log = init.log_text();
        if let Some((seconds, batches, throughput)) = parse_completed(&log) {
            let bytes = batches as f64 * args.batch_size as f64 * args.block_size as f64;
            let gb_per_s = if seconds > 0.0 {
                bytes / seconds / 1e9
            } else {
                throughput
            };
            return Ok(MooncakeRun {
                gb_per_s,
                seconds,
                batches,
            });
        }
        if !log.contains("Unable to get target segment") || attempt == 2 {
            return Err(MooncakeError::Peer(format!(
                "transfer_engine_bench --mode=initiator ended ({status}) without a result: {}",
                mooncake::tail(&log, 1500)
            )));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    Err(MooncakeError::Peer(
        "unreachable: no initiator attempt left".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_initiators_result_line_is_parsed() {
        let log = "I1201 21:57:02.170234 32278 transfer_engine_bench.cpp:335] DRAM is used, numa node num: 1\n\
                   I1201 21:57:05.178709 32278 transfer_engine_bench.cpp:569] Test completed: duration 3.01, batch count 297, throughput 0.8300 GB/s\n";
        assert_eq!(parse_completed(log), Some((3.01, 297, 0.83)));
        assert_eq!(parse_completed("Worker 0 stopped!"), None);
        assert_eq!(
            parse_completed("Test completed: duration x, batch count 1, throughput 1 GB/s"),
            None
        );
    }

    #[test]
    fn the_targets_handshake_port_is_parsed() {
        let log = "I1201 transfer_engine_impl.cpp:183] Transfer Engine RPC using P2P handshake, listening on 127.0.0.1:16362\n";
        assert_eq!(parse_handshake_port(log), Some(16362));
        assert_eq!(parse_handshake_port("listening on nowhere"), None);
    }
}

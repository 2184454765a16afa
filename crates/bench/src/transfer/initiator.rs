//! The initiator side of `kvpool bench transfer`: `--threads` threads each submitting batches of
//! `--batch-size` requests against the target's segment for `--duration`, and the throughput and
//! batch-latency figures of the run. I/O boundary: the transfer engine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use kvpool_transfer::{
    HostOptions, LocalSegment, RemoteSegment, RequestStatus, Segment, SegmentDescriptor,
    TransferEngine, TransferOp, TransferRequest,
};

use super::{DEFAULT_DURATION, TransferBenchArgs, TransferBenchError};

/// Results of one initiator run.
#[derive(Clone, Debug, serde::Serialize)]
pub struct InitiatorReport {
    pub protocol: &'static str,
    pub operation: &'static str,
    pub block_size: u64,
    pub batch_size: usize,
    pub threads: usize,
    pub lanes: usize,
    /// The initiator's per-frame integrity setting (`require`: every frame sealed).
    pub integrity: &'static str,
    /// The engines' transfer TLS setting (`require` in the TLS run of `--tls`).
    pub tls: &'static str,
    pub seconds: f64,
    pub bytes: u64,
    pub requests_done: u64,
    pub requests_failed: u64,
    pub gb_per_s: f64,
    /// Batch completion latency (submit to last request settled), microseconds.
    pub batch_latency_us_p50: u64,
    pub batch_latency_us_p90: u64,
    pub batch_latency_us_p99: u64,
    pub last_failure: Option<String>,
    /// RDMA was wanted and some transfer went over TCP instead (each such event also counted
    /// in `kvpool_transfer_fallback_total`); scripts/rdma-smoke.sh requires false.
    pub rdma_fallback: bool,
    /// Local RDMA devices that carried the transfers (empty unless the route is RDMA).
    pub rdma_devices: Vec<String>,
}

/// Run the initiator side against `desc` and return the measurements.
pub fn run_initiator_with(
    args: &TransferBenchArgs,
    engine: &TransferEngine,
    desc: &SegmentDescriptor,
) -> Result<InitiatorReport, TransferBenchError> {
    run_initiator(args, engine, desc)
}

pub(super) fn run_initiator(
    args: &TransferBenchArgs,
    engine: &TransferEngine,
    desc: &SegmentDescriptor,
) -> Result<InitiatorReport, TransferBenchError> {
    let remote = engine
        .open_descriptor(desc, Some(args.protocol))
        .map_err(TransferBenchError::Engine)?;
    let size = usize::try_from(args.buffer_size)
        .map_err(|_| TransferBenchError::Args("--buffer-size too large".into()))?;
    let local_seg =
        Segment::host(size, HostOptions::default()).map_err(TransferBenchError::Memory)?;
    local_seg
        .fill(0, size, 0xa5)
        .map_err(TransferBenchError::Memory)?;
    let local = engine
        .register(
            &format!("{}-initiator-{}", args.segment_id, std::process::id()),
            Arc::new(local_seg),
        )
        .map_err(TransferBenchError::Engine)?;
    let remote_size = remote.len().min(args.buffer_size);
    let slots = (remote_size / args.block_size).max(1);
    let op: TransferOp = args.operation.into();
    let duration = args.duration.unwrap_or(DEFAULT_DURATION);
    let wait_limit = args.timeout.saturating_mul(4);

    let template = new_histogram()?;
    let start = Instant::now();
    let results: Vec<ThreadResult> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..args.threads)
            .map(|t| {
                let reqs = build_requests(args, &local, &remote, op, t, slots);
                let hist = template.clone();
                s.spawn(move || drive(engine, reqs, duration, wait_limit, hist))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| ThreadResult::crashed(template.clone()))
            })
            .collect()
    });
    let seconds = start.elapsed().as_secs_f64();

    let mut hist = template;
    let (mut bytes, mut done, mut failed, mut last_failure) = (0u64, 0u64, 0u64, None);
    for r in results {
        bytes += r.bytes;
        done += r.done;
        failed += r.failed;
        if r.last_failure.is_some() {
            last_failure = r.last_failure;
        }
        let _ = hist.add(&r.hist);
    }
    if done == 0 {
        return Err(TransferBenchError::AllFailed(
            last_failure.unwrap_or_else(|| "no request completed".into()),
        ));
    }
    Ok(InitiatorReport {
        protocol: remote.protocol().as_str(),
        operation: op.as_str(),
        block_size: args.block_size,
        batch_size: args.batch_size,
        threads: args.threads,
        lanes: args.lanes,
        integrity: args.integrity.as_str(),
        tls: args.engine_tls.mode.as_str(),
        seconds,
        bytes,
        requests_done: done,
        requests_failed: failed,
        gb_per_s: bytes as f64 / seconds / 1e9,
        batch_latency_us_p50: hist.value_at_quantile(0.50),
        batch_latency_us_p90: hist.value_at_quantile(0.90),
        batch_latency_us_p99: hist.value_at_quantile(0.99),
        last_failure,
        rdma_fallback: engine.fallback_active(),
        rdma_devices: remote.rdma_devices(),
    })
}

fn new_histogram() -> Result<Histogram<u64>, TransferBenchError> {
    // 1 us .. 100 s at 3 significant digits.
    Histogram::new_with_bounds(1, 100_000_000, 3)
        .map_err(|e| TransferBenchError::Args(format!("latency histogram: {e}")))
}

fn build_requests(
    args: &TransferBenchArgs,
    local: &LocalSegment,
    remote: &RemoteSegment,
    op: TransferOp,
    thread: usize,
    slots: u64,
) -> Vec<TransferRequest> {
    (0..args.batch_size)
        .map(|i| {
            let slot = ((thread * args.batch_size + i) as u64) % slots;
            let off = slot * args.block_size;
            TransferRequest {
                op,
                local: local.clone(),
                local_offset: off,
                remote: remote.clone(),
                remote_offset: off,
                len: args.block_size,
            }
        })
        .collect()
}

struct ThreadResult {
    bytes: u64,
    done: u64,
    failed: u64,
    last_failure: Option<String>,
    hist: Histogram<u64>,
}

impl ThreadResult {
    fn crashed(hist: Histogram<u64>) -> Self {
        ThreadResult {
            bytes: 0,
            done: 0,
            failed: 1,
            last_failure: Some("benchmark thread panicked".into()),
            hist,
        }
    }
}

fn drive(
    engine: &TransferEngine,
    reqs: Vec<TransferRequest>,
    duration: Duration,
    wait_limit: Duration,
    hist: Histogram<u64>,
) -> ThreadResult {
    let mut r = ThreadResult {
        bytes: 0,
        done: 0,
        failed: 0,
        last_failure: None,
        hist,
    };
    let deadline = Instant::now() + duration;
    while Instant::now() < deadline {
        let t0 = Instant::now();
        let batch = match engine.submit(reqs.clone()) {
            Ok(b) => b,
            Err(e) => {
                r.failed += reqs.len() as u64;
                r.last_failure = Some(e.to_string());
                break;
            }
        };
        match batch.wait(wait_limit) {
            Ok(statuses) => {
                let _ = r.hist.record(t0.elapsed().as_micros().max(1) as u64);
                for (s, q) in statuses.iter().zip(&reqs) {
                    match s {
                        RequestStatus::Done => {
                            r.done += 1;
                            r.bytes += q.len;
                        }
                        RequestStatus::Failed(f) => {
                            r.failed += 1;
                            r.last_failure = Some(f.to_string());
                        }
                        RequestStatus::Pending => r.failed += 1,
                    }
                }
            }
            Err(e) => {
                r.failed += reqs.len() as u64;
                r.last_failure = Some(e.to_string());
            }
        }
    }
    r
}

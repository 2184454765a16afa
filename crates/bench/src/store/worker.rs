//! A client process of `kvpool bench store` (this binary re-executed with `--worker N`): its own
//! pool client and transfer engine; for every phase of the plan it prints `READY <phase>`,
//! waits for `GO` on stdin, runs the phase with `--depth` operations in flight and prints
//! `RESULT <json>`. I/O boundary: the master and the agents over the network, stdin/stdout.

use std::io::{BufRead as _, Write as _};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use kvpool_client::master::{ClientConfig, MasterClient};
use kvpool_client::pool::{DataError, PoolClient};
use kvpool_core::master::types::PutOptions;
use kvpool_proto::auth::AuthKey as MasterKey;
use kvpool_transfer::{
    self as transfer, EngineConfig, StaticDirectory, TransferEngine, TransferMetrics,
};

use super::plan::{Phase, plan};
use super::report::{PhaseResult, encode_histogram, histogram};
use super::values::{
    STAMP, object_key, stamp, stamp_into, template, verify, verify_segment, verify_staging,
};
use super::{Api, StoreBenchArgs, StoreBenchError};
use kvpool_client::engine_api::client::EngineClient;
use kvpool_client::engine_api::proto::Status;

/// Keys per remove call when a phase's objects are dropped.
const REMOVE_CHUNK: usize = 1000;

struct Worker {
    id: usize,
    args: StoreBenchArgs,
    pool: PoolClient,
    master: MasterClient,
}

impl Worker {
    async fn run_phase(&self, phase: Phase) -> PhaseResult {
        match phase {
            Phase::Put(s) => self.data_phase(s, true).await,
            Phase::Get(s) => self.data_phase(s, false).await,
            Phase::Exists => self.lookup_phase(false).await,
            Phase::Prefix => self.lookup_phase(true).await,
            Phase::Remove(s) => self.remove_phase(s).await,
        }
    }

    async fn data_phase(&self, size: u64, put: bool) -> PhaseResult {
        let ops = self.args.ops_for(size);
        let tmpl = Arc::new(template(size, 0x9e37_79b9 ^ size));
        let next = Arc::new(AtomicU64::new(0));
        let opts = PutOptions {
            replicas: self.args.replicas,
            ..PutOptions::default()
        };
        let mut tasks = Vec::new();
        let api = self.args.api;
        let before = self.master.batched_calls();
        // One call in flight: driven by a thread of its own on a fork of the client, the way
        // the Python client runs a lone call (a current-thread runtime, the fork's own master
        // connection, transfers on the calling thread). More: tasks on the shared runtime,
        // where concurrent calls share batched master calls and the transfer lanes.
        let alone = self.args.depth == 1;
        for _ in 0..self.args.depth {
            let pool = if alone {
                self.pool.fork(tokio::runtime::Handle::current())
            } else {
                self.pool.clone()
            };
            let (tmpl, next, opts) = (tmpl.clone(), next.clone(), opts.clone());
            let id = self.id;
            let socket = self.args.engine_socket.clone();
            let body = async move {
                if api == Api::Engine {
                    let Some(socket) = socket else {
                        return failed(&std::io::Error::other("--api engine needs a socket"));
                    };
                    return engine_slot(&socket, size, ops, &next, &tmpl, id, put).await;
                }
                let mut r = PhaseResult::default();
                let mut h = histogram();
                let mut buf = tmpl.as_ref().clone();
                // Registered API: one registered buffer per task, holding the value to put or
                // receiving the value got.
                let registered = match api {
                    Api::Registered => match pool.register_buffer(size) {
                        Ok(b) => match b.segment().write_at(0, &tmpl) {
                            Ok(()) => Some(b),
                            Err(e) => return failed(&e),
                        },
                        Err(e) => return failed(&e),
                    },
                    Api::Copy | Api::Engine => None,
                };
                while let Some(i) = claim(&next, ops) {
                    let key = object_key(id, size, i);
                    let t = Instant::now();
                    let outcome: Result<Got, DataError> = match (put, &registered) {
                        (true, Some(reg)) => {
                            match reg
                                .segment()
                                .write_at(0, &stamp(id, i)[..STAMP.min(buf.len())])
                            {
                                Ok(()) => pool
                                    .put_from(&key, reg, 0, size, &opts)
                                    .await
                                    .map(|_| Got::Put),
                                Err(e) => Err(DataError::Staging { size, source: e }),
                            }
                        }
                        (true, None) => {
                            stamp_into(&mut buf, id, i);
                            pool.put(&key, &buf, &opts).await.map(|_| Got::Put)
                        }
                        (false, Some(reg)) => {
                            // Stale bytes from an earlier get must not pass for this one.
                            match reg
                                .segment()
                                .write_at(0, &[0u8; STAMP][..STAMP.min(buf.len())])
                            {
                                Ok(()) => pool.get_to(&key, reg, 0).await.map(Got::Registered),
                                Err(e) => Err(DataError::Staging { size, source: e }),
                            }
                        }
                        (false, None) => pool.get(&key).await.map(Got::Bytes),
                    };
                    let _ = h.record(t.elapsed().as_micros().max(1) as u64);
                    // Every get's bytes are checked, outside the operation's latency (as the
                    // Mooncake driver times its calls alone); with one call in flight the check
                    // is also taken out of the phase time (`check_us`).
                    let checking = Instant::now();
                    let outcome = outcome.map(|got| match got {
                        Got::Put => true,
                        Got::Registered(n) => {
                            n == size
                                && registered
                                    .as_ref()
                                    .is_some_and(|reg| verify_segment(reg, &tmpl, id, i))
                        }
                        Got::Bytes(v) => verify(&v, &tmpl, id, i),
                    });
                    if alone {
                        r.check_us += checking.elapsed().as_micros() as u64;
                    }
                    account(&mut r, outcome.map_err(|e| error_chain(&e)), put, size);
                }
                r.latency_us = encode_histogram(&h);
                r
            };
            tasks.push(if alone {
                tokio::task::spawn_blocking(move || {
                    match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt.block_on(body),
                        Err(e) => failed(&e),
                    }
                })
            } else {
                tokio::spawn(body)
            });
        }
        let mut r = merge(tasks).await;
        // Leases are released in the background; the phase ends when the master has them.
        self.pool.flush_releases().await;
        let after = self.master.batched_calls();
        r.master_calls = (after.get + after.put_start + after.put_end + after.release_leases)
            - (before.get + before.put_start + before.put_end + before.release_leases);
        r
    }

    async fn lookup_phase(&self, prefix: bool) -> PhaseResult {
        let Some(&size) = self.args.sizes.first() else {
            return PhaseResult::default();
        };
        let n = self.args.ops_for(size);
        let keys: Arc<Vec<Vec<u8>>> =
            Arc::new((0..n).map(|i| object_key(self.id, size, i)).collect());
        let stop = CancellationToken::new();
        let mut tasks = Vec::new();
        for d in 0..self.args.depth {
            let (master, keys, stop) = (self.master.clone(), keys.clone(), stop.clone());
            let batch = self.args.batch;
            tasks.push(tokio::spawn(async move {
                let mut r = PhaseResult::default();
                let mut h = histogram();
                let mut start = d * 7919;
                while !stop.is_cancelled() {
                    // A chain of `batch` committed keys (wrapping when fewer were put).
                    let chain: Vec<&[u8]> = (0..batch)
                        .filter_map(|j| keys.get((start + j) % keys.len().max(1)))
                        .map(Vec::as_slice)
                        .collect();
                    start = start.wrapping_add(104_729);
                    let t = Instant::now();
                    let ok = if prefix {
                        master
                            .longest_prefix(&chain)
                            .await
                            .map(|l| l == chain.len())
                    } else {
                        master.exists(&chain).await.map(|e| e.iter().all(|b| *b))
                    };
                    let _ = h.record(t.elapsed().as_micros().max(1) as u64);
                    match ok {
                        Ok(true) => r.ops += 1,
                        Ok(false) => {
                            r.ops += 1;
                            r.mismatches += 1;
                        }
                        Err(e) => {
                            r.failures += 1;
                            if r.first_error.is_none() {
                                r.first_error = Some(error_chain(&e));
                            }
                            // A dead master would spin here; one failure ends the task.
                            break;
                        }
                    }
                }
                r.latency_us = encode_histogram(&h);
                r
            }));
        }
        tokio::time::sleep(self.args.lookup_duration).await;
        stop.cancel();
        merge(tasks).await
    }

    async fn remove_phase(&self, size: u64) -> PhaseResult {
        let keys: Vec<Vec<u8>> = (0..self.args.ops_for(size))
            .map(|i| object_key(self.id, size, i))
            .collect();
        let mut r = PhaseResult::default();
        for chunk in keys.chunks(REMOVE_CHUNK) {
            let refs: Vec<&[u8]> = chunk.iter().map(Vec::as_slice).collect();
            match self.master.remove_batch(&refs).await {
                Ok(items) => {
                    for item in items {
                        match item {
                            Ok(()) => r.ops += 1,
                            Err(e) => {
                                r.failures += 1;
                                if r.first_error.is_none() {
                                    r.first_error = Some(error_chain(&e));
                                }
                            }
                        }
                    }
                }
                Err(e) => {
                    r.failures += chunk.len() as u64;
                    if r.first_error.is_none() {
                        r.first_error = Some(error_chain(&e));
                    }
                }
            }
        }
        r
    }
}

/// Count one operation's outcome (`Ok(verified)`; puts are always "verified").
fn account(r: &mut PhaseResult, outcome: Result<bool, String>, put: bool, size: u64) {
    match outcome {
        Ok(ok) => {
            r.ops += 1;
            r.bytes += size;
            if !put {
                if ok {
                    r.verified += 1;
                } else {
                    r.mismatches += 1;
                }
            }
        }
        Err(e) => {
            r.failures += 1;
            if r.first_error.is_none() {
                r.first_error = Some(e);
            }
        }
    }
}

/// What a data operation returned, before its bytes are checked.
enum Got {
    Put,
    /// A get into the task's registered buffer: the value's length.
    Registered(u64),
    /// A get into a fresh vector.
    Bytes(Vec<u8>),
}

/// One in-flight slot of an engine-API phase: a session of its own on the agent, the value
/// staged at the start of its area, one block per put or get call.
async fn engine_slot(
    socket: &Path,
    size: u64,
    ops: u64,
    next: &AtomicU64,
    tmpl: &[u8],
    id: usize,
    put: bool,
) -> PhaseResult {
    let mut client = match EngineClient::connect(socket, size, &format!("bench-client-{id}")).await
    {
        Ok(c) => c,
        Err(e) => return failed(&e),
    };
    if let Err(e) = client.staging().write_from(0, tmpl) {
        return failed(&e);
    }
    let n = STAMP.min(tmpl.len());
    let mut r = PhaseResult::default();
    let mut h = histogram();
    while let Some(i) = claim(next, ops) {
        let key = object_key(id, size, i);
        let t = Instant::now();
        let outcome: Result<bool, String> = async {
            // Puts stage the object's stamp; gets clear it first, so that stale bytes from an
            // earlier get cannot pass for this one.
            let head = if put { stamp(id, i) } else { [0u8; STAMP] };
            client
                .staging()
                .write_from(0, &head[..n])
                .map_err(|e| e.to_string())?;
            let item = [(key.as_slice(), 0, size)];
            if put {
                let statuses = client
                    .put_batch(&item, None)
                    .await
                    .map_err(|e| error_chain(&e))?;
                return match statuses.as_slice() {
                    [Status::Ok] => Ok(true),
                    other => Err(format!("put answered {other:?}")),
                };
            }
            let got = client.get_batch(&item).await.map_err(|e| error_chain(&e))?;
            match got.as_slice() {
                [g] if g.status == Status::Ok => {
                    Ok(g.length == size && verify_staging(client.staging(), tmpl, id, i))
                }
                other => Err(format!("get answered {other:?}")),
            }
        }
        .await;
        let _ = h.record(t.elapsed().as_micros().max(1) as u64);
        account(&mut r, outcome, put, size);
    }
    let _ = client.close().await;
    r.latency_us = encode_histogram(&h);
    r
}

/// The next of a phase's `ops` operations for a slot to run; `None` once all are taken.
/// Slots share `next`, so each operation runs once across them.
fn claim(next: &AtomicU64, ops: u64) -> Option<u64> {
    let i = next.fetch_add(1, Ordering::Relaxed);
    (i < ops).then_some(i)
}

fn failed(e: &dyn std::error::Error) -> PhaseResult {
    PhaseResult {
        failures: 1,
        first_error: Some(error_chain(e)),
        ..PhaseResult::default()
    }
}

async fn merge(tasks: Vec<tokio::task::JoinHandle<PhaseResult>>) -> PhaseResult {
    let mut out = PhaseResult::default();
    let mut h = histogram();
    for t in tasks {
        let r = match t.await {
            Ok(r) => r,
            Err(e) => PhaseResult {
                failures: 1,
                first_error: Some(format!("task lost: {e}")),
                ..PhaseResult::default()
            },
        };
        out.ops += r.ops;
        out.bytes += r.bytes;
        out.failures += r.failures;
        out.verified += r.verified;
        out.mismatches += r.mismatches;
        out.check_us += r.check_us;
        if out.first_error.is_none() {
            out.first_error = r.first_error;
        }
        for (v, c) in r.latency_us {
            let _ = h.record_n(v.max(1), c);
        }
    }
    out.latency_us = encode_histogram(&h);
    out
}

fn error_chain(e: &dyn std::error::Error) -> String {
    kvpool_runtime::telemetry::chain(e).to_string()
}

fn read_key(path: &Path) -> Result<Vec<u8>, StoreBenchError> {
    std::fs::read(path).map_err(StoreBenchError::Io)
}

/// Body of a client process: connect, then for every phase of the plan print `READY <phase>`,
/// wait for `GO` on stdin, run it and print `RESULT <json>`.
pub(super) async fn run_worker(id: usize, args: StoreBenchArgs) -> Result<(), StoreBenchError> {
    let (Some(master_addr), Some(key_file)) = (args.master, args.key_file.clone()) else {
        return Err(StoreBenchError::Args(
            "--worker needs --master and --key-file".into(),
        ));
    };
    let secret = read_key(&key_file)?;
    let key = MasterKey::from_bytes(&secret)
        .ok_or_else(|| StoreBenchError::Args("the key file holds too short a key".into()))?;
    // Poll briefly before sleeping on a reply, as the Python client does by default: a lone
    // call waits for its answer anyway.
    let spin_wait = Duration::from_micros(50);
    let master = MasterClient::new(
        vec![master_addr.to_string()],
        key,
        ClientConfig {
            spin_wait,
            ..ClientConfig::default()
        },
    )
    .map_err(StoreBenchError::Master)?;
    let node = format!("bench-client-{id}");
    let engine = TransferEngine::new(
        EngineConfig {
            node: node.clone(),
            lanes: args.lanes,
            // Clients and agents share this host; the benchmark measures the remote path.
            prefer_shm: false,
            spin_wait,
            ..EngineConfig::default()
        },
        transfer::AuthKey::new(secret).map_err(|e| StoreBenchError::Args(e.to_string()))?,
        Arc::new(StaticDirectory::new()),
        TransferMetrics::unregistered().map_err(|e| StoreBenchError::Args(e.to_string()))?,
    )
    .map_err(StoreBenchError::Client)?;
    let pool = PoolClient::new(master.clone(), engine, node, None);
    let worker = Worker {
        id,
        args: args.clone(),
        pool,
        master,
    };
    let stdin = std::io::stdin();
    let mut line = String::new();
    for phase in plan(&args.sizes, args.rounds) {
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "READY {}", phase.name()).map_err(StoreBenchError::Io)?;
            out.flush().map_err(StoreBenchError::Io)?;
        }
        line.clear();
        let n = tokio::task::block_in_place(|| stdin.lock().read_line(&mut line))
            .map_err(StoreBenchError::Io)?;
        if n == 0 {
            // The coordinator went away: stop quietly.
            return Ok(());
        }
        if line.trim() != "GO" {
            return Err(StoreBenchError::Protocol(format!(
                "expected GO, got {:?}",
                line.trim()
            )));
        }
        let result = worker.run_phase(phase).await;
        let json =
            serde_json::to_string(&result).map_err(|e| StoreBenchError::Protocol(e.to_string()))?;
        let mut out = std::io::stdout().lock();
        writeln!(out, "RESULT {json}").map_err(StoreBenchError::Io)?;
        out.flush().map_err(StoreBenchError::Io)?;
    }
    Ok(())
}

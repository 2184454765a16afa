//! `kvpool bench master --node-hits-ab`: what the master's per-node Get hit accounting
//! (`Stats.nodes[].get_hits`) costs a Get. The same loaded master answers Gets with the
//! accounting on and off, in alternating rounds, measured twice: on the core alone (one thread
//! calling `get` then `release_lease` under the state lock, the path the counters sit on) and
//! over loopback gRPC (batched `get` calls, each followed by the release of its leases, as a
//! reader does). I/O boundary: loopback sockets of the gRPC rounds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use kvpool_client::master::MasterClient;
use kvpool_core::master::types::ObjectKey;
use kvpool_master::cmd::RunningMaster;
use kvpool_master::service::Core;

use super::{BenchError, Lookup, MasterBenchArgs, bench_key, lookup_phase};

/// Rounds of each setting, alternated (on, off, on, off, ...) so that drift of the machine's
/// load falls on both.
const ROUNDS: usize = 2;

/// Get rates with the per-node accounting on and off, and their ratio (off / on: how much
/// faster a Get would be without it; 1.0 means no cost measured).
#[derive(Debug, Clone, Serialize)]
pub struct NodeHitFigures {
    pub core_gets_per_second_on: f64,
    pub core_gets_per_second_off: f64,
    pub core_off_vs_on: f64,
    /// `get` calls of `batch` keys each (plus the release of their leases) per second.
    pub grpc_get_calls_per_second_on: f64,
    pub grpc_get_calls_per_second_off: f64,
    pub grpc_off_vs_on: f64,
    pub rounds: usize,
}

/// Get then release `objects`' keys in a stride on the core for `duration`, from a blocking
/// thread (the state lock is taken per 1024 Gets so that the tick loop still runs).
async fn core_round(core: Arc<Core>, objects: u64, duration: Duration) -> Result<f64, BenchError> {
    tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let (mut done, mut next) = (0u64, 0u64);
        while started.elapsed() < duration {
            let mut st = core.state.lock();
            for _ in 0..1024 {
                let key = ObjectKey::from_bytes(&bench_key(next % objects));
                next = next.wrapping_add(104_729);
                let got = st.get(key).map_err(|e| BenchError::Setup(e.to_string()))?;
                st.release_lease(got.lease.id)
                    .map_err(|e| BenchError::Setup(e.to_string()))?;
                done += 1;
            }
        }
        Ok(done as f64 / started.elapsed().as_secs_f64())
    })
    .await
    .map_err(|e| BenchError::Setup(e.to_string()))?
}

/// The A/B on `master`, loaded with `objects` objects, through `clients`.
pub(crate) async fn node_hits_ab(
    master: &RunningMaster,
    clients: &[MasterClient],
    args: &MasterBenchArgs,
    objects: u64,
) -> Result<NodeHitFigures, BenchError> {
    let objects = objects.max(1);
    let set = |on: bool| master.core.state.lock().set_node_get_hits(on);
    let (mut core, mut grpc) = ([0.0f64; 2], [0.0f64; 2]);
    for _ in 0..ROUNDS {
        for (i, on) in [true, false].into_iter().enumerate() {
            set(on);
            core[i] += core_round(master.core.clone(), objects, args.duration).await?;
            grpc[i] += lookup_phase(clients, args, objects, Lookup::GetAndRelease).await?;
        }
    }
    set(true);
    let rounds = ROUNDS as f64;
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    Ok(NodeHitFigures {
        core_gets_per_second_on: core[0] / rounds,
        core_gets_per_second_off: core[1] / rounds,
        core_off_vs_on: ratio(core[1], core[0]),
        grpc_get_calls_per_second_on: grpc[0] / rounds,
        grpc_get_calls_per_second_off: grpc[1] / rounds,
        grpc_off_vs_on: ratio(grpc[1], grpc[0]),
        rounds: ROUNDS,
    })
}

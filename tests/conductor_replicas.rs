//! Two conductor replicas in front of the same engines (issue 35;
//! docs/adr/0010-conductor-replicas-share-bookings.md): with their bookings shared through a
//! real in-process master (`ShareLoad`), they admit exactly what one conductor admits; booking
//! alone, the same arrivals split between two replicas are admitted twice over. Real synthetic
//! engines (prefills one at a time, each a fixed cost) on loopback, predicted-TTFT admission.
//!
//! The decisions do not race the clock: a prefill takes one cost-model second, five wall
//! seconds, and the SLO lets two be queued, so whatever arrives in the burst's two seconds
//! (0.4 cost-model seconds) after two admissions is refused, and nothing finishes meanwhile
//! that could make room. Arrivals are 250 ms apart, 25 sharing periods, for each booking to
//! reach the other replica.

mod pool_support;
mod serve_support;

use std::net::SocketAddr;
use std::time::Duration;

use kvpool_conductor::{ConductorConfig, PoolLookup, ShareLoad};
use kvpool_core::sched::{PrefillCost, Rejection};
use serve_support::{exchange, listen};
use tokio_util::sync::CancellationToken;

const MODEL: &str = "synthetic-70b";
const BLOCK: u32 = 16;
const POOL_KEY: &[u8] = b"kvpool-test-pool-key-0123456789";
/// Wall seconds per cost-model second, engines and conductors alike.
const TIME_SCALE: f64 = 5.0;
/// Every prefill costs one cost-model second, whatever the prompt.
const PREFILL: PrefillCost = PrefillCost {
    fixed_s: 1.0,
    linear_s: 0.0,
    quadratic_s: 0.0,
};
/// Requests arrive this far apart (0.05 cost-model seconds), alternating between replicas.
const GAP: Duration = Duration::from_millis(250);
const ARRIVALS: usize = 8;
/// How long after the burst an answer counts as a refusal; an admitted request is still
/// prefilling then (its prefill takes five seconds).
const REFUSAL_WAIT: Duration = Duration::from_millis(1500);

async fn engine(shutdown: &CancellationToken) -> SocketAddr {
    let config = kvpool_synthetic::EngineConfig {
        prefill_cost: PREFILL,
        time_scale: TIME_SCALE,
        ..serve_support::engine_config(MODEL, BLOCK)
    };
    let router = kvpool_synthetic::server::router(config, &prometheus::Registry::new())
        .expect("engine router");
    let (l, a) = listen().await;
    tokio::spawn(kvpool_synthetic::server::serve(l, router, shutdown.clone()));
    a
}

/// A conductor over `prefill` and `decode` admitting on predicted TTFT against a 2.5 s SLO
/// (a third prefill queued is too many), sharing its bookings through `master` when `share`.
fn config(
    prefill: SocketAddr,
    decode: SocketAddr,
    master: &SocketAddr,
    share: bool,
) -> ConductorConfig {
    let mut c = serve_support::conductor_config(
        MODEL,
        BLOCK,
        vec![format!("http://{prefill}")],
        format!("http://{decode}"),
        Rejection::Predicted,
        2.5,
    );
    c.scheduler.prefill_costs = vec![PREFILL];
    c.time_scale = TIME_SCALE;
    let timeout = Duration::from_secs(5);
    let client = kvpool_client::master::MasterClient::new(
        vec![master.to_string()],
        kvpool_proto::auth::AuthKey::from_bytes(POOL_KEY).expect("key"),
        kvpool_client::master::ClientConfig {
            connect_timeout: timeout,
            request_timeout: timeout,
            failover_budget: Duration::ZERO,
            ..Default::default()
        },
    )
    .expect("client");
    c.pool = Some(PoolLookup {
        client,
        timeout,
        keys: kvpool_core::sched::PoolKeys::Synthetic,
        share: share.then(|| ShareLoad::every(Duration::from_millis(10))),
        hot: None,
    });
    c
}

/// Starts `replicas` conductors over one prefill and one decode engine, sends [`ARRIVALS`]
/// distinct requests [`GAP`] apart to the replicas in turn, and counts those admitted: every
/// request not refused (429) within [`REFUSAL_WAIT`] of the burst's end (an admitted one is
/// still prefilling then); any other answer fails the test.
async fn admitted(replicas: usize, share: bool) -> usize {
    let shutdown = CancellationToken::new();
    let master = pool_support::in_process_master(POOL_KEY, |_| {}).await;
    let (p, d) = (engine(&shutdown).await, engine(&shutdown).await);
    let mut fronts = Vec::new();
    for _ in 0..replicas {
        let router = kvpool_conductor::server::conductor(
            config(p, d, &master.master.grpc_addr, share),
            &prometheus::Registry::new(),
        )
        .expect("conductor");
        router.engines.share_load(&shutdown);
        let (l, a) = listen().await;
        tokio::spawn(kvpool_conductor::server::serve(
            l,
            router.router,
            shutdown.clone(),
        ));
        fronts.push(a);
    }
    // Let every replica report once before the first arrival.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut calls = Vec::new();
    for i in 0..ARRIVALS {
        let front = fronts[i % replicas];
        let body = format!(
            r#"{{"model":"{MODEL}","prompt":"request {i} of the burst, distinct","max_tokens":1}}"#
        );
        calls.push(tokio::spawn(async move {
            exchange(front, "POST", "/v1/completions", &body).await
        }));
        tokio::time::sleep(GAP).await;
    }
    tokio::time::sleep(REFUSAL_WAIT).await;
    let mut admitted = 0;
    for c in calls {
        if !c.is_finished() {
            admitted += 1;
            c.abort();
            continue;
        }
        let (status, _, text) = c.await.expect("call");
        match status {
            429 => {}
            other => panic!("answered {other} before its prefill could have run: {text}"),
        }
    }
    shutdown.cancel();
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_sharing_bookings_admit_no_more_than_one_conductor() {
    let one = admitted(1, true).await;
    let shared = admitted(2, true).await;
    let alone = admitted(2, false).await;
    eprintln!(
        "admitted of {ARRIVALS}: one conductor {one}, two sharing {shared}, two alone {alone}"
    );
    // One prefill running and one queued meet the SLO; a third would not.
    assert_eq!(one, 2, "one conductor");
    // Booking alone, each replica sees half the arrivals and takes the engine for free of the
    // other's requests: twice as many are admitted. This is what the test would see if
    // sharing did nothing.
    assert_eq!(alone, 2 * one, "two replicas booking alone");
    // Sharing: what one conductor admits.
    assert_eq!(shared, one, "two replicas sharing (alone: {alone})");
}

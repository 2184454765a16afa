//! The conductor's per-request metrics in front of real synthetic engines on loopback sockets:
//! time to first token, time per output token, end-to-end duration, queue wait, requests in
//! flight, the SLO judgements and the engines' booked load, as a client's requests move them.

mod serve_support;

use std::net::SocketAddr;

use kvpool_core::sched::Rejection;
use serve_support::{labelled, metric, start_conductor};
use tokio_util::sync::CancellationToken;

const MODEL: &str = "synthetic-latency";
const BLOCK: u32 = 16;

/// A synthetic engine; its address.
async fn engine(shutdown: &CancellationToken) -> SocketAddr {
    serve_support::start_engine(serve_support::engine_config(MODEL, BLOCK), shutdown)
        .await
        .0
}

async fn post(addr: SocketAddr, body: &str) -> (u16, String) {
    serve_support::http(addr, "POST", "/v1/completions", body).await
}

#[tokio::test]
async fn each_request_is_timed_once_and_judged_against_the_objectives() {
    let shutdown = CancellationToken::new();
    let prefill = engine(&shutdown).await;
    let decode = engine(&shutdown).await;
    // A TTFT objective no loopback request misses.
    let config = serve_support::conductor_config(
        MODEL,
        BLOCK,
        vec![format!("http://{prefill}")],
        format!("http://{decode}"),
        Rejection::Predicted,
        600.0,
    );
    let (conductor, m) = start_conductor(config, &shutdown).await;
    let count = |name: &str| metric(&m, &format!("{name}_count"));
    // Before any request: every series is there, at 0.
    for name in [
        "kvpool_conductor_ttft_seconds",
        "kvpool_conductor_tpot_seconds",
        "kvpool_conductor_request_duration_seconds",
        "kvpool_conductor_queue_wait_seconds",
    ] {
        assert_eq!(count(name), 0.0, "{name}");
    }
    assert_eq!(metric(&m, "kvpool_conductor_in_flight_requests"), 0.0);
    let objective = labelled(
        &m,
        "kvpool_conductor_slo_objective_seconds",
        "objective",
        "ttft",
    );
    assert_eq!(objective, 600.0, "wall seconds = SLO x time scale 1");

    let streamed = format!(
        r#"{{"model":"{MODEL}","prompt":"time me please, token by token","max_tokens":8,"stream":true}}"#
    );
    let (status, text) = post(conductor, &streamed).await;
    assert_eq!(status, 200, "{text}");
    let whole = format!(r#"{{"model":"{MODEL}","prompt":"and all at once","max_tokens":4}}"#);
    let (status, text) = post(conductor, &whole).await;
    assert_eq!(status, 200, "{text}");
    // Refused before placement: an end-to-end duration, nothing else.
    let (status, text) = post(conductor, r#"{"model":"another-model","prompt":"x"}"#).await;
    assert_eq!(status, 404, "{text}");

    // Both served requests had a first token and a placement; all three ended.
    assert_eq!(count("kvpool_conductor_ttft_seconds"), 2.0);
    assert_eq!(count("kvpool_conductor_queue_wait_seconds"), 2.0);
    assert_eq!(count("kvpool_conductor_request_duration_seconds"), 3.0);
    assert_eq!(metric(&m, "kvpool_conductor_in_flight_requests"), 0.0);
    let judged = |objective: &str| {
        labelled(
            &m,
            "kvpool_conductor_slo_requests_total",
            "objective",
            objective,
        )
    };
    assert_eq!(judged("ttft"), 2.0, "each served request judged once");
    assert_eq!(
        labelled(&m, "kvpool_conductor_slo_requests_total", "result", "met"),
        judged("ttft") + judged("tpot"),
        "a 600 s TTFT and a 100 ms TPOT objective on loopback"
    );
    // Only a streamed answer whose tokens came in more than one chunk has a TPOT; the whole
    // JSON answer has none. How the stream's chunks fall on loopback is the kernel's choice.
    let tpot = count("kvpool_conductor_tpot_seconds");
    assert!(tpot <= 1.0, "{tpot}");
    assert_eq!(judged("tpot"), tpot);

    // The booked load of both engines is exported, and back to nothing once all is done.
    let booked = |role: &str| labelled(&m, "kvpool_conductor_engine_requests", "role", role);
    assert_eq!((booked("prefill"), booked("decode")), (0.0, 0.0));
    let text = {
        use prometheus::Encoder;
        let mut out = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&m.gather(), &mut out)
            .expect("encode");
        String::from_utf8(out).expect("utf-8")
    };
    for role in ["prefill", "decode"] {
        let series = kvpool_harness::scrape::samples(&text)
            .filter(|s| s.name == "kvpool_conductor_engine_requests")
            .filter(|s| s.label("engine").is_some_and(|e| e.starts_with("http://")))
            .filter(|s| s.label("role") == Some(role))
            .count();
        assert_eq!(series, 1, "{role}: {text}");
    }
    let queues = kvpool_harness::scrape::samples(&text)
        .filter(|s| s.name == "kvpool_conductor_prefill_queue_seconds")
        .filter(|s| s.label("engine").is_some_and(|e| e.starts_with("http://")));
    assert!(queues.count() > 0, "{text}");
    shutdown.cancel();
}

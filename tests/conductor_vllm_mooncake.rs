//! The conductor's third convention, vLLM's `MooncakeConnector` (`--engine-protocol
//! vllm-mooncake`), on loopback: real synthetic engines behind a tap that keeps what each
//! engine call carried, and a bootstrap server answering `GET /query` as vLLM's does (a map of
//! data parallel ranks to engine ids and workers). What is checked is the wire: prefill gets the
//! one-token request with `{do_remote_decode, transfer_id}`, decode the original request with
//! `{do_remote_prefill, remote_engine_id, remote_bootstrap_addr, transfer_id}`, one fresh
//! transfer id per request, the engine id of the rank the prefill call was pinned to, the
//! bootstrap answer reused; a bootstrap server that is down or lists nobody gets a 502 naming
//! it, and no engine is called. The real engines run this convention in
//! tests/engines/vllm/test_vllm_mooncake_pd.py.

mod serve_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::body::Body;
use axum::extract::Request;
use axum::http::HeaderMap;
use axum::middleware::Next;
use kvpool_conductor::RoutingProtocol;
use kvpool_core::sched::Rejection;
use parking_lot::Mutex;
use serde_json::{Value, json};
use serve_support::{assert_openai_error, exchange, header, listen, start_conductor};
use tokio_util::sync::CancellationToken;

const MODEL: &str = "synthetic-70b";
const BLOCK: u32 = 16;

/// What an engine received on a client's behalf: each call's headers and JSON body.
type Seen = Arc<Mutex<Vec<(HeaderMap, Value)>>>;

/// A synthetic engine (vLLM convention) behind a tap keeping every call but the conductor's
/// own `GET /v1/models`.
async fn tapped_engine(shutdown: &CancellationToken) -> (SocketAddr, Seen) {
    let seen: Seen = Arc::default();
    let tap = seen.clone();
    let registry = prometheus::Registry::new();
    let router =
        kvpool_synthetic::server::router(serve_support::engine_config(MODEL, BLOCK), &registry)
            .expect("engine router")
            .layer(axum::middleware::from_fn(
                move |req: Request, next: Next| {
                    let tap = tap.clone();
                    async move {
                        if req.uri().path() == "/v1/models" {
                            return next.run(req).await;
                        }
                        let (parts, body) = req.into_parts();
                        let bytes = axum::body::to_bytes(body, 1 << 20).await.expect("body");
                        let json = serde_json::from_slice(&bytes).expect("a JSON body");
                        tap.lock().push((parts.headers.clone(), json));
                        next.run(Request::from_parts(parts, Body::from(bytes)))
                            .await
                    }
                },
            ));
    let (l, a) = listen().await;
    tokio::spawn(kvpool_synthetic::server::serve(l, router, shutdown.clone()));
    (a, seen)
}

/// A bootstrap server answering `GET /query` with `answer`, counting the queries.
async fn bootstrap(answer: Value, shutdown: &CancellationToken) -> (u16, Arc<AtomicUsize>) {
    let asked = Arc::new(AtomicUsize::new(0));
    let count = asked.clone();
    let router = axum::Router::new().route(
        "/query",
        axum::routing::get(move || {
            count.fetch_add(1, Ordering::SeqCst);
            let answer = answer.clone();
            async move { axum::Json(answer) }
        }),
    );
    let (l, a) = listen().await;
    tokio::spawn(kvpool_conductor::server::serve(l, router, shutdown.clone()));
    (a.port(), asked)
}

/// A bootstrap server's answer: one entry per `(dp_rank, engine_id)`.
fn ranks(ids: &[(u32, &str)]) -> Value {
    let mut out = serde_json::Map::new();
    for (rank, id) in ids {
        out.insert(
            rank.to_string(),
            json!({"engine_id": id, "worker_addr": {"0": {"0": format!("tcp://127.0.0.1:{}", 7000 + rank)}}}),
        );
    }
    Value::Object(out)
}

struct Pair {
    conductor: SocketAddr,
    prefill: Seen,
    decode: Seen,
    _shutdown: CancellationToken,
}

/// A conductor routing vLLM-MooncakeConnector style to one prefill and one decode engine, the
/// prefill's bootstrap server on `bootstrap_port`.
async fn pair(shutdown: CancellationToken, bootstrap_port: u16) -> Pair {
    let (p, prefill) = tapped_engine(&shutdown).await;
    let (d, decode) = tapped_engine(&shutdown).await;
    let mut config = serve_support::conductor_config(
        MODEL,
        BLOCK,
        vec![format!("http://{p}")],
        format!("http://{d}"),
        Rejection::None,
        30.0,
    );
    config.protocol = RoutingProtocol::VllmMooncake { bootstrap_port };
    let (conductor, _) = start_conductor(config, &shutdown).await;
    Pair {
        conductor,
        prefill,
        decode,
        _shutdown: shutdown,
    }
}

fn completion(prompt: &str) -> String {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}).to_string()
}

#[tokio::test]
async fn prefill_and_decode_are_paired_by_a_transfer_id_and_the_prefills_engine_id() {
    let shutdown = CancellationToken::new();
    let (port, asked) = bootstrap(ranks(&[(0, "prefill-e0")]), &shutdown).await;
    let p = pair(shutdown, port).await;
    let prompt = "a shared prefix long enough to fill a few blocks of sixteen stand-in tokens";

    let mut transfer_ids = Vec::new();
    for _ in 0..2 {
        let (status, head, text) =
            exchange(p.conductor, "POST", "/v1/completions", &completion(prompt)).await;
        assert_eq!(status, 200, "{text}");
        // The client gets the decode engine's answer, all three tokens.
        let v: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["choices"][0]["text"], "tok0 tok1 tok2 ", "{text}");
        assert!(
            header(&head, "x-kvpool-decode-engine").is_some(),
            "{head:?}"
        );

        let (p_head, prefill) = p.prefill.lock().last().cloned().expect("a prefill call");
        let (_, decode) = p.decode.lock().last().cloned().expect("a decode call");
        let kv = &prefill["kv_transfer_params"];
        assert_eq!(kv["do_remote_decode"], true, "{prefill}");
        assert_eq!(kv["do_remote_prefill"], false, "{prefill}");
        assert_eq!(prefill["max_tokens"], 1, "{prefill}");
        assert_eq!(prefill["stream"], false, "{prefill}");
        // One rank: the prefill call is not pinned.
        assert!(p_head.get("x-data-parallel-rank").is_none(), "{p_head:?}");
        let id = kv["transfer_id"]
            .as_str()
            .expect("a transfer id")
            .to_owned();
        assert!(id.starts_with("kvpool-") && id.len() == 39, "{id}");

        let kv = &decode["kv_transfer_params"];
        assert_eq!(
            *kv,
            json!({"do_remote_prefill": true, "do_remote_decode": false,
                   "remote_engine_id": "prefill-e0",
                   "remote_bootstrap_addr": format!("http://127.0.0.1:{port}"),
                   "transfer_id": id}),
            "{decode}"
        );
        // Decode gets the client's own request otherwise.
        assert_eq!(decode["max_tokens"], 3, "{decode}");
        assert_eq!(decode["prompt"], prompt, "{decode}");
        transfer_ids.push(id);
    }
    assert_ne!(
        transfer_ids[0], transfer_ids[1],
        "one transfer id per request"
    );
    // The second request used the answer of the first query.
    assert_eq!(asked.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn with_several_ranks_decode_is_told_the_rank_prefill_was_pinned_to() {
    let shutdown = CancellationToken::new();
    let (port, _) = bootstrap(
        ranks(&[(0, "prefill_dp0"), (1, "prefill_dp1"), (2, "prefill_dp2")]),
        &shutdown,
    )
    .await;
    let p = pair(shutdown, port).await;
    let mut ranks_seen = std::collections::BTreeSet::new();
    for i in 0..24 {
        let (status, _, text) = exchange(
            p.conductor,
            "POST",
            "/v1/completions",
            &completion(&format!("prompt number {i}")),
        )
        .await;
        assert_eq!(status, 200, "{text}");
        let (p_head, _) = p.prefill.lock().last().cloned().expect("a prefill call");
        let (_, decode) = p.decode.lock().last().cloned().expect("a decode call");
        let rank = header(&p_head, "x-data-parallel-rank")
            .expect("a pinned prefill call")
            .to_owned();
        assert_eq!(
            decode["kv_transfer_params"]["remote_engine_id"],
            format!("prefill_dp{rank}"),
            "{decode}"
        );
        ranks_seen.insert(rank);
    }
    // Drawn at random: 24 draws over 3 ranks all land on one with probability 3 / 3^24.
    assert!(ranks_seen.len() > 1, "{ranks_seen:?}");
}

#[tokio::test]
async fn a_bootstrap_server_that_is_down_or_lists_nobody_gets_a_502_naming_it() {
    // Down: nothing listens on the port.
    let closed = {
        let (l, a) = listen().await;
        drop(l);
        a.port()
    };
    let p = pair(CancellationToken::new(), closed).await;
    let (status, _, text) =
        exchange(p.conductor, "POST", "/v1/completions", &completion("x y z")).await;
    assert_eq!(status, 502, "{text}");
    let says = format!("Mooncake bootstrap server http://127.0.0.1:{closed}/query");
    assert_openai_error(&text, "upstream", &says);
    assert!(p.prefill.lock().is_empty() && p.decode.lock().is_empty());

    // Up, but no prefill worker has registered.
    let shutdown = CancellationToken::new();
    let (port, _) = bootstrap(json!({}), &shutdown).await;
    let p = pair(shutdown, port).await;
    let (status, _, text) =
        exchange(p.conductor, "POST", "/v1/completions", &completion("x y z")).await;
    assert_eq!(status, 502, "{text}");
    assert_openai_error(&text, "upstream", "no prefill worker has registered yet");
    assert!(p.prefill.lock().is_empty() && p.decode.lock().is_empty());
}

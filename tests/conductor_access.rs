//! The conductor exposed as a service (issue 34), in front of real synthetic engines on
//! loopback: API keys (`--api-key-file`: 401 in OpenAI's error shape without the right one,
//! `/health` open), the request id and the W3C trace context passed to both engines of a
//! request (seen by a tap in front of each engine's real router) with the client's key or the
//! engines' own (`--engine-api-key-file`), the id echoed to the client, `models[].created`, and
//! `usage.prompt_tokens_details.cached_tokens` in JSON and streamed answers.

mod serve_support;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::Request;
use axum::http::HeaderMap;
use axum::middleware::Next;
use kvpool_conductor::server::{Access, ApiKeys};
use kvpool_core::sched::Rejection;
use parking_lot::Mutex;
use serde_json::{Value, json};
use serve_support::{listen, sse_data, start_conductor};
use tokio_util::sync::CancellationToken;

const MODEL: &str = "synthetic-70b";
const BLOCK: u32 = 16;
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// The headers of every request an engine received on a client's behalf.
type Seen = Arc<Mutex<Vec<HeaderMap>>>;

/// A synthetic engine whose real router sits behind a tap that keeps the headers of each
/// request made on a client's behalf: the conductor's own `GET /v1/models` (which models each
/// engine serves, asked in the background once requests arrive) are left out, so that they
/// cannot come between a client's request and the checks on what reached the engines.
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
                        if req.uri().path() != "/v1/models" {
                            tap.lock().push(req.headers().clone());
                        }
                        next.run(req).await
                    }
                },
            ));
    let (l, a) = listen().await;
    tokio::spawn(kvpool_synthetic::server::serve(l, router, shutdown.clone()));
    (a, seen)
}

/// One HTTP/1.1 exchange with `headers`; (status, reply headers, de-chunked body).
async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, HeaderMap, String) {
    let call = kvpool_harness::http::Call {
        headers,
        ..kvpool_harness::http::Call::new(method, path, body)
    };
    let r = kvpool_harness::http::call(addr, call)
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    (r.status, r.headers, r.body)
}

struct Pool {
    conductor: SocketAddr,
    prefill: Seen,
    decode: Seen,
    _shutdown: CancellationToken,
}

async fn pool(access: Access) -> Pool {
    let shutdown = CancellationToken::new();
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
    config.access = access;
    let (conductor, _) = start_conductor(config, &shutdown).await;
    Pool {
        conductor,
        prefill,
        decode,
        _shutdown: shutdown,
    }
}

fn completion(prompt: &str, stream: bool) -> String {
    let mut body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 3, "stream": stream});
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    body.to_string()
}

fn header_of<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

#[tokio::test]
async fn api_keys_guard_the_api_and_the_trace_and_request_id_reach_both_engines() {
    let keys = Access {
        api_keys: Some(ApiKeys::new(&["sk-right", "sk-other"])),
        engine_api_key: None,
    };
    let p = pool(keys).await;
    let prompt = "a long shared prefix that spans a few blocks of sixteen stand-in tokens each";

    // No key, a wrong key, another scheme: 401 in OpenAI's shape, nothing reaches an engine.
    for (headers, message) in [
        (vec![], "didn't provide an API key"),
        (
            vec![("Authorization", "Bearer sk-wrong")],
            "Incorrect API key",
        ),
        (
            vec![("Authorization", "Basic sk-right")],
            "Incorrect API key",
        ),
    ] {
        let (status, head, body) = call(
            p.conductor,
            "POST",
            "/v1/completions",
            &headers,
            &completion(prompt, false),
        )
        .await;
        assert_eq!(status, 401, "{body}");
        assert_eq!(header_of(&head, "www-authenticate"), Some("Bearer"));
        let v: Value = serde_json::from_str(&body).expect("json");
        assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains(message),
            "{v}"
        );
    }
    let (status, _, _) = call(p.conductor, "GET", "/v1/models", &[], "").await;
    assert_eq!(status, 401, "listing models needs a key too");
    assert!(p.prefill.lock().is_empty() && p.decode.lock().is_empty());
    // The health check and the autoscaling load need none.
    assert_eq!(call(p.conductor, "GET", "/health", &[], "").await.0, 200);
    assert_eq!(
        call(p.conductor, "GET", "/v1/kvpool/load", &[], "").await.0,
        200
    );

    // The right key: served; the id comes back, and the id, the trace context and the key
    // reach both engines.
    let auth = ("Authorization", "Bearer sk-right");
    let headers = [
        auth,
        ("traceparent", TRACEPARENT),
        ("tracestate", "vendor=opaque"),
        ("X-Request-Id", "client-req-7"),
    ];
    let (status, head, body) = call(
        p.conductor,
        "POST",
        "/v1/completions",
        &headers,
        &completion(prompt, false),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(header_of(&head, "x-request-id"), Some("client-req-7"));
    for (engine, seen) in [("prefill", &p.prefill), ("decode", &p.decode)] {
        let seen = seen.lock();
        let h = seen
            .last()
            .unwrap_or_else(|| panic!("the {engine} engine was called"));
        assert_eq!(header_of(h, "traceparent"), Some(TRACEPARENT), "{engine}");
        assert_eq!(
            header_of(h, "tracestate"),
            Some("vendor=opaque"),
            "{engine}"
        );
        assert_eq!(
            header_of(h, "x-request-id"),
            Some("client-req-7"),
            "{engine}"
        );
        assert_eq!(
            header_of(h, "authorization"),
            Some("Bearer sk-right"),
            "{engine}"
        );
    }
    // Without an id of its own, a request gets a new one, the same at the engines.
    let (_, head, _) = call(
        p.conductor,
        "POST",
        "/v1/completions",
        &[auth],
        &completion("other", false),
    )
    .await;
    let id = header_of(&head, "x-request-id")
        .expect("a new id")
        .to_owned();
    assert_eq!(id.len(), 32);
    assert_eq!(
        header_of(p.decode.lock().last().expect("decode"), "x-request-id"),
        Some(id.as_str())
    );

    // Cached tokens: the prompt again finds its prefix in the prefill engine's cache.
    let v: Value = serde_json::from_str(&body).expect("json");
    let first = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert!(first.is_some(), "usage carries cached_tokens: {v}");
    let (_, _, again) = call(
        p.conductor,
        "POST",
        "/v1/completions",
        &[auth],
        &completion(prompt, false),
    )
    .await;
    let again: Value = serde_json::from_str(&again).expect("json");
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens");
    let prompt_tokens = again["usage"]["prompt_tokens"]
        .as_u64()
        .expect("prompt tokens");
    assert!(cached > 0 && cached <= prompt_tokens, "{again}");
    // Streamed, with the usage chunk asked for: it carries them too.
    let (status, _, text) = call(
        p.conductor,
        "POST",
        "/v1/completions",
        &[auth],
        &completion(prompt, true),
    )
    .await;
    assert_eq!(status, 200);
    let usage = sse_data(&text)
        .into_iter()
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(&d).ok())
        .find(|v| v["usage"].is_object())
        .expect("a usage chunk");
    assert!(
        usage["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0),
        "{usage}"
    );

    // Models: listed with the time the conductor started serving them.
    let (status, _, body) = call(p.conductor, "GET", "/v1/models", &[auth], "").await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&body).expect("json");
    assert!(
        models["data"][0]["created"].as_u64() > Some(1_700_000_000),
        "{models}"
    );
}

#[tokio::test]
async fn the_engines_own_key_replaces_the_clients_on_every_engine_call() {
    let p = pool(Access {
        api_keys: None,
        engine_api_key: Some("sk-engine".into()),
    })
    .await;
    let (status, _, body) = call(
        p.conductor,
        "POST",
        "/v1/completions",
        &[("Authorization", "Bearer sk-client")],
        &completion("hello", false),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    for seen in [&p.prefill, &p.decode] {
        let seen = seen.lock();
        assert!(!seen.is_empty());
        assert!(
            seen.iter()
                .all(|h| header_of(h, "authorization") == Some("Bearer sk-engine")),
            "every engine call carries the engines' key"
        );
    }
    // Without keys configured, the health check answers and nothing is asked of clients.
    assert_eq!(call(p.conductor, "GET", "/health", &[], "").await.0, 200);
}

//! The conductor's OpenAI layer in front of real synthetic engines on loopback: every request
//! shape the OpenAI API and vLLM take reaches the engines (batched and token-id prompts, `n`,
//! content parts, tool-call turns, fields the conductor does not know), the usage chunk of
//! `stream_options.include_usage`, role validation, `/v1/models/{id}`, JSON errors for unknown
//! routes and methods, unique response ids, and the 400 for a request no load would let
//! through beside the 429 for overload.

mod serve_support;

use std::net::SocketAddr;

use http::HeaderMap;
use kvpool_conductor::ConductorConfig;
use kvpool_core::sched::{PrefillCost, Rejection};
use prometheus::Registry;
use serde_json::{Value, json};
use serve_support::{assert_metric, exchange, header, listen, sse_data, start_conductor};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

const MODEL: &str = "org/synthetic-70b";
const BLOCK: u32 = 16;

async fn engine(shutdown: &CancellationToken) -> (SocketAddr, Registry) {
    serve_support::start_engine(serve_support::engine_config(MODEL, BLOCK), shutdown).await
}

fn config(
    prefill: Vec<String>,
    decode: String,
    rejection: Rejection,
    ttft_s: f64,
) -> ConductorConfig {
    serve_support::conductor_config(MODEL, BLOCK, prefill, decode, rejection, ttft_s)
}

/// A conductor in front of one synthetic prefill and one synthetic decode engine.
struct Pair {
    conductor: SocketAddr,
    metrics: Registry,
    prefill: Registry,
    decode: Registry,
    shutdown: CancellationToken,
}

async fn pair(rejection: Rejection, ttft_s: f64) -> Pair {
    let shutdown = CancellationToken::new();
    let (p, prefill) = engine(&shutdown).await;
    let (d, decode) = engine(&shutdown).await;
    let cfg = config(
        vec![format!("http://{p}")],
        format!("http://{d}"),
        rejection,
        ttft_s,
    );
    let (conductor, metrics) = start_conductor(cfg, &shutdown).await;
    Pair {
        conductor,
        metrics,
        prefill,
        decode,
        shutdown,
    }
}

/// POSTs `body` (JSON) to `path`; returns the status, the headers and the body.
async fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, HeaderMap, String) {
    exchange(addr, "POST", path, &body.to_string()).await
}

fn json_of(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

#[tokio::test]
async fn every_prompt_shape_and_unknown_field_reaches_the_engines() {
    let c = pair(Rejection::Predicted, 30.0).await;
    // A batch of two text prompts, two choices each: four choices in one response.
    let (status, _, text) = post(
        c.conductor,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": ["the first prompt", "the second one"], "n": 2,
                "max_tokens": 3, "stop": ["\n"], "echo": false, "logprobs": null, "seed": 7,
                "a_field_only_some_engine_knows": {"x": [1, null]}}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let v = json_of(&text);
    assert_eq!(v["choices"].as_array().map(Vec::len), Some(4), "{text}");
    assert_eq!(v["usage"]["completion_tokens"], 12, "{text}");
    // Token ids, alone and batched.
    for prompt in [json!([1, 2, 3, 4, 5]), json!([[1, 2, 3], [4, 5, 6, 7]])] {
        let (status, _, text) = post(
            c.conductor,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}),
        )
        .await;
        assert_eq!(status, 200, "{prompt}: {text}");
    }
    // The token-id batch was prefilled whole: 3 + 4 prompt tokens.
    let (_, _, text) = post(
        c.conductor,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": [[9, 9, 9], [8, 8, 8, 8]], "max_tokens": 1}),
    )
    .await;
    assert_eq!(json_of(&text)["usage"]["prompt_tokens"], 7, "{text}");
    // Chat: every role, content parts with an image, a tool-call turn with null content,
    // tools and a response format.
    let (status, _, text) = post(
        c.conductor,
        "/v1/chat/completions",
        &json!({"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "system", "content": "you are a test"},
            {"role": "user", "content": [
                {"type": "text", "text": "what is in"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": "this picture?"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                "type": "function", "function": {"name": "look", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a cat"},
            {"role": "function", "name": "look", "content": "a cat"}],
          "tools": [{"type": "function", "function": {"name": "look", "parameters": {}}}],
          "tool_choice": "auto", "response_format": {"type": "json_object"}}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let v = json_of(&text);
    assert_eq!(v["object"], "chat.completion", "{text}");
    // Each request was prefilled once and decoded once: the engines took every shape.
    assert_metric(&c.prefill, "kvpool_engine_requests_total", 5.0);
    assert_metric(&c.decode, "kvpool_engine_requests_total", 5.0);
    c.shutdown.cancel();
}

#[tokio::test]
async fn a_stream_with_include_usage_ends_with_the_usage_chunk() {
    let c = pair(Rejection::Predicted, 30.0).await;
    for (path, body) in [
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "hello there", "max_tokens": 3, "stream": true,
                    "stream_options": {"include_usage": true}}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3, "n": 2, "stream": true,
                    "stream_options": {"include_usage": true}}),
        ),
    ] {
        let (status, _, text) = post(c.conductor, path, &body).await;
        assert_eq!(status, 200, "{text}");
        let ev = sse_data(&text);
        assert_eq!(ev.last().map(String::as_str), Some("[DONE]"), "{text}");
        let choices = body["n"].as_u64().unwrap_or(1);
        // One chunk per token and choice, then the usage chunk, then [DONE].
        assert_eq!(ev.len() as u64, 3 * choices + 2, "{text}");
        let usage = json_of(&ev[ev.len() - 2]);
        assert_eq!(usage["choices"], json!([]), "{text}");
        assert_eq!(usage["usage"]["completion_tokens"], 3 * choices, "{text}");
        assert!(usage["usage"]["prompt_tokens"].as_u64() > Some(0), "{text}");
        // The other chunks say `"usage": null`, as OpenAI's do.
        assert_eq!(json_of(&ev[0]).get("usage"), Some(&Value::Null), "{text}");
    }
    // Without the option there is no usage chunk.
    let (_, _, text) = post(
        c.conductor,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "hello", "max_tokens": 2, "stream": true}),
    )
    .await;
    assert_eq!(sse_data(&text).len(), 3, "{text}");
    c.shutdown.cancel();
}

#[tokio::test]
async fn bad_roles_and_shapes_are_refused_naming_the_field_before_any_engine() {
    let c = pair(Rejection::Predicted, 30.0).await;
    for (path, body, param, says) in [
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}),
            "messages",
            "messages[0].role",
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": [1, "a"]}),
            "prompt",
            "token 1",
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "a", "n": 0}),
            "n",
            "n:",
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "a", "stream_options": {"include_usage": true}}),
            "stream_options",
            "stream: true",
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "a", "temperature": -0.5}),
            "temperature",
            "from 0 to 2",
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": vec![[7]; 257]}),
            "prompt",
            "limit of 256 per request (--max-prompts-per-request)",
        ),
    ] {
        let (status, _, text) = post(c.conductor, path, &body).await;
        assert_eq!(status, 400, "{body}: {text}");
        let v = json_of(&text);
        assert_eq!(v["error"]["param"], param, "{text}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{text}");
        assert!(
            v["error"]["message"].as_str().unwrap_or("").contains(says),
            "{text}"
        );
    }
    // A body declared as plain text is refused as the engines refuse it: 415.
    let body = json!({"model": MODEL, "prompt": "a"}).to_string();
    let mut conn = tokio::net::TcpStream::connect(c.conductor)
        .await
        .expect("connect");
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: text/plain\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(req.as_bytes()).await.expect("send");
    let mut reply = String::new();
    conn.read_to_string(&mut reply).await.expect("reply");
    assert!(reply.starts_with("HTTP/1.1 415"), "{reply}");
    assert!(reply.contains("\"content_type\""), "{reply}");
    assert_metric(&c.prefill, "kvpool_engine_requests_total", 0.0);
    c.shutdown.cancel();
}

#[tokio::test]
async fn models_are_listed_and_got_and_unknown_routes_answer_json() {
    let c = pair(Rejection::Predicted, 30.0).await;
    let (status, _, text) = exchange(c.conductor, "GET", &format!("/v1/models/{MODEL}"), "").await;
    assert_eq!(status, 200, "{text}");
    let v = json_of(&text);
    assert_eq!(
        (v["id"].as_str(), v["object"].as_str()),
        (Some(MODEL), Some("model"))
    );
    let (status, _, text) = exchange(c.conductor, "GET", "/v1/models/nope", "").await;
    assert_eq!(status, 404, "{text}");
    assert_eq!(json_of(&text)["error"]["code"], "model_not_found", "{text}");
    let (status, _, text) = exchange(c.conductor, "GET", "/v1/models", "").await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(json_of(&text)["data"][0]["id"], MODEL, "{text}");
    // Unknown route, and a known route with the wrong method: JSON bodies, never empty.
    let (status, _, text) = exchange(c.conductor, "POST", "/v1/embeddings", "{}").await;
    assert_eq!(status, 404, "{text}");
    assert_eq!(json_of(&text)["error"]["code"], "not_found", "{text}");
    let (status, head, text) = exchange(c.conductor, "GET", "/v1/completions", "").await;
    assert_eq!(status, 405, "{text}");
    assert_eq!(
        json_of(&text)["error"]["code"],
        "method_not_allowed",
        "{text}"
    );
    assert!(
        header(&head, "allow").is_some_and(|a| a.eq_ignore_ascii_case("post")),
        "{head:?}"
    );
    c.shutdown.cancel();
}

#[tokio::test]
async fn response_ids_are_unique_random_128_bit_hex() {
    let c = pair(Rejection::Predicted, 30.0).await;
    let mut ids = std::collections::BTreeSet::new();
    for _ in 0..3 {
        let (_, _, text) = post(
            c.conductor,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "same", "max_tokens": 1}),
        )
        .await;
        let id = json_of(&text)["id"].as_str().unwrap_or_default().to_owned();
        let hex = id.strip_prefix("cmpl-").unwrap_or_default();
        assert!(
            hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
            "{id}"
        );
        ids.insert(id);
    }
    assert_eq!(ids.len(), 3, "{ids:?}");
    c.shutdown.cancel();
}

#[tokio::test]
async fn a_request_no_load_could_let_through_gets_400_not_a_retryable_429() {
    // A TTFT objective of 1 us cannot be met by any prefill, however idle.
    let c = pair(Rejection::Early, 1e-6).await;
    let (status, head, text) = post(
        c.conductor,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "hello", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 400, "{text}");
    assert!(header(&head, "retry-after").is_none(), "{head:?}");
    let v = serve_support::assert_openai_error(&text, "slo_unattainable", "idle pool");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{text}");
    assert_metric(&c.prefill, "kvpool_engine_requests_total", 0.0);
    assert_metric(&c.metrics, "kvpool_conductor_rejections_total", 1.0);
    c.shutdown.cancel();
}

/// A prefill "engine" that reads each request and never answers; every request read is
/// reported on the channel (its connection is then held open until the test ends).
async fn silent_engine(
    shutdown: &CancellationToken,
) -> (SocketAddr, tokio::sync::mpsc::Receiver<()>) {
    let (l, a) = listen().await;
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        loop {
            let (mut sock, _) = tokio::select! {
                accepted = l.accept() => match accepted {
                    Ok(s) => s,
                    Err(_) => return,
                },
                () = shutdown.cancelled() => return,
            };
            let tx = tx.clone();
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 << 10];
                if matches!(sock.read(&mut buf).await, Ok(n) if n > 0) {
                    let _ = tx.send(()).await;
                }
                shutdown.cancelled().await;
            });
        }
    });
    (a, rx)
}

#[tokio::test]
async fn overload_still_gets_429_with_retry_after() {
    let shutdown = CancellationToken::new();
    let (p, mut prefill_reads) = silent_engine(&shutdown).await;
    let (d, _) = engine(&shutdown).await;
    // Each prefill costs 1 s in the model: one fits the 1.5 s objective on an idle engine, a
    // second one queued behind it does not.
    let mut cfg = config(
        vec![format!("http://{p}")],
        format!("http://{d}"),
        Rejection::Early,
        1.5,
    );
    cfg.scheduler.prefill_costs = vec![PrefillCost {
        fixed_s: 1.0,
        linear_s: 0.0,
        quadratic_s: 0.0,
    }];
    let (conductor, metrics) = start_conductor(cfg, &shutdown).await;
    // The first request is placed and hangs at the silent prefill engine.
    let first = json!({"model": MODEL, "prompt": "first", "max_tokens": 1}).to_string();
    let mut hanging = tokio::net::TcpStream::connect(conductor)
        .await
        .expect("connect");
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {conductor}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{first}",
        first.len()
    );
    hanging.write_all(head.as_bytes()).await.expect("send");
    tokio::time::timeout(std::time::Duration::from_secs(30), prefill_reads.recv())
        .await
        .expect("the first request reaches the prefill engine")
        .expect("engine alive");
    // Booked there now: the second one would wait 1 s more, which load alone explains.
    let (status, head, text) = post(
        conductor,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "second", "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 429, "{text}");
    assert!(header(&head, "retry-after") == Some("1"), "{head:?}");
    assert_eq!(json_of(&text)["error"]["code"], "ttft", "{text}");
    assert_metric(&metrics, "kvpool_conductor_rejections_total", 1.0);
    drop(hanging);
    shutdown.cancel();
}

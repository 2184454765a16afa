//! The synthetic engine's OpenAI-compatible API over real loopback sockets, and its KV blocks
//! through a real `kvpool agent run` process.

mod pool_support;
mod serve_support;

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::process::Command;
use std::time::Duration;

use kvpool_harness::{Launcher, Probe, free_addr, kvpool_command};
use prometheus::Registry;
use serde_json::Value;
use serve_support::{assert_metric, http, metric, sse_data};
use tokio_util::sync::CancellationToken;

struct Engine {
    addr: SocketAddr,
    registry: Registry,
    shutdown: CancellationToken,
}

async fn start() -> Engine {
    let shutdown = CancellationToken::new();
    let config = serve_support::engine_config("synthetic-70b", 16);
    let (addr, registry) = serve_support::start_engine(config, &shutdown).await;
    Engine {
        addr,
        registry,
        shutdown,
    }
}

impl Engine {
    /// `POST path` with `body`; (status, body).
    async fn post(&self, path: &str, body: &str) -> (u16, String) {
        http(self.addr, "POST", path, body).await
    }
}

#[tokio::test]
async fn completion_returns_tokens_usage_and_caches_the_prefix() {
    let e = start().await;
    let prompt = "a".repeat(200); // 50 stand-in tokens, 3 full blocks of 16
    let body = format!(r#"{{"model":"synthetic-70b","prompt":"{prompt}","max_tokens":5}}"#);
    let (status, text) = e.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "tok0 tok1 tok2 tok3 tok4 ");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 50);
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_metric(&e.registry, "kvpool_engine_cached_prompt_tokens_total", 0.0);
    // The same prompt again: all 50 tokens come from the prefix cache.
    let (status, _) = e.post("/v1/completions", &body).await;
    assert_eq!(status, 200);
    assert_metric(
        &e.registry,
        "kvpool_engine_cached_prompt_tokens_total",
        50.0,
    );
    assert_metric(&e.registry, "kvpool_engine_generated_tokens_total", 10.0);
    e.shutdown.cancel();
}

#[tokio::test]
async fn chat_streams_server_sent_events() {
    let e = start().await;
    let body = r#"{"model":"synthetic-70b","stream":true,"max_tokens":4,
        "messages":[{"role":"user","content":"hello there"}]}"#;
    let (status, text) = e.post("/v1/chat/completions", body).await;
    assert_eq!(status, 200, "{text}");
    let events = sse_data(&text);
    assert_eq!(events.len(), 5, "{text}");
    assert_eq!(events[4], "[DONE]");
    let chunks: Vec<Value> = events[..4]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk json"))
        .collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["choices"][0]["delta"]["content"], "tok0 ");
    assert!(chunks[2]["choices"][0]["finish_reason"].is_null());
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
    assert!(chunks.iter().all(|c| c["id"] == chunks[0]["id"]));
    e.shutdown.cancel();
}

#[tokio::test]
async fn bad_requests_get_openai_errors_naming_the_field() {
    let e = start().await;
    let (status, text) = e
        .post(
            "/v1/completions",
            r#"{"model":"synthetic-70b","prompt":"x","max_tokens":0}"#,
        )
        .await;
    assert_eq!(status, 400);
    let v: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["error"]["param"], "max_tokens");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let (status, text) = e.post("/v1/chat/completions", "{not json").await;
    assert_eq!(status, 400, "{text}");
    let (status, text) = e
        .post("/v1/completions", r#"{"model":"gpt-4","prompt":"x"}"#)
        .await;
    assert_eq!(status, 404);
    assert!(text.contains("model_not_found"), "{text}");
    let (status, text) = http(e.addr, "GET", "/v1/models", "").await;
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["data"][0]["id"], "synthetic-70b");
    // Unknown routes and methods: OpenAI-style JSON bodies, as the conductor answers them.
    let (status, text) = http(e.addr, "GET", "/v1/nothing", "").await;
    assert_eq!(status, 404, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["error"]["code"], "not_found");
    let (status, text) = http(e.addr, "GET", "/v1/completions", "").await;
    assert_eq!(status, 405, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["error"]["code"], "method_not_allowed");
    e.shutdown.cancel();
}

#[test]
fn engine_command_requires_synthetic_mode() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvpool"))
        .args(["engine", "--listen", "127.0.0.1:0"])
        .output()
        .expect("run kvpool");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--synthetic: is required"), "{err}");
}

#[test]
fn engine_process_serves_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (api, admin) = (free_addr().expect("port"), free_addr().expect("port"));
    let mut child = Launcher::new(dir.path())
        .spawn(
            "engine",
            kvpool_command(pool_support::KVPOOL.as_ref())
                .args(["engine", "--synthetic", "--time-scale", "0.001"])
                .args(["--listen", &api.to_string()])
                .args(["--admin-listen", &admin.to_string()]),
        )
        .expect("spawn kvpool engine");
    child
        .wait_ready(&Probe::readyz(admin), Duration::from_secs(30))
        .expect("engine never became ready");
    let r = kvpool_harness::http::request(
        api,
        "POST",
        "/v1/completions",
        r#"{"model":"kvpool-synthetic","prompt":"hi","max_tokens":2}"#,
    )
    .expect("completion");
    assert_eq!(r.status, 200, "{}", r.body);
    let metrics = kvpool_harness::http::get(admin, "/metrics").expect("metrics");
    assert_eq!(metrics.status, 200);
    assert_eq!(
        kvpool_harness::scrape::metric_sum(&metrics.body, "kvpool_engine_generated_tokens_total"),
        2.0,
        "{}",
        metrics.body
    );
    let status = child
        .terminate(Duration::from_secs(60))
        .expect("exits after SIGTERM");
    assert!(status.success(), "{status:?}");
}

struct KvEngine {
    addr: SocketAddr,
    registry: Registry,
}

const KV_MODEL: &str = "synthetic-kv";
const KV_BLOCK_TOKENS: u32 = 4;
const KV_BYTES_PER_TOKEN: u64 = 100;

async fn start_with_agent(socket: &std::path::Path, shutdown: &CancellationToken) -> KvEngine {
    let config = serve_support::engine_config(KV_MODEL, KV_BLOCK_TOKENS);
    let geometry = kvpool_synthetic::kv::KvGeometry {
        bytes_per_token: KV_BYTES_PER_TOKEN,
        block_tokens: KV_BLOCK_TOKENS,
    };
    let kv = kvpool_synthetic::agent::AgentKv::connect(socket, geometry, KV_MODEL)
        .await
        .expect("engine-API session");
    let (addr, registry) = serve_support::start_engine_with_agent(config, Some(kv), shutdown).await;
    KvEngine { addr, registry }
}

/// A completion of `prompt` (with the hand-off parameters `kv`) at the engine on `addr`.
async fn complete(addr: SocketAddr, prompt: &str, kv: Option<&Value>) -> (u16, String) {
    http(addr, "POST", "/v1/completions", &completion(prompt, kv)).await
}

fn completion(prompt: &str, kv: Option<&Value>) -> String {
    let mut body = serde_json::json!({"model": KV_MODEL, "prompt": prompt, "max_tokens": 2});
    if let Some(kv) = kv {
        body["kv_transfer_params"] = kv.clone();
    }
    body.to_string()
}

/// 16 bytes = 4 stand-in tokens = one block, distinct per `tag`.
fn block_text(tag: &str) -> String {
    format!("{tag:-<16}")
}

#[tokio::test]
async fn kv_blocks_are_written_hit_and_handed_to_decode_through_a_real_agent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_agent, socket) = pool_support::start_local_agent(dir.path());
    let shutdown = CancellationToken::new();
    let prefill = start_with_agent(&socket, &shutdown).await;
    let other = start_with_agent(&socket, &shutdown).await;
    let decode = start_with_agent(&socket, &shutdown).await;
    let block = (KV_BLOCK_TOKENS as u64 * KV_BYTES_PER_TOKEN) as f64;

    // Prefill: 3 full blocks and a partial one; all full blocks are computed and written.
    let prompt = format!(
        "{}{}{}tail",
        block_text("a"),
        block_text("b"),
        block_text("c")
    );
    let (status, text) = http(
        prefill.addr,
        "POST",
        "/v1/completions",
        &completion(
            &prompt,
            Some(&serde_json::json!({"do_remote_decode": true, "do_remote_prefill": false})),
        ),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    let handoff = v["kv_transfer_params"].clone();
    assert_eq!(handoff["do_remote_prefill"], true, "{text}");
    assert_eq!(handoff["kvpool_blocks"], 3, "{text}");
    let m = |e: &KvEngine, name: &str| metric(&e.registry, name);
    assert_eq!(m(&prefill, "kvpool_engine_kv_blocks_written_total"), 3.0);
    assert_eq!(
        m(&prefill, "kvpool_engine_kv_written_bytes_total"),
        3.0 * block
    );
    assert_eq!(m(&prefill, "kvpool_engine_kv_block_misses_total"), 3.0);
    assert_eq!(m(&prefill, "kvpool_engine_kv_block_hits_total"), 0.0);

    // Another engine (empty local cache) with the same two leading blocks reads them from the
    // pool, checks their bytes, and writes only its new full block.
    let prompt2 = format!("{}{}{}", block_text("a"), block_text("b"), block_text("z"));
    let (status, text) = complete(other.addr, &prompt2, None).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(m(&other, "kvpool_engine_kv_block_hits_total"), 2.0);
    assert_eq!(m(&other, "kvpool_engine_kv_read_bytes_total"), 2.0 * block);
    assert_eq!(m(&other, "kvpool_engine_kv_blocks_written_total"), 1.0);
    assert_eq!(m(&other, "kvpool_engine_kv_verify_failures_total"), 0.0);
    let v: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["usage"]["prompt_tokens"], 12);
    assert_eq!(m(&other, "kvpool_engine_cached_prompt_tokens_total"), 8.0);

    // Decode: the original request plus the hand-off; it reads all three blocks first.
    let (status, text) = complete(decode.addr, &prompt, Some(&handoff)).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(m(&decode, "kvpool_engine_kv_block_hits_total"), 3.0);
    assert_eq!(m(&decode, "kvpool_engine_kv_read_bytes_total"), 3.0 * block);
    assert_eq!(m(&decode, "kvpool_engine_kv_blocks_written_total"), 0.0);
    assert_eq!(m(&decode, "kvpool_engine_generated_tokens_total"), 2.0);

    // A block whose bytes in the pool are wrong is detected and not used.
    let bad = format!("{}{}", block_text("q"), block_text("r"));
    let tokens = kvpool_core::sched::text_tokens(&bad, 4);
    let keys =
        kvpool_core::sched::block_keys(&tokens, NonZeroU32::new(KV_BLOCK_TOKENS).expect("nz"));
    let mut client =
        kvpool_client::engine_api::client::EngineClient::connect(&socket, 4096, "test")
            .await
            .expect("client");
    let status = client
        .put(
            &kvpool_synthetic::kv::pool_key(KV_MODEL, keys[0]),
            &vec![7u8; block as usize],
        )
        .await
        .expect("put");
    assert_eq!(status, kvpool_proto::engine_api::Status::Ok);
    let (status, text) = complete(decode.addr, &bad, Some(&handoff)).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(m(&decode, "kvpool_engine_kv_verify_failures_total"), 1.0);
    assert_eq!(m(&decode, "kvpool_engine_kv_block_hits_total"), 3.0);
    // Both blocks of `bad` are computed by the decode engine instead.
    assert_eq!(m(&decode, "kvpool_engine_kv_block_misses_total"), 2.0);
    client.close().await.expect("close");
    shutdown.cancel();
}

/// Runs `kvpool engine --synthetic` on an agent socket that does not exist, with `tune`'s
/// changes to the command; it must fail before serving. Its stderr.
fn engine_on_a_missing_agent(tune: impl FnOnce(&mut Command)) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvpool"));
    cmd.args(["engine", "--synthetic"])
        .args(["--agent-socket", "/nonexistent/agent.sock"])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"]);
    tune(&mut cmd);
    let out = cmd.output().expect("run kvpool");
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn engine_with_agent_socket_needs_a_kv_size() {
    let err = engine_on_a_missing_agent(|c| {
        c.env_remove("KVPOOL_AGENT_SOCKET")
            .env_remove("KVPOOL_KV_BYTES_PER_TOKEN")
            .env_remove("KVPOOL_MODEL_CONFIG");
    });
    assert!(
        err.contains("--kv-bytes-per-token or --model-config"),
        "{err}"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("config.json");
    std::fs::write(&cfg, r#"{"num_hidden_layers": 2}"#).expect("write");
    let err = engine_on_a_missing_agent(|c| {
        c.arg("--model-config").arg(&cfg);
    });
    let err = format!("{err:?}");
    assert!(err.contains("num_attention_heads"), "{err}");
}

#[tokio::test]
async fn requests_are_served_when_the_agent_goes_away() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut agent, socket) = pool_support::start_local_agent(dir.path());
    let shutdown = CancellationToken::new();
    let engine = start_with_agent(&socket, &shutdown).await;
    agent.kill().expect("kill and reap the agent");
    let prompt = format!("{}{}", block_text("x"), block_text("y"));
    let (status, text) = complete(engine.addr, &prompt, None).await;
    // The engine computes everything itself and says so in its metrics.
    assert_eq!(status, 200, "{text}");
    assert!(metric(&engine.registry, "kvpool_engine_kv_errors_total") >= 1.0);
    assert_metric(
        &engine.registry,
        "kvpool_engine_kv_blocks_written_total",
        0.0,
    );
    assert_metric(
        &engine.registry,
        "kvpool_engine_generated_tokens_total",
        2.0,
    );
    shutdown.cancel();
}

#[tokio::test]
async fn prefetch_loads_pool_blocks_into_the_prefix_cache_and_404s_without_an_agent() {
    // Without an agent there is no pool to read: 404, the conductor's "unsupported".
    let plain = start().await;
    let (status, text) = plain
        .post(
            kvpool_proto::prefetch::PREFETCH_PATH,
            r#"{"keys":["0000000000000001"]}"#,
        )
        .await;
    assert_eq!(status, 404, "{text}");
    plain.shutdown.cancel();

    let dir = tempfile::tempdir().expect("tempdir");
    let (_agent, socket) = pool_support::start_local_agent(dir.path());
    let shutdown = CancellationToken::new();
    let writer = start_with_agent(&socket, &shutdown).await;
    let reader = start_with_agent(&socket, &shutdown).await;
    // The writer prefills 3 full blocks (and a partial one) and stores the full ones.
    let prompt = format!(
        "{}{}{}tail",
        block_text("x"),
        block_text("y"),
        block_text("z")
    );
    let (status, text) = complete(writer.addr, &prompt, None).await;
    assert_eq!(status, 200, "{text}");
    let tokens = kvpool_core::sched::text_tokens(&prompt, 4);
    let keys =
        kvpool_core::sched::block_keys(&tokens, NonZeroU32::new(KV_BLOCK_TOKENS).expect("nonzero"));
    assert_eq!(keys.len(), 4);
    // The reader prefetches all 4: the 3 stored ones load (verified), the partial one is not in
    // the pool, so reading stops there.
    let body = kvpool_proto::prefetch::prefetch_body(&keys).to_string();
    let path = kvpool_proto::prefetch::PREFETCH_PATH;
    let (status, text) = http(reader.addr, "POST", path, &body).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["loaded"], 3, "{text}");
    let m = |e: &KvEngine, name: &str| metric(&e.registry, name);
    assert_eq!(m(&reader, "kvpool_engine_kv_block_hits_total"), 3.0);
    assert_eq!(
        m(&reader, "kvpool_engine_kv_read_bytes_total"),
        (3 * u64::from(KV_BLOCK_TOKENS) * KV_BYTES_PER_TOKEN) as f64
    );
    // The prompt then finds its 12 leading tokens in the reader's own cache: no pool read.
    let (status, text) = complete(reader.addr, &prompt, None).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(m(&reader, "kvpool_engine_cached_prompt_tokens_total"), 12.0);
    assert_eq!(m(&reader, "kvpool_engine_kv_block_hits_total"), 3.0);
    // A bad body is a 400 naming the field.
    let (status, text) = http(reader.addr, "POST", path, r#"{"keys":[7]}"#).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains(r#""param":"keys""#), "{text}");
    shutdown.cancel();
}

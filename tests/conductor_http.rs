//! The conductor in front of real synthetic engines, all on loopback sockets.

use std::net::SocketAddr;
use std::num::NonZeroU32;

use kvpool::conductor::ConductorConfig;
use kvpool::sched::{DecodeCost, HotConfig, Policy, PrefillCost, Rejection, SchedulerConfig, Slo};
use kvpool::synthetic::EngineConfig;
use prometheus::Registry;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

const MODEL: &str = "synthetic-70b";
const BLOCK: u32 = 16;

async fn listen() -> (tokio::net::TcpListener, SocketAddr) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let a = l.local_addr().expect("addr");
    (l, a)
}

/// A synthetic engine; returns its address and metrics registry.
async fn engine(shutdown: &CancellationToken) -> (SocketAddr, Registry) {
    let config = EngineConfig {
        model: MODEL.into(),
        prefill_cost: PrefillCost::default(),
        decode_cost: DecodeCost::default(),
        block_size: NonZeroU32::new(BLOCK).expect("nonzero"),
        cache_blocks: 1000,
        chunk_bytes: 4,
        time_scale: 0.001,
    };
    let registry = Registry::new();
    let router = kvpool::synthetic::server::router(config, &registry).expect("router");
    let (l, a) = listen().await;
    tokio::spawn(kvpool::synthetic::server::serve(
        l,
        router,
        shutdown.clone(),
    ));
    (a, registry)
}

struct Cluster {
    conductor: SocketAddr,
    conductor_metrics: Registry,
    prefill: Vec<Registry>,
    decode: Registry,
    shutdown: CancellationToken,
}

async fn cluster(rejection: Rejection, ttft_slo_s: f64) -> Cluster {
    cluster_with(rejection, ttft_slo_s, None, 0).await
}

async fn cluster_with(
    rejection: Rejection,
    ttft_slo_s: f64,
    decode: Option<String>,
    hot_threshold: u32,
) -> Cluster {
    let shutdown = CancellationToken::new();
    let (p0, r0) = engine(&shutdown).await;
    let (p1, r1) = engine(&shutdown).await;
    let (d0, rd) = engine(&shutdown).await;
    let config = ConductorConfig {
        model: MODEL.into(),
        prefill: vec![format!("http://{p0}"), format!("http://{p1}")],
        decode: vec![decode.unwrap_or_else(|| format!("http://{d0}/"))],
        scheduler: SchedulerConfig {
            policy: Policy::Conductor,
            rejection,
            slo: Slo {
                ttft_s: ttft_slo_s,
                tpot_s: 0.1,
            },
            block_size: NonZeroU32::new(BLOCK).expect("nonzero"),
            bytes_per_token: 327_680,
            pool_bandwidth_bps: 25e9,
            kv_bandwidth_bps: 25e9,
            prefill_costs: vec![PrefillCost::default(); 2],
            decode_cost: DecodeCost::default(),
            decode_kv_capacity_tokens: 1_500_000,
            hot: HotConfig {
                threshold: hot_threshold,
                fanout: 1,
            },
            seed: 1,
        },
        engine_cache_blocks: 1000,
        tokenizer: kvpool::conductor::tokenize::PromptTokenizer::Chunks { bytes: 4 },
        pool: None,
    };
    let registry = Registry::new();
    let router = kvpool::conductor::server::router(config, &registry).expect("router");
    let (l, a) = listen().await;
    tokio::spawn(kvpool::conductor::server::serve(
        l,
        router,
        shutdown.clone(),
    ));
    Cluster {
        conductor: a,
        conductor_metrics: registry,
        prefill: vec![r0, r1],
        decode: rd,
        shutdown,
    }
}

/// One HTTP/1.1 exchange; returns (status, head, body).
async fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, String, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read");
    let status = out[9..12].parse().expect("status");
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    (status, head.to_owned(), body.to_owned())
}

fn counter(registry: &Registry, name: &str) -> f64 {
    registry
        .gather()
        .iter()
        .find(|f| f.name() == name)
        .map(|f| {
            f.get_metric()
                .iter()
                .map(|m| m.get_counter().get_value())
                .sum()
        })
        .unwrap_or(0.0)
}

#[tokio::test]
async fn routes_prefill_then_decode_and_keeps_prefix_affinity() {
    let c = cluster(Rejection::None, 30.0).await;
    // 400 bytes = 100 stand-in tokens = 6 full blocks of 16 plus a partial one.
    let system = "s".repeat(400);
    let ask =
        |turn: &str| format!(r#"{{"model":"{MODEL}","prompt":"{system}{turn}","max_tokens":6}}"#);
    let (status, _, body) = post(c.conductor, "/v1/completions", &ask("first question")).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).expect("json");
    assert_eq!(v["choices"][0]["text"], "tok0 tok1 tok2 tok3 tok4 tok5 ");
    // Prefill produced exactly one token; decode produced the six the client asked for.
    let prefill_tokens: Vec<f64> = c
        .prefill
        .iter()
        .map(|r| counter(r, "kvpool_engine_generated_tokens_total"))
        .collect();
    assert_eq!(prefill_tokens.iter().sum::<f64>(), 1.0);
    assert_eq!(
        counter(&c.decode, "kvpool_engine_generated_tokens_total"),
        6.0
    );
    let first = prefill_tokens
        .iter()
        .position(|&t| t == 1.0)
        .expect("one prefill engine served");

    // A second turn sharing the system prompt goes to the engine that caches it and hits there.
    let (status, _, body) = post(c.conductor, "/v1/completions", &ask("second question")).await;
    assert_eq!(status, 200, "{body}");
    let cached = counter(
        &c.prefill[first],
        "kvpool_engine_cached_prompt_tokens_total",
    );
    assert!(cached >= 96.0, "engine {first} cached {cached} tokens");
    assert_eq!(
        counter(
            &c.prefill[1 - first],
            "kvpool_engine_generated_tokens_total"
        ),
        0.0
    );
    c.shutdown.cancel();
}

#[tokio::test]
async fn hot_prefix_is_reported_as_a_replication_task() {
    let c = cluster_with(Rejection::None, 30.0, None, 2).await;
    let system = "s".repeat(400);
    let ask = format!(r#"{{"model":"{MODEL}","prompt":"{system}","max_tokens":2}}"#);
    let tasks = |c: &Cluster| {
        counter(
            &c.conductor_metrics,
            "kvpool_conductor_replication_tasks_total",
        )
    };
    // Hits count from the second request on (the first finds nothing cached); the third brings
    // the shared blocks to 2 hits, the threshold: one task, copying them to the other engine.
    for expected in [0.0, 0.0, 1.0] {
        let (status, _, body) = post(c.conductor, "/v1/completions", &ask).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(tasks(&c), expected);
    }
    // 100 stand-in tokens = 7 blocks of 16 (the last partial), all to the one other engine.
    assert_eq!(
        counter(
            &c.conductor_metrics,
            "kvpool_conductor_replication_blocks_total"
        ),
        7.0
    );
    c.shutdown.cancel();
}

#[tokio::test]
async fn streams_chat_through_the_decode_engine() {
    let c = cluster(Rejection::Predicted, 30.0).await;
    let body = format!(
        r#"{{"model":"{MODEL}","stream":true,"max_tokens":3,"messages":[{{"role":"user","content":"hi"}}]}}"#
    );
    let (status, head, text) = post(c.conductor, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    assert!(
        head.to_ascii_lowercase().contains("text/event-stream"),
        "{head}"
    );
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.len(), 4, "{text}");
    assert_eq!(events[3], "[DONE]");
    assert_eq!(
        counter(&c.conductor_metrics, "kvpool_conductor_requests_total"),
        1.0
    );
    c.shutdown.cancel();
}

#[tokio::test]
async fn rejects_with_429_and_retry_after_when_the_slo_cannot_be_met() {
    // A TTFT objective of 1 us cannot be met by any prefill.
    let c = cluster(Rejection::Early, 1e-6).await;
    let body = format!(r#"{{"model":"{MODEL}","prompt":"hello","max_tokens":2}}"#);
    let (status, head, text) = post(c.conductor, "/v1/completions", &body).await;
    assert_eq!(status, 429, "{text}");
    assert!(
        head.to_ascii_lowercase().contains("retry-after: 1"),
        "{head}"
    );
    let v: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["error"]["code"], "ttft");
    assert!(
        v["error"]["message"]
            .as_str()
            .expect("message")
            .contains("time to first token"),
        "{text}"
    );
    // Nothing reached the engines.
    for r in c.prefill.iter().chain([&c.decode]) {
        assert_eq!(counter(r, "kvpool_engine_requests_total"), 0.0);
    }
    assert_eq!(
        counter(&c.conductor_metrics, "kvpool_conductor_rejections_total"),
        1.0
    );
    // A malformed request is a 400 naming the field, before any scheduling.
    let (status, _, text) = post(
        c.conductor,
        "/v1/completions",
        &format!(r#"{{"model":"{MODEL}","prompt":"x","stream":1}}"#),
    )
    .await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains(r#""param":"stream""#), "{text}");
    c.shutdown.cancel();
}

#[tokio::test]
async fn unreachable_decode_engine_gives_502_naming_it() {
    // Port 1 on loopback: nothing listens there.
    let c = cluster_with(Rejection::None, 30.0, Some("http://127.0.0.1:1".into()), 0).await;
    let body = format!(r#"{{"model":"{MODEL}","prompt":"hello","max_tokens":2}}"#);
    let (status, _, text) = post(c.conductor, "/v1/completions", &body).await;
    assert_eq!(status, 502, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["error"]["type"], "upstream_error");
    assert!(text.contains("127.0.0.1:1"), "{text}");
    // The prefill engine did its part; the conductor counted the failure.
    let served: f64 = c
        .prefill
        .iter()
        .map(|r| counter(r, "kvpool_engine_generated_tokens_total"))
        .sum();
    assert_eq!(served, 1.0);
    assert_eq!(
        counter(&c.conductor_metrics, "kvpool_conductor_requests_total"),
        1.0
    );
    c.shutdown.cancel();
}

/// One HTTP/1.1 GET; returns the status, or None while nothing accepts connections.
async fn get_status(addr: SocketAddr, path: &str) -> Option<u16> {
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).await.ok()?;
    out.get(9..12)?.parse().ok()
}

/// Kills the child process on drop, so a failed assertion does not leak it.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn without_engines_the_real_binary_is_not_ready_and_answers_503() {
    // The operator starts `kvpool conductor` with no --prefill/--decode (it does not know the
    // engines yet): the process must start, stay not ready and explain the 503.
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
    };
    let (api, admin) = (free(), free());
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_kvpool"))
        .args([
            "conductor",
            "--listen",
            &api.to_string(),
            "--admin-listen",
            &admin.to_string(),
            "--ttft-slo-s",
            "2",
            "--tpot-slo-s",
            "0.05",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawn kvpool conductor");
    let mut child = Child(child);
    // Wait (generously) for both listeners; the conductor binds the API before the admin server.
    let mut ready = None;
    for _ in 0..600 {
        if let Some(status) = child.0.try_wait().expect("try_wait") {
            panic!("kvpool conductor exited early: {status}");
        }
        ready = get_status(admin, "/readyz").await;
        if ready.is_some() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(ready, Some(503), "/readyz without engines");
    assert_eq!(get_status(admin, "/livez").await, Some(200));
    let body = format!(r#"{{"model":"{MODEL}","prompt":"hello","max_tokens":2}}"#);
    let (status, _, text) = post(api, "/v1/completions", &body).await;
    assert_eq!(status, 503, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["error"]["code"], "no_engines", "{text}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("--prefill")),
        "{text}"
    );
    let (status, _, _) = post(api, "/v1/chat/completions", "{}").await;
    assert_eq!(status, 503);
}

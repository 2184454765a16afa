//! What the tests of in-process HTTP servers share (conductor_http, conductor_openai,
//! conductor_discovery, synthetic_engine): a synthetic engine's and a conductor's settings, a
//! conductor serving on loopback, a loopback listener, one HTTP exchange through the harness's
//! client, the payloads of a server-sent event stream, and a metric read from a server's
//! registry the way Prometheus would scrape it. Failures panic naming the call. I/O boundary:
//! loopback sockets.

#![allow(dead_code)]

use std::net::SocketAddr;

use http::HeaderMap;

use std::num::NonZeroU32;

use kvpool_core::sched::{DecodeCost, PrefillCost};
use kvpool_synthetic::EngineConfig;
use prometheus::{Registry, TextEncoder};

/// A listener on a free loopback port, and its address.
pub async fn listen() -> (tokio::net::TcpListener, SocketAddr) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0");
    let a = l.local_addr().expect("listener address");
    (l, a)
}

/// One HTTP/1.1 exchange with a JSON body; returns (status, headers, de-chunked body).
pub async fn exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, HeaderMap, String) {
    let call = kvpool_harness::http::Call::new(method, path, body);
    let r = kvpool_harness::http::call(addr, call)
        .await
        .unwrap_or_else(|e| panic!("{method} {path} to {addr}: {e}"));
    (r.status, r.headers, r.body)
}

/// The value of header `name` (any case), if present and text.
pub fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name)?.to_str().ok()
}

/// One HTTP/1.1 exchange; returns (status, body).
pub async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let (status, _, body) = exchange(addr, method, path, body).await;
    (status, body)
}

/// The OpenAI-style error in the JSON `body`: its `error.code` is `code` and its message
/// contains `says`. The parsed body, for further checks.
#[track_caller]
pub fn assert_openai_error(body: &str, code: &str, says: &str) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_str(body).expect("json error body");
    assert_eq!(v["error"]["code"], code, "{body}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains(says)),
        "{body}"
    );
    v
}

/// The `data` of each event of a whole server-sent event stream, in order, as
/// `eventsource-stream` reads it (a body that is no event stream fails the test).
pub fn sse_data(text: &str) -> Vec<String> {
    use eventsource_stream::Eventsource;
    use futures::StreamExt;
    let body = futures::stream::iter([Ok::<_, std::convert::Infallible>(text.to_owned())]);
    futures::executor::block_on(body.eventsource().collect::<Vec<_>>())
        .into_iter()
        .map(|e| {
            e.unwrap_or_else(|e| panic!("not an event stream ({e}): {text}"))
                .data
        })
        .collect()
}

/// The registry as Prometheus scrapes it.
fn exposition(registry: &Registry) -> String {
    TextEncoder::new()
        .encode_to_string(&registry.gather())
        .expect("encode the registry")
}

/// The sum of every sample of `name` in the registry's text exposition (counters and gauges).
pub fn metric(registry: &Registry, name: &str) -> f64 {
    kvpool_harness::scrape::metric_sum(&exposition(registry), name)
}

/// The sum of the samples of `name` whose labels include `label="value"`.
pub fn labelled(registry: &Registry, name: &str, label: &str, value: &str) -> f64 {
    kvpool_harness::scrape::metric_sum_labelled(&exposition(registry), name, label, value)
}

/// `metric(registry, name) == want`, naming the metric when it is not.
#[track_caller]
pub fn assert_metric(registry: &Registry, name: &str, want: f64) {
    assert_eq!(metric(registry, name), want, "{name}");
}

/// A synthetic engine with `config` serving on a loopback port until `shutdown`; with `kv` it
/// reads and writes KV blocks through a node agent. Its address and metrics registry.
pub async fn start_engine_with_agent(
    config: EngineConfig,
    kv: Option<kvpool_synthetic::agent::AgentKv>,
    shutdown: &tokio_util::sync::CancellationToken,
) -> (SocketAddr, Registry) {
    let registry = Registry::new();
    let router =
        kvpool_synthetic::server::router_with_agent(config, kv, &registry).expect("engine router");
    let (l, a) = listen().await;
    tokio::spawn(kvpool_synthetic::server::serve(l, router, shutdown.clone()));
    (a, registry)
}

/// Like [`start_engine_with_agent`], without an agent.
pub async fn start_engine(
    config: EngineConfig,
    shutdown: &tokio_util::sync::CancellationToken,
) -> (SocketAddr, Registry) {
    start_engine_with_agent(config, None, shutdown).await
}

/// A synthetic engine serving `model` in blocks of `block_size` tokens, 1000x faster than the
/// default cost models, with 4-byte stand-in tokens and room for 1000 cached blocks.
pub fn engine_config(model: &str, block_size: u32) -> EngineConfig {
    EngineConfig {
        model: model.into(),
        prefill_cost: PrefillCost::default(),
        decode_cost: DecodeCost::default(),
        block_size: NonZeroU32::new(block_size).expect("block size > 0"),
        cache_blocks: 1000,
        chunk_bytes: 4,
        time_scale: 0.001,
        sglang: None,
        // The conductor configs of these tests key blocks the same way.
        hashing: kvpool_core::sched::BlockHashing::Kvpool,
    }
}

/// A conductor over `prefill` and `decode` (static engines) serving `model` with `block`-token
/// blocks: the conductor policy, `rejection`, a TTFT SLO of `ttft_slo_s` and a TPOT SLO of
/// 0.1 s, one default prefill cost per prefill engine, no hot-block replication, no pool, vLLM
/// routing; tests change what they need on the returned value.
pub fn conductor_config(
    model: &str,
    block: u32,
    prefill: Vec<String>,
    decode: String,
    rejection: kvpool_core::sched::Rejection,
    ttft_slo_s: f64,
) -> kvpool_conductor::ConductorConfig {
    use kvpool_core::sched::{HotConfig, Policy, SchedulerConfig, Slo};
    let n = prefill.len();
    kvpool_conductor::ConductorConfig {
        models: vec![model.into()],
        prefill,
        decode: vec![decode],
        scheduler: SchedulerConfig {
            policy: Policy::Conductor,
            rejection,
            slo: Slo {
                ttft_s: ttft_slo_s,
                tpot_s: 0.1,
            },
            block_size: NonZeroU32::new(block).expect("nonzero block size"),
            bytes_per_token: 327_680,
            pool_bandwidth_bps: 25e9,
            kv_bandwidth_bps: 25e9,
            prefill_costs: vec![PrefillCost::default(); n],
            decode_cost: DecodeCost::default(),
            handoff: Default::default(),
            decode_kv_capacity_tokens: 1_500_000,
            hot: HotConfig {
                threshold: 0,
                fanout: 1,
            },
            seed: 1,
        },
        engine_cache_blocks: 1000,
        upstream: Default::default(),
        max_prompts: kvpool_conductor::DEFAULT_MAX_PROMPTS,
        access: Default::default(),
        tokenizer: kvpool_conductor::tokenize::PromptTokenizer::Chunks { bytes: 4 },
        chat_template: None,
        pool: None,
        protocol: kvpool_conductor::RoutingProtocol::Vllm,
        time_scale: 1.0,
        hashing: kvpool_core::sched::BlockHashing::Kvpool,
        kv_events: Vec::new(),
        kv_events_port: None,
        fit_prefill_cost: false,
    }
}

/// Serves a conductor built from `config` on a loopback port until `shutdown`; its address and
/// metrics registry.
pub async fn start_conductor(
    config: kvpool_conductor::ConductorConfig,
    shutdown: &tokio_util::sync::CancellationToken,
) -> (SocketAddr, Registry) {
    let registry = Registry::new();
    let router = kvpool_conductor::server::router(config, &registry).expect("router");
    let (l, a) = listen().await;
    tokio::spawn(kvpool_conductor::server::serve(l, router, shutdown.clone()));
    (a, registry)
}

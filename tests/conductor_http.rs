//! The conductor in front of real synthetic engines, all on loopback sockets; with a real
//! in-process master for the pool lookups and a real `kvpool agent run` process for prefetches.

mod pool_support;
mod serve_support;

use std::net::SocketAddr;
use std::num::NonZeroU32;

use http::HeaderMap;
use kvpool_conductor::{ConductorConfig, PoolLookup, RoutingProtocol};
use kvpool_core::sched::{PrefillCost, Rejection};
use kvpool_synthetic::{EngineConfig, SglangMode, SglangRole};
use prometheus::Registry;
use serde_json::Value;
use serve_support::{
    assert_metric, header, labelled, listen, metric as counter, sse_data, start_conductor,
};
use tokio_util::sync::CancellationToken;

async fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, HeaderMap, String) {
    serve_support::exchange(addr, "POST", path, body).await
}

const MODEL: &str = "synthetic-70b";
const BLOCK: u32 = 16;

/// A synthetic engine; returns its address and metrics registry.
async fn engine(shutdown: &CancellationToken) -> (SocketAddr, Registry) {
    engine_with(shutdown, None).await
}

/// KV bytes per token of the engines that have a node agent (small: the agent's DRAM is 16 MiB).
const KV_BYTES_PER_TOKEN: u64 = 64;

/// A synthetic engine, reading and writing KV blocks through the agent at `agent` when given.
async fn engine_with(
    shutdown: &CancellationToken,
    agent: Option<&std::path::Path>,
) -> (SocketAddr, Registry) {
    engine_mode(shutdown, agent, None).await
}

/// A synthetic engine in SGLang mode `sglang` (vLLM mode when `None`).
async fn engine_mode(
    shutdown: &CancellationToken,
    agent: Option<&std::path::Path>,
    sglang: Option<SglangMode>,
) -> (SocketAddr, Registry) {
    let config = EngineConfig {
        sglang,
        ..serve_support::engine_config(MODEL, BLOCK)
    };
    let kv = match agent {
        Some(socket) => Some(
            kvpool_synthetic::agent::AgentKv::connect(
                socket,
                kvpool_synthetic::kv::KvGeometry {
                    bytes_per_token: KV_BYTES_PER_TOKEN,
                    block_tokens: BLOCK,
                },
                MODEL,
            )
            .await
            .expect("engine-API session"),
        ),
        None => None,
    };
    serve_support::start_engine_with_agent(config, kv, shutdown).await
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
    cluster_full(rejection, ttft_slo_s, decode, hot_threshold, None, None).await
}

async fn cluster_full(
    rejection: Rejection,
    ttft_slo_s: f64,
    decode: Option<String>,
    hot_threshold: u32,
    pool: Option<PoolLookup>,
    agent: Option<&std::path::Path>,
) -> Cluster {
    let shutdown = CancellationToken::new();
    let (p0, r0) = engine_with(&shutdown, agent).await;
    let (p1, r1) = engine_with(&shutdown, agent).await;
    let (d0, rd) = engine(&shutdown).await;
    let mut config = serve_support::conductor_config(
        MODEL,
        BLOCK,
        vec![format!("http://{p0}"), format!("http://{p1}")],
        decode.unwrap_or_else(|| format!("http://{d0}/")),
        rejection,
        ttft_slo_s,
    );
    config.scheduler.hot.threshold = hot_threshold;
    config.pool = pool;
    let (a, registry) = start_conductor(config, &shutdown).await;
    Cluster {
        conductor: a,
        conductor_metrics: registry,
        prefill: vec![r0, r1],
        decode: rd,
        shutdown,
    }
}

/// The conductor over `prefill` and `decode` with no admission control and a 30 s TTFT target.
fn conductor_config(prefill: Vec<String>, decode: String) -> ConductorConfig {
    serve_support::conductor_config(MODEL, BLOCK, prefill, decode, Rejection::None, 30.0)
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
    assert_metric(&c.decode, "kvpool_engine_generated_tokens_total", 6.0);
    // Without KV event streams the conductor guesses each engine's cache from its routing,
    // and says so: the blocks it assumes, labelled source="mirror".
    assert!(
        serve_support::labelled(
            &c.conductor_metrics,
            "kvpool_conductor_engine_cached_blocks",
            "source",
            "mirror"
        ) >= 6.0,
        "the mirror gauge"
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

/// Polls `done` (bounded: only a hang reaches the end on a loaded box).
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..1200 {
        if done() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    panic!("never happened: {what}");
}

#[tokio::test]
async fn hot_prefix_prefetch_to_an_engine_without_an_agent_gets_404_and_stops() {
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
    // The engines here have no node agent: the target answers the prefetch with 404.
    let prefetches = "kvpool_conductor_prefetches_total";
    let m = &c.conductor_metrics;
    eventually("the prefetch answered 404", || {
        labelled(m, prefetches, "outcome", "unsupported") == 1.0
    })
    .await;
    let asked = |c: &Cluster| -> f64 {
        c.prefill
            .iter()
            .map(|r| counter(r, "kvpool_engine_prefetch_requests_total"))
            .sum()
    };
    assert_eq!(asked(&c), 1.0);
    // Two more requests bring the hits to 4: another task for the same engine, which the
    // conductor no longer sends.
    for _ in 0..2 {
        let (status, _, body) = post(c.conductor, "/v1/completions", &ask).await;
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(tasks(&c), 2.0);
    assert_eq!(
        labelled(m, prefetches, "outcome", "skipped_unsupported"),
        1.0
    );
    assert_eq!(asked(&c), 1.0, "a 404 engine is not asked again");
    assert_eq!(labelled(m, prefetches, "outcome", "ok"), 0.0);
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
        header(&head, "content-type").is_some_and(|c| c.starts_with("text/event-stream")),
        "{head:?}"
    );
    let events = sse_data(&text);
    assert_eq!(events.len(), 4, "{text}");
    assert_eq!(events[3], "[DONE]");
    assert_metric(&c.conductor_metrics, "kvpool_conductor_requests_total", 1.0);
    c.shutdown.cancel();
}

#[tokio::test]
async fn chat_requests_are_rendered_with_the_chat_template_and_its_refusals_named() {
    let shutdown = CancellationToken::new();
    let (p0, _) = engine(&shutdown).await;
    let (p1, _) = engine(&shutdown).await;
    let (d0, decode) = engine(&shutdown).await;
    let mut config = conductor_config(
        vec![format!("http://{p0}"), format!("http://{p1}")],
        format!("http://{d0}"),
    );
    let template = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}";
    config.chat_template = Some(std::sync::Arc::new(
        kvpool_conductor::chat::ChatTemplate::new(template.into(), String::new(), String::new())
            .expect("template"),
    ));
    let (addr, metrics) = start_conductor(config, &shutdown).await;
    let chat = |role: &str| {
        format!(
            r#"{{"model":"{MODEL}","max_tokens":2,"messages":[{{"role":"{role}","content":"hi"}}]}}"#
        )
    };
    let (status, _, text) = post(addr, "/v1/chat/completions", &chat("user")).await;
    assert_eq!(status, 200, "{text}");
    assert_metric(&decode, "kvpool_engine_generated_tokens_total", 2.0);
    let (status, _, text) = post(addr, "/v1/chat/completions", &chat("tool")).await;
    assert_eq!(status, 400, "{text}");
    serve_support::assert_openai_error(&text, "messages", "tool messages are not supported");
    // The refused request reached no engine.
    assert_metric(&decode, "kvpool_engine_generated_tokens_total", 2.0);
    assert!(counter(&metrics, "kvpool_conductor_requests_total") >= 2.0);
    shutdown.cancel();
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
    assert_metric(&c.conductor_metrics, "kvpool_conductor_requests_total", 1.0);
    c.shutdown.cancel();
}

#[tokio::test]
async fn without_engines_the_real_binary_is_not_ready_and_answers_503() {
    // The operator starts `kvpool conductor` with no --prefill/--decode (it does not know the
    // engines yet): the process must start, stay not ready and explain the 503.
    use kvpool_harness::{Launcher, Probe, free_addr, http, kvpool_command};
    let dir = tempfile::tempdir().expect("tempdir");
    let (api, admin) = (free_addr().expect("port"), free_addr().expect("port"));
    let mut child = Launcher::new(dir.path())
        .spawn(
            "conductor",
            kvpool_command(pool_support::KVPOOL.as_ref()).args([
                "conductor",
                "--listen",
                &api.to_string(),
                "--admin-listen",
                &admin.to_string(),
                "--ttft-slo",
                "2s",
                "--tpot-slo",
                "50ms",
            ]),
        )
        .expect("spawn kvpool conductor");
    // Wait (generously) for both listeners; the conductor binds the API before the admin server.
    child
        .wait_ready(&Probe::Tcp(admin), std::time::Duration::from_secs(30))
        .expect("kvpool conductor listens");
    let get_status =
        |path: &'static str| async move { http::get_async(admin, path).await.map(|r| r.status) };
    let ready = get_status("/readyz").await;
    assert_eq!(ready, Some(503), "/readyz without engines");
    assert_eq!(get_status("/livez").await, Some(200));
    let body = format!(r#"{{"model":"{MODEL}","prompt":"hello","max_tokens":2}}"#);
    let (status, _, text) = post(api, "/v1/completions", &body).await;
    assert_eq!(status, 503, "{text}");
    serve_support::assert_openai_error(&text, "no_engines", "--prefill");
    let (status, _, _) = post(api, "/v1/chat/completions", "{}").await;
    assert_eq!(status, 503);
}

/// Hand-offs of an engine that ended with `outcome`.
fn handoffs(registry: &Registry, outcome: &str) -> f64 {
    labelled(
        registry,
        "kvpool_engine_kv_handoffs_total",
        "outcome",
        outcome,
    )
}

const POOL_KEY: &[u8] = b"kvpool-test-pool-key-0123456789";

/// A master in this process, with one DRAM segment mounted.
async fn master() -> pool_support::InProcessMaster {
    let m = pool_support::in_process_master(POOL_KEY, |_| {}).await;
    m.client
        .mount_segment(&pool_support::dram_segment("a", 64 << 20))
        .await
        .expect("mount");
    m
}

/// Commits `keys` in the pool under the engines' naming (metadata only: nobody reads them).
async fn put_in_pool(client: &kvpool_client::master::MasterClient, keys: &[u64]) {
    let names: Vec<Vec<u8>> = keys
        .iter()
        .map(|&k| kvpool_core::sched::pool_key(MODEL, k))
        .collect();
    let items: Vec<(&[u8], u64)> = names.iter().map(|n| (n.as_slice(), 4096)).collect();
    let started = client
        .put_start_batch(&items, &kvpool_core::master::PutOptions::default())
        .await
        .expect("put_start");
    let mut ends = Vec::new();
    for (n, r) in names.iter().zip(started) {
        match r.expect("allocated") {
            kvpool_core::master::PutStarted::Allocated { put_id, .. } => {
                ends.push((n.as_slice(), put_id))
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    let done = client.put_end_batch(&ends).await.expect("put_end");
    assert!(done.iter().all(Result::is_ok), "{done:?}");
}

/// The conductor's own client of `master`, set up as `kvpool conductor --master` sets it up
/// (no waiting for a failover), with a timeout generous for a loaded box.
fn lookup(master: &kvpool_master::cmd::RunningMaster) -> PoolLookup {
    let timeout = std::time::Duration::from_secs(5);
    let client = kvpool_client::master::MasterClient::new(
        vec![master.grpc_addr.to_string()],
        kvpool_proto::auth::AuthKey::from_bytes(POOL_KEY).expect("key"),
        kvpool_client::master::ClientConfig {
            connect_timeout: timeout,
            request_timeout: timeout,
            failover_budget: std::time::Duration::ZERO,
            ..Default::default()
        },
    )
    .expect("client");
    PoolLookup {
        client,
        timeout,
        keys: kvpool_core::sched::PoolKeys::Synthetic,
        share: None,
        hot: None,
    }
}

#[tokio::test]
async fn blocks_in_the_pool_but_in_no_engine_are_fetched_not_prefilled() {
    let pool_support::InProcessMaster {
        _dir,
        master,
        shutdown: master_down,
        client,
    } = master().await;
    // 400 bytes = 100 stand-in tokens = 6 full blocks of 16 plus a partial one. The 6 full
    // blocks are in the pool (as an engine that prefilled this prompt earlier left them); no
    // engine behind this fresh conductor holds anything.
    let pooled = "p".repeat(400);
    let tokens = kvpool_core::sched::text_tokens(&pooled, 4);
    let keys = kvpool_core::sched::block_keys(&tokens, NonZeroU32::new(BLOCK).expect("nonzero"));
    assert_eq!(keys.len(), 7);
    put_in_pool(&client, &keys[..6]).await;
    let c = cluster_full(Rejection::None, 30.0, None, 0, Some(lookup(&master)), None).await;

    let ask = |prompt: &str| format!(r#"{{"model":"{MODEL}","prompt":"{prompt}","max_tokens":2}}"#);
    let (status, head, body) = post(c.conductor, "/v1/completions", &ask(&pooled)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(header(&head, "x-kvpool-pool-blocks"), Some("6"), "{head:?}");
    assert_eq!(
        header(&head, "x-kvpool-local-blocks"),
        Some("0"),
        "{head:?}"
    );
    let ttft = |head: &HeaderMap| -> f64 {
        header(head, "x-kvpool-ttft-estimate-ms")
            .expect("ttft header")
            .parse()
            .expect("ttft number")
    };
    let pooled_ttft = ttft(&head);
    let m = &c.conductor_metrics;
    let lookups = "kvpool_conductor_pool_lookups_total";
    assert_eq!(labelled(m, lookups, "outcome", "hit"), 1.0);

    // A prompt of the same length that the pool lacks: a miss, prefilled in full, so its
    // estimate is higher than the one that fetched 96 of its 100 tokens' KV.
    let fresh = "f".repeat(400);
    let (status, head, body) = post(c.conductor, "/v1/completions", &ask(&fresh)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(header(&head, "x-kvpool-pool-blocks"), Some("0"), "{head:?}");
    assert_eq!(labelled(m, lookups, "outcome", "miss"), 1.0);
    let fresh_ttft = ttft(&head);
    assert!(
        pooled_ttft < fresh_ttft,
        "pool hits must lower the estimate: {pooled_ttft} ms vs {fresh_ttft} ms"
    );

    // The master goes away: requests still succeed, placed on local knowledge, and the
    // failures are counted. The pooled prompt is now local on the engine that served it.
    master_down.cancel();
    master.join().await.expect("master stopped");
    let (status, head, body) = post(c.conductor, "/v1/completions", &ask(&pooled)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(header(&head, "x-kvpool-pool-blocks"), Some("0"), "{head:?}");
    assert_eq!(
        header(&head, "x-kvpool-local-blocks"),
        Some("7"),
        "{head:?}"
    );
    assert_eq!(
        labelled(m, lookups, "outcome", "error") + labelled(m, lookups, "outcome", "timeout"),
        1.0
    );
    c.shutdown.cancel();
}

#[tokio::test]
async fn a_master_that_never_answers_does_not_fail_requests() {
    // Accepts connections (the kernel's backlog) but never speaks: the lookup times out.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = silent.local_addr().expect("addr");
    let client = kvpool_client::master::MasterClient::new(
        vec![addr.to_string()],
        kvpool_proto::auth::AuthKey::from_bytes(POOL_KEY).expect("key"),
        kvpool_client::master::ClientConfig::default(),
    )
    .expect("client");
    let pool = PoolLookup {
        client,
        timeout: std::time::Duration::from_millis(200),
        keys: kvpool_core::sched::PoolKeys::Synthetic,
        share: None,
        hot: None,
    };
    let c = cluster_full(Rejection::None, 30.0, None, 0, Some(pool), None).await;
    let body = format!(r#"{{"model":"{MODEL}","prompt":"hello there","max_tokens":2}}"#);
    let (status, head, text) = post(c.conductor, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(header(&head, "x-kvpool-pool-blocks"), Some("0"), "{head:?}");
    let m = &c.conductor_metrics;
    let lookups = "kvpool_conductor_pool_lookups_total";
    assert_eq!(labelled(m, lookups, "outcome", "timeout"), 1.0);
    assert_eq!(labelled(m, lookups, "outcome", "hit"), 0.0);
    // The next request is served too: within the back-off it does not even ask (on a slow box
    // the back-off may be over, and it times out again).
    let (status, _, text) = post(c.conductor, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        labelled(m, lookups, "outcome", "timeout") + labelled(m, lookups, "outcome", "backoff"),
        2.0
    );
    drop(silent);
    c.shutdown.cancel();
}

#[tokio::test]
async fn hot_prefix_is_prefetched_from_the_pool_by_the_target_engine() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_agent, socket) = pool_support::start_local_agent(dir.path());
    let c = cluster_full(Rejection::None, 30.0, None, 2, None, Some(&socket)).await;
    // 100 stand-in tokens: 6 full blocks (written to the pool by the engine that prefills them
    // first) and a partial one (never written).
    let system = "h".repeat(400);
    let ask = format!(r#"{{"model":"{MODEL}","prompt":"{system}","max_tokens":2}}"#);
    for _ in 0..3 {
        let (status, _, body) = post(c.conductor, "/v1/completions", &ask).await;
        assert_eq!(status, 200, "{body}");
    }
    let written: Vec<f64> = c
        .prefill
        .iter()
        .map(|r| counter(r, "kvpool_engine_kv_blocks_written_total"))
        .collect();
    let first = written
        .iter()
        .position(|&w| w == 6.0)
        .expect("one engine wrote the 6 full blocks");
    let other = &c.prefill[1 - first];
    // The third request made the prefix hot: the other engine is asked to prefetch it, reads
    // the 6 full blocks from the pool through the agent and verifies them.
    let m = &c.conductor_metrics;
    eventually("the prefetch succeeded", || {
        labelled(m, "kvpool_conductor_prefetches_total", "outcome", "ok") == 1.0
    })
    .await;
    assert_eq!(
        labelled(
            other,
            "kvpool_engine_prefetch_requests_total",
            "outcome",
            "ok"
        ),
        1.0
    );
    assert_metric(other, "kvpool_engine_kv_block_hits_total", 6.0);
    assert_metric(
        other,
        "kvpool_engine_kv_read_bytes_total",
        (6 * BLOCK as u64 * KV_BYTES_PER_TOKEN) as f64,
    );
    assert_metric(other, "kvpool_engine_kv_verify_failures_total", 0.0);
    // It served no request, yet its cache now holds the prefix: a request for it there would
    // hit 96 tokens. The conductor's mirror knows too (see State::adopted's unit test).
    assert_metric(other, "kvpool_engine_prompt_tokens_total", 0.0);
    c.shutdown.cancel();
}

#[tokio::test]
async fn prefetches_in_flight_are_bounded() {
    use kvpool_conductor::server::MAX_PREFETCHES_IN_FLIGHT;
    let shutdown = CancellationToken::new();
    let (p0, _r0) = engine(&shutdown).await;
    let (d0, _rd) = engine(&shutdown).await;
    // The second prefill "engine" accepts connections (the kernel's backlog) and never answers:
    // every prefetch sent to it stays in flight. Requests never go there (the first engine
    // holds the prefix and is idle), so only prefetches are at stake.
    let hung = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let hung_url = format!("http://{}", hung.local_addr().expect("addr"));
    let mut config = conductor_config(
        vec![format!("http://{p0}"), hung_url],
        format!("http://{d0}"),
    );
    config.scheduler.hot.threshold = 1;
    let (conductor, m) = start_conductor(config, &shutdown).await;
    let ask = format!(
        r#"{{"model":"{MODEL}","prompt":"{}","max_tokens":1}}"#,
        "b".repeat(64)
    );
    // Threshold 1: from the second request on, every request makes the prefix hot again and
    // plans a copy to the hung engine. The first MAX_PREFETCHES_IN_FLIGHT are sent and hang;
    // the one after finds no slot and is dropped.
    let tasks = MAX_PREFETCHES_IN_FLIGHT + 1;
    for _ in 0..=tasks {
        let (status, _, body) = post(conductor, "/v1/completions", &ask).await;
        assert_eq!(status, 200, "{body}");
    }
    assert_metric(&m, "kvpool_conductor_replication_tasks_total", tasks as f64);
    let prefetches = "kvpool_conductor_prefetches_total";
    assert_eq!(labelled(&m, prefetches, "outcome", "busy"), 1.0);
    assert_eq!(
        counter(&m, prefetches),
        1.0,
        "the others are still in flight"
    );
    drop(hung);
    shutdown.cancel();
}

fn sglang(role: SglangRole, timeout_ms: u64) -> Option<SglangMode> {
    Some(SglangMode {
        role,
        bootstrap_timeout: std::time::Duration::from_millis(timeout_ms),
    })
}

/// A conductor routing SGLang-style to one prefill engine on agent `prefill_agent` and one
/// decode engine on agent `decode_agent`; returns it with the engines' registries.
async fn sglang_cluster(
    prefill_agent: &std::path::Path,
    decode_agent: &std::path::Path,
    decode_timeout_ms: u64,
) -> (Cluster, SocketAddr) {
    let shutdown = CancellationToken::new();
    let (p, rp) = engine_mode(
        &shutdown,
        Some(prefill_agent),
        sglang(SglangRole::Prefill, 60_000),
    )
    .await;
    let (d, rd) = engine_mode(
        &shutdown,
        Some(decode_agent),
        sglang(SglangRole::Decode, decode_timeout_ms),
    )
    .await;
    let mut config = conductor_config(vec![format!("http://{p}")], format!("http://{d}"));
    config.protocol = RoutingProtocol::Sglang {
        bootstrap_port: 8998,
    };
    let (a, registry) = start_conductor(config, &shutdown).await;
    let c = Cluster {
        conductor: a,
        conductor_metrics: registry,
        prefill: vec![rp],
        decode: rd,
        shutdown,
    };
    (c, d)
}

#[tokio::test]
async fn sglang_mode_pairs_prefill_and_decode_by_room_through_the_pool() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_agent, socket) = pool_support::start_local_agent(dir.path());
    let (c, _) = sglang_cluster(&socket, &socket, 60_000).await;
    // 400 bytes = 100 stand-in tokens = 6 full blocks of 16 plus a partial one.
    let prompt = "p".repeat(400);
    let body = format!(r#"{{"model":"{MODEL}","prompt":"{prompt}","max_tokens":5}}"#);
    let (status, _, text) = post(c.conductor, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    // The client gets the decode engine's answer: all five tokens.
    assert_eq!(v["choices"][0]["text"], "tok0 tok1 tok2 tok3 tok4 ");
    let prefill = &c.prefill[0];
    // The prefill half stopped after one token and put the 6 full blocks in the pool...
    assert_metric(prefill, "kvpool_engine_generated_tokens_total", 1.0);
    assert_metric(prefill, "kvpool_engine_kv_blocks_written_total", 7.0);
    // ...(6 blocks and the room's marker); the decode half waited for the room, read the 6
    // blocks back through the agent (every byte checked) and generated the rest.
    assert_eq!(handoffs(&c.decode, "ok"), 1.0);
    assert_metric(&c.decode, "kvpool_engine_kv_block_hits_total", 6.0);
    assert_metric(&c.decode, "kvpool_engine_kv_verify_failures_total", 0.0);
    assert_metric(&c.decode, "kvpool_engine_generated_tokens_total", 5.0);

    // A streaming chat completion: the decode engine's events come through.
    let body = format!(
        r#"{{"model":"{MODEL}","stream":true,"max_tokens":3,"messages":[{{"role":"user","content":"{prompt}"}}]}}"#
    );
    let (status, head, text) = post(c.conductor, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    assert!(
        header(&head, "content-type").is_some_and(|c| c.starts_with("text/event-stream")),
        "{head:?}"
    );
    let events: Vec<Value> = sse_data(&text)
        .into_iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(&e).expect("event json"))
        .collect();
    assert_eq!(events.len(), 3, "{text}");
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(events[2]["choices"][0]["finish_reason"], "length");
    let last = sse_data(&text).pop();
    assert_eq!(last.as_deref(), Some("[DONE]"), "{text}");
    assert_eq!(handoffs(&c.decode, "ok"), 2.0);
    assert_metric(prefill, "kvpool_engine_generated_tokens_total", 2.0);
    assert_eq!(
        labelled(
            &c.conductor_metrics,
            "kvpool_conductor_requests_total",
            "outcome",
            "ok"
        ),
        2.0
    );
    c.shutdown.cancel();
}

#[tokio::test]
async fn sglang_decode_whose_prefill_never_arrives_fails_clearly_within_its_timeout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_agent, socket) = pool_support::start_local_agent(dir.path());
    // Prefill and decode on two unconnected agents (no master): the room's KV never reaches
    // the decode engine's pool.
    let other = tempfile::tempdir().expect("tempdir");
    let (_other_agent, other_socket) = pool_support::start_local_agent(other.path());
    let (c, decode) = sglang_cluster(&socket, &other_socket, 300).await;

    // Straight to the decode engine, with a room no prefill serves.
    let body = format!(
        r#"{{"model":"{MODEL}","prompt":"hello","max_tokens":2,"bootstrap_host":"127.0.0.1","bootstrap_port":8998,"bootstrap_room":12345}}"#
    );
    let (status, _, text) = post(decode, "/v1/completions", &body).await;
    assert_eq!(status, 504, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["error"]["code"], "kv_handoff_timeout");
    let message = v["error"]["message"].as_str().expect("message");
    assert!(
        message.contains("bootstrap_room 12345") && message.contains("did not arrive"),
        "{message}"
    );
    // An SGLang-mode engine refuses a request without a room, naming the field.
    let (status, _, text) = post(
        decode,
        "/v1/completions",
        &format!(r#"{{"model":"{MODEL}","prompt":"hello"}}"#),
    )
    .await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains(r#""param":"bootstrap_room""#), "{text}");

    // Through the conductor: the prefill half succeeds on its own agent, the decode half times
    // out, and the client gets the decode engine's error.
    let body = format!(
        r#"{{"model":"{MODEL}","prompt":"{}","max_tokens":2}}"#,
        "q".repeat(80)
    );
    let (status, _, text) = post(c.conductor, "/v1/completions", &body).await;
    assert_eq!(status, 504, "{text}");
    assert!(
        text.contains("did not arrive from the prefill engine"),
        "{text}"
    );
    assert_eq!(handoffs(&c.decode, "timeout"), 2.0);
    assert_metric(&c.prefill[0], "kvpool_engine_generated_tokens_total", 1.0);
    assert_metric(&c.decode, "kvpool_engine_generated_tokens_total", 0.0);
    c.shutdown.cancel();
}

#[tokio::test]
async fn engines_report_their_measured_pool_reads_in_response_headers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_agent, socket) = pool_support::start_local_agent(dir.path());
    let shutdown = CancellationToken::new();
    let (writer, _) = engine_with(&shutdown, Some(&socket)).await;
    let (reader, _) = engine_with(&shutdown, Some(&socket)).await;
    // 6 full blocks of 16 stand-in tokens, and a partial one.
    let body = format!(
        r#"{{"model":"{MODEL}","prompt":"{}","max_tokens":1,"kv_transfer_params":{{"do_remote_decode":true}}}}"#,
        "w".repeat(400)
    );
    // The first engine computes the prompt and writes its blocks: nothing read.
    let (status, head, text) = post(writer, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        header(&head, "x-kvpool-kv-load-blocks"),
        Some("0"),
        "{head:?}"
    );
    assert_eq!(header(&head, "x-kvpool-kv-load-seconds"), None, "{head:?}");
    // The second finds them in the pool: 6 blocks read, and how long that took.
    let (status, head, text) = post(reader, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        header(&head, "x-kvpool-kv-load-blocks"),
        Some("6"),
        "{head:?}"
    );
    let seconds: f64 = header(&head, "x-kvpool-kv-load-seconds")
        .expect("load seconds")
        .parse()
        .expect("a number");
    assert!(seconds >= 0.0 && seconds.is_finite(), "{seconds}");
    // Asked again, it has them in its own cache: nothing read.
    let (_, head, _) = post(reader, "/v1/completions", &body).await;
    assert_eq!(
        header(&head, "x-kvpool-kv-load-blocks"),
        Some("0"),
        "{head:?}"
    );
    shutdown.cancel();
}

#[tokio::test]
async fn prefill_cost_is_fitted_from_the_engines_measured_prefills() {
    // The prefill engine is about 5x slower than the conductor's prior (the 70B default): 1.18
    // s for 2,000 tokens instead of 0.244 s. At a time scale of 0.1 that is 118 ms of wall
    // time, far above the HTTP overhead of the call.
    const SCALE: f64 = 0.1;
    let truth = PrefillCost {
        fixed_s: 0.1,
        linear_s: 5e-4,
        quadratic_s: 2e-8,
    };
    let shutdown = CancellationToken::new();
    let config = EngineConfig {
        prefill_cost: truth,
        time_scale: SCALE,
        ..serve_support::engine_config(MODEL, BLOCK)
    };
    let (p0, _) = serve_support::start_engine(config, &shutdown).await;
    // The decode engine stays fast (its own prefill of the prompt is not measured).
    let (d0, _) = engine(&shutdown).await;
    let prefill_url = format!("http://{p0}");
    let mut config = conductor_config(vec![prefill_url.clone()], format!("http://{d0}"));
    config.scheduler.slo.ttft_s = 1e6;
    config.time_scale = SCALE;
    config.fit_prefill_cost = true;
    let (conductor, metrics) = start_conductor(config, &shutdown).await;
    let status = || async {
        let (code, body) = serve_support::http(conductor, "GET", "/v1/kvpool/status", "").await;
        assert_eq!(code, 200, "{body}");
        let v: Value = serde_json::from_str(&body).expect("status json");
        v
    };
    let before = status().await;
    assert_eq!(before["engines"]["prefill"][0], prefill_url.as_str());
    assert_eq!(before["prefill_costs"][0]["source"], "prior");
    assert_eq!(before["prefill_costs"][0]["observations"], 0);
    let prior_2000 = PrefillCost::default().seconds(0, 2_000);
    assert!(
        (before["prefill_costs"][0]["seconds_2000_tokens"]
            .as_f64()
            .expect("seconds")
            - prior_2000)
            .abs()
            < 1e-9
    );
    // Distinct prompts (their first block differs) of 8 sizes, one at a time: the engine is
    // idle for each, nothing is cached.
    let sizes = [200usize, 600, 1_000, 1_500, 2_000, 2_500, 3_000, 4_000];
    let mut sent = 0;
    for round in 0..2 {
        for (j, &n) in sizes.iter().enumerate() {
            let prompt = format!("{round}{j:03}{}", "x".repeat(4 * n - 4));
            let body = format!(r#"{{"model":"{MODEL}","prompt":"{prompt}","max_tokens":1}}"#);
            let (code, _, text) = post(conductor, "/v1/completions", &body).await;
            assert_eq!(code, 200, "{text}");
            sent += 1;
        }
    }
    let after = status().await;
    let row = &after["prefill_costs"][0];
    assert_eq!(row["source"], "fitted", "{after}");
    assert_eq!(row["observations"], sent, "{after}");
    let want = truth.seconds(0, 2_000);
    let got = row["seconds_2000_tokens"].as_f64().expect("seconds");
    assert!(
        (got - want).abs() < 0.3 * want,
        "predicted {got} s for 2,000 tokens, the engine takes {want} s: {after}"
    );
    for term in ["fixed_s", "linear_s", "quadratic_s"] {
        let v = row["cost"][term].as_f64().expect("term");
        assert!(v.is_finite() && v >= 0.0, "{term}: {after}");
    }
    // The same in /metrics: the prior and the fit, and the observations counted.
    let text = prometheus::TextEncoder::new()
        .encode_to_string(&metrics.gather())
        .expect("encode");
    assert_eq!(
        labelled(
            &metrics,
            "kvpool_conductor_prefill_cost_observations_total",
            "engine",
            &prefill_url
        ),
        sent as f64
    );
    let gauge = |source: &str, term: &str| {
        kvpool_harness::scrape::metric_value(
            &text,
            "kvpool_conductor_prefill_cost_seconds",
            &[&format!("source=\"{source}\""), &format!("term=\"{term}\"")],
        )
        .unwrap_or_else(|| panic!("no {source} {term} gauge in\n{text}"))
    };
    assert_eq!(gauge("prior", "linear"), PrefillCost::default().linear_s);
    let fitted = PrefillCost {
        fixed_s: gauge("fitted", "fixed"),
        linear_s: gauge("fitted", "linear"),
        quadratic_s: gauge("fitted", "quadratic"),
    };
    assert!((fitted.seconds(0, 2_000) - got).abs() < 1e-9 * got.max(1.0));
    // The placements use the fit: the TTFT estimate of a fresh 2,000-token prompt follows it.
    let prompt = format!("z{}", "x".repeat(4 * 2_000 - 1));
    let body = format!(r#"{{"model":"{MODEL}","prompt":"{prompt}","max_tokens":1}}"#);
    let (code, head, text) = post(conductor, "/v1/completions", &body).await;
    assert_eq!(code, 200, "{text}");
    let ttft_ms: f64 = header(&head, "x-kvpool-ttft-estimate-ms")
        .expect("ttft header")
        .parse()
        .expect("number");
    // Less the hand-off to the (fast) decode engine, fitted from the same requests.
    let handoff = &status().await["handoff_cost"]["cost"];
    let handoff_s = handoff["fixed_s"].as_f64().expect("fixed")
        + 2_000.0 * handoff["per_token_s"].as_f64().expect("per token");
    assert!(
        (ttft_ms / 1e3 - handoff_s - want).abs() < 0.3 * want,
        "TTFT estimate {ttft_ms} ms with a {handoff_s} s hand-off, the engine takes {want} s"
    );
    shutdown.cancel();
}

#[tokio::test]
async fn the_hand_off_to_decode_is_fitted_and_counted_in_the_ttft_estimate() {
    // The decode engine's first step takes 0.5 s of model time (50 ms of wall time at 0.1):
    // every request's first token comes at least that long after its prefill answered.
    const SCALE: f64 = 0.1;
    let shutdown = CancellationToken::new();
    let (p0, _) = engine(&shutdown).await;
    let config = EngineConfig {
        decode_cost: kvpool_core::sched::DecodeCost {
            fixed_s: 0.5,
            per_seq_s: 0.0,
            per_ctx_token_s: 0.0,
        },
        time_scale: SCALE,
        ..serve_support::engine_config(MODEL, BLOCK)
    };
    let (d0, _) = serve_support::start_engine(config, &shutdown).await;
    let mut config = conductor_config(vec![format!("http://{p0}")], format!("http://{d0}"));
    config.scheduler.slo.ttft_s = 1e6;
    config.time_scale = SCALE;
    let (conductor, metrics) = start_conductor(config, &shutdown).await;
    let status = || async {
        let (code, body) = serve_support::http(conductor, "GET", "/v1/kvpool/status", "").await;
        assert_eq!(code, 200, "{body}");
        serde_json::from_str::<Value>(&body).expect("status json")
    };
    assert_eq!(status().await["handoff_cost"]["source"], "prior");
    let estimate = |head: &HeaderMap| -> f64 {
        header(head, "x-kvpool-ttft-estimate-ms")
            .expect("ttft header")
            .parse()
            .expect("number")
    };
    // Before the fit the estimate is the prefill side alone (well under the 0.5 s hand-off).
    let mut first_estimate = None;
    for i in 0..10 {
        // 100 to 190 tokens of 4 bytes.
        let prompt = format!("{i:03}{}", "x".repeat(4 * (100 + 10 * i) - 3));
        let body = format!(r#"{{"model":"{MODEL}","prompt":"{prompt}","max_tokens":1}}"#);
        let (code, head, text) = post(conductor, "/v1/completions", &body).await;
        assert_eq!(code, 200, "{text}");
        first_estimate.get_or_insert(estimate(&head));
    }
    let first_estimate = first_estimate.expect("an estimate");
    assert!(first_estimate < 400.0, "{first_estimate} ms before the fit");
    let after = status().await;
    let h = &after["handoff_cost"];
    assert_eq!(h["source"], "fitted", "{after}");
    assert_eq!(h["observations"], 10, "{after}");
    let at_150 = h["cost"]["fixed_s"].as_f64().expect("fixed")
        + 150.0 * h["cost"]["per_token_s"].as_f64().expect("per token");
    assert!(
        (0.5..1.5).contains(&at_150),
        "a 150-token hand-off predicted at {at_150} s, the engine takes 0.5 s and more: {after}"
    );
    // The next placement counts it.
    let prompt = format!("zz{}", "x".repeat(4 * 150 - 2));
    let body = format!(r#"{{"model":"{MODEL}","prompt":"{prompt}","max_tokens":1}}"#);
    let (code, head, text) = post(conductor, "/v1/completions", &body).await;
    assert_eq!(code, 200, "{text}");
    assert!(
        estimate(&head) >= first_estimate + 450.0,
        "estimate {} ms after the fit, {first_estimate} ms before",
        estimate(&head)
    );
    let text = prometheus::TextEncoder::new()
        .encode_to_string(&metrics.gather())
        .expect("encode");
    let fixed = kvpool_harness::scrape::metric_value(
        &text,
        "kvpool_conductor_handoff_cost_seconds",
        &["source=\"fitted\"", "term=\"fixed\""],
    )
    .unwrap_or_else(|| panic!("no fitted hand-off gauge in\n{text}"));
    assert!(fixed >= 0.0 && fixed.is_finite());
    shutdown.cancel();
}

#[tokio::test]
async fn decode_progress_is_counted_from_the_stream_before_it_ends() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let shutdown = CancellationToken::new();
    let (p0, _) = engine(&shutdown).await;
    // A decode engine at real time: 15 ms per token, 1.5 s for the 100 asked.
    let config = EngineConfig {
        time_scale: 1.0,
        ..serve_support::engine_config(MODEL, BLOCK)
    };
    let (d0, _) = serve_support::start_engine(config, &shutdown).await;
    let decode_url = format!("http://{d0}");
    let mut config = conductor_config(vec![format!("http://{p0}")], decode_url.clone());
    config.scheduler.slo.ttft_s = 1e6;
    let (conductor, metrics) = start_conductor(config, &shutdown).await;
    let observed = || {
        labelled(
            &metrics,
            "kvpool_conductor_decode_tokens_observed_total",
            "engine",
            &decode_url,
        )
    };
    let decode_load = || async {
        let (code, body) = serve_support::http(conductor, "GET", "/v1/kvpool/status", "").await;
        assert_eq!(code, 200, "{body}");
        let v: Value = serde_json::from_str(&body).expect("status json");
        v["decode_load"][0].clone()
    };
    let body = format!(
        r#"{{"model":"{MODEL}","prompt":"{}","max_tokens":100,"stream":true}}"#,
        "q".repeat(64)
    );
    let mut s = tokio::net::TcpStream::connect(conductor)
        .await
        .expect("connect");
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).await.expect("send");
    // A slow client: read only until three tokens came.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&got).matches("data: {").count() < 3 {
        let n = s.read(&mut buf).await.expect("read");
        assert!(
            n > 0,
            "stream ended early: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    let seen = observed();
    assert!(
        (3.0..100.0).contains(&seen),
        "observed {seen} tokens mid-stream"
    );
    let load = decode_load().await;
    assert_eq!(load["requests"], 1, "{load}");
    let remaining = load["remaining_tokens"].as_u64().expect("remaining");
    assert!(
        (1..=97).contains(&remaining),
        "{remaining} tokens left after {seen} seen: {load}"
    );
    // Read the rest: every token counted, and the request leaves decode.
    s.read_to_end(&mut got).await.expect("read to end");
    let text = String::from_utf8_lossy(&got);
    assert!(text.contains("data: [DONE]"), "{text}");
    assert_eq!(observed(), 100.0);
    let mut left = decode_load().await;
    for _ in 0..200 {
        if left["requests"] == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        left = decode_load().await;
    }
    assert_eq!(left["requests"], 0, "{left}");
    // A whole (non-streamed) response counts its usage.
    let (code, _, text) = post(
        conductor,
        "/v1/completions",
        &format!(r#"{{"model":"{MODEL}","prompt":"short","max_tokens":2}}"#),
    )
    .await;
    assert_eq!(code, 200, "{text}");
    assert_eq!(observed(), 102.0);
    shutdown.cancel();
}

/// Issue 15: the conductor's idle pooled connections to an engine expire after
/// `upstream.idle_timeout`; the engine (idle timeout 60 s) is not the one closing them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_upstream_connections_expire() {
    use kvpool_runtime::http::{HttpLimits, HttpStats};
    use std::time::{Duration, Instant};
    let shutdown = CancellationToken::new();
    let registry = Registry::new();
    let router = kvpool_synthetic::server::router_with_agent(
        serve_support::engine_config(MODEL, BLOCK),
        None,
        &registry,
    )
    .expect("router");
    let (l, engine) = listen().await;
    let stats = HttpStats::new("api").expect("stats");
    tokio::spawn(kvpool_synthetic::server::serve_with(
        l,
        router,
        shutdown.clone(),
        HttpLimits::default(),
        stats.clone(),
    ));
    let mut config = conductor_config(vec![format!("http://{engine}")], format!("http://{engine}"));
    config.upstream = kvpool_conductor::UpstreamPool {
        idle_timeout: Duration::from_millis(300),
        max_idle_per_host: 8,
    };
    let (conductor, _) = start_conductor(config, &shutdown).await;
    let ask = format!(r#"{{"model":"{MODEL}","prompt":"hello there","max_tokens":2}}"#);
    let (status, _, body) = post(conductor, "/v1/completions", &ask).await;
    assert_eq!(status, 200, "{body}");
    let answered = Instant::now();
    let mut peak = stats.open.get();
    while stats.open.get() > 0 && answered.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(10)).await;
        peak = peak.max(stats.open.get());
    }
    assert_eq!(stats.open.get(), 0, "pooled connections outlived 5 s");
    assert!(peak >= 1, "the conductor kept no connection to the engine");
    assert_eq!(stats.closed.with_label_values(&["idle"]).get(), 0);
    let (status, _, body) = post(conductor, "/v1/completions", &ask).await;
    assert_eq!(status, 200, "{body}");
    shutdown.cancel();
}

/// The load the operator autoscales the engine pools by (`GET /v1/kvpool/load`): every
/// admitted request's predicted TTFT (prefill) and TPOT (decode) in the window, the engines
/// routed to, and the rejections blamed on the role that caused them.
#[tokio::test]
async fn load_endpoint_reports_predictions_and_rejections_per_role() {
    use kvpool_core::autoscale::LoadReport;
    let load = |addr| async move {
        let (code, body) = serve_support::http(addr, "GET", "/v1/kvpool/load", "").await;
        assert_eq!(code, 200, "{body}");
        serde_json::from_str::<LoadReport>(&body).expect("load report")
    };
    let ask = |i: usize| {
        format!(
            r#"{{"model":"{MODEL}","prompt":"{i:03}{}","max_tokens":2}}"#,
            "p".repeat(200)
        )
    };

    let c = cluster(Rejection::Predicted, 30.0).await;
    let idle = load(c.conductor).await;
    assert_eq!(idle.prefill.figures.arrivals, 0);
    assert_eq!(idle.prefill.figures.predicted_p90_s, None);
    assert_eq!((idle.prefill.instances, idle.decode.instances), (2, 1));
    for i in 0..3 {
        let (status, _, body) = post(c.conductor, "/v1/completions", &ask(i)).await;
        assert_eq!(status, 200, "{body}");
    }
    let busy = load(c.conductor).await;
    assert_eq!(
        busy.window_s,
        kvpool_conductor::server::LOAD_WINDOW.as_secs_f64()
    );
    for role in [&busy.prefill, &busy.decode] {
        assert_eq!((role.figures.arrivals, role.figures.rejected), (3, 0));
        assert_eq!(role.figures.rejection_rate, Some(0.0));
        assert_eq!(role.figures.slo_attainment, Some(1.0));
        let p90 = role.figures.predicted_p90_s.expect("predictions");
        assert!(p90 > 0.0 && p90 < role.slo_s, "{p90}");
    }
    assert_eq!(busy.prefill.slo_s, 30.0);
    c.shutdown.cancel();

    // A TTFT objective no prefill meets: every request is refused, and prefill is to blame.
    let c = cluster(Rejection::Predicted, 1e-6).await;
    for i in 0..4 {
        let (status, _, body) = post(c.conductor, "/v1/completions", &ask(i)).await;
        assert_ne!(status, 200, "{body}");
    }
    let refused = load(c.conductor).await;
    assert_eq!(
        (
            refused.prefill.figures.arrivals,
            refused.prefill.figures.rejected
        ),
        (4, 4)
    );
    assert_eq!(refused.prefill.figures.rejection_rate, Some(1.0));
    assert_eq!(refused.prefill.figures.slo_attainment, Some(0.0));
    assert_eq!(refused.decode.figures.arrivals, 0);
    c.shutdown.cancel();
}

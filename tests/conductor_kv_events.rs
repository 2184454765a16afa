//! The conductor's index follows a prefill engine's own KV events: an independent publisher in
//! Python (tests/python/vllm_events.py, written from vLLM's documented wire format with pyzmq,
//! msgpack and cbor2) stores, removes and clears blocks in both event encodings, with integer
//! and byte hashes, a gap that its replay socket repairs, a gap it cannot repair and an engine
//! restart; the conductor's `/metrics` and its routing decisions (the `x-kvpool-local-blocks`
//! header of its placement) follow. I/O boundary: loopback sockets, the Python child process.

mod py_support;
mod serve_support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use kvpool_conductor::{ConductorConfig, KvEventSource};
use kvpool_core::sched::{BlockHashing, Rejection};
use prometheus::Registry;
use py_support::PyChild;
use serde_json::{Value, json};
use serve_support::{conductor_config, engine_config, exchange, header, labelled, listen};
use tokio_util::sync::CancellationToken;

const MODEL: &str = "events-model";
const BLOCK: u32 = 4;

/// The Python publisher (one JSON command per line); its greeting names its ports.
fn endpoint(publisher: &PyChild, which: &str) -> String {
    format!("tcp://127.0.0.1:{}", publisher.greeting[which])
}

/// A word-level tokenizer: `wN` is token N, so the Python side knows the token ids.
fn tokenizer(dir: &Path) -> kvpool_conductor::tokenize::PromptTokenizer {
    let vocab: serde_json::Map<String, Value> = std::iter::once(("[UNK]".to_owned(), json!(0)))
        .chain((1..200).map(|i| (format!("w{i}"), json!(i))))
        .collect();
    let file = dir.join("tokenizer.json");
    let doc = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    std::fs::write(&file, doc.to_string()).expect("write tokenizer");
    kvpool_conductor::tokenize::PromptTokenizer::from_file(&file).expect("tokenizer")
}

fn prompt(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

async fn engine(shutdown: &CancellationToken) -> SocketAddr {
    serve_support::start_engine(engine_config(MODEL, BLOCK), shutdown)
        .await
        .0
}

/// The conductor over prefill engines `prefill` (the events of `source` follow one of them)
/// and `decode`: the shared test config with this test's tokenizer, vLLM block hashing and
/// 1 KiB of KV per token.
fn config(
    prefill: Vec<String>,
    decode: String,
    dir: &Path,
    source: KvEventSource,
) -> ConductorConfig {
    let mut c = conductor_config(MODEL, BLOCK, prefill, decode, Rejection::None, 30.0);
    c.scheduler.bytes_per_token = 1024;
    c.scheduler.hot.fanout = 0;
    c.tokenizer = tokenizer(dir);
    c.hashing = BlockHashing::vllm("0");
    c.kv_events = vec![source];
    c
}

/// KV events of `kind` the conductor applied.
fn events(registry: &Registry, kind: &str) -> f64 {
    labelled(registry, "kvpool_conductor_kv_events_total", "kind", kind)
}

/// Waits until `f` holds (the events travel asynchronously), failing with `what`.
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_and_routing_follow_an_engines_kv_events() {
    let shutdown = CancellationToken::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b, d) = (
        engine(&shutdown).await,
        engine(&shutdown).await,
        engine(&shutdown).await,
    );
    let (url_a, url_b) = (format!("http://{a}"), format!("http://{b}"));
    let mut publisher = PyChild::start("vllm_events.py", &[]);
    let source = KvEventSource {
        engine: url_b.clone(),
        endpoint: endpoint(&publisher, "pub"),
        replay: Some(endpoint(&publisher, "replay")),
    };
    let registry = Registry::new();
    let conductor = kvpool_conductor::server::conductor(
        config(
            vec![url_a.clone(), url_b.clone()],
            format!("http://{d}"),
            dir.path(),
            source,
        ),
        &registry,
    )
    .expect("conductor");
    conductor.engines.follow_kv_events(&shutdown);
    let (l, addr) = listen().await;
    tokio::spawn(kvpool_conductor::server::serve(
        l,
        conductor.router,
        shutdown.clone(),
    ));

    let applied = |r: &Registry| {
        labelled(
            r,
            "kvpool_conductor_kv_event_batches_total",
            "result",
            "applied",
        )
    };
    let held = |r: &Registry| {
        labelled(
            r,
            "kvpool_conductor_engine_cached_blocks",
            "source",
            "events",
        )
    };
    // ZMQ drops what is published before the subscription lands: probe until one arrives.
    let deadline = Instant::now() + Duration::from_secs(10);
    while applied(&registry) < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the conductor never received a KV event batch"
        );
        publisher.send(json!({"op": "probe"}));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Engine B stores the 3 full blocks of a 13-token prompt (array encoding, integer hashes).
    let p: Vec<u32> = (1..=13).collect();
    let stored = publisher.send(json!({"op": "store", "tokens": p, "block_size": BLOCK}));
    assert_eq!(stored["hashes"].as_array().map(Vec::len), Some(3));
    until("engine B holds 3 blocks", || held(&registry) == 3.0).await;
    assert!(events(&registry, "stored") >= 3.0);
    // The conductor sends the prompt to B, which holds its prefix.
    let body = json!({"model": MODEL, "prompt": prompt(&p), "max_tokens": 2}).to_string();
    let (status, head, text) = exchange(addr, "POST", "/v1/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        header(&head, "x-kvpool-local-blocks"),
        Some("3"),
        "{head:?}"
    );
    // B is indexed from its events, so no routing guess is kept (or exported) for it.
    assert_eq!(
        labelled(
            &registry,
            "kvpool_conductor_engine_cached_blocks",
            "engine",
            &url_b
        ),
        3.0
    );

    // Removal in the map encoding with raw byte hashes: nothing is left, and a prompt of the
    // same prefix no longer finds it.
    publisher.send(json!({"op": "remove", "tokens": p, "block_size": BLOCK,
                          "encoding": "map", "hash_form": "bytes"}));
    until("engine B holds nothing", || held(&registry) == 0.0).await;
    let q: Vec<u32> = (1..=12).chain([150, 151, 152, 153]).collect();
    let body = json!({"model": MODEL, "prompt": prompt(&q), "max_tokens": 2}).to_string();
    let (_, head, _) = exchange(addr, "POST", "/v1/completions", &body).await;
    assert_ne!(
        header(&head, "x-kvpool-local-blocks"),
        Some("3"),
        "{head:?}"
    );

    // A batch missed on the live stream comes back through the replay socket.
    let other: Vec<u32> = (100..108).collect();
    publisher.send(json!({"op": "store", "tokens": p, "block_size": BLOCK}));
    publisher.send(json!({"op": "skip", "tokens": other, "block_size": BLOCK}));
    publisher.send(json!({"op": "probe"}));
    let gaps = |r: &Registry, how: &str| {
        labelled(r, "kvpool_conductor_kv_event_gaps_total", "recovery", how)
    };
    until("the gap is replayed", || gaps(&registry, "replayed") == 1.0).await;
    until("engine B holds 3 + 2 blocks", || held(&registry) == 5.0).await;

    // A batch lost for good: the engine's entries are dropped rather than trusted.
    publisher.send(json!({"op": "drop"}));
    publisher.send(json!({"op": "probe"}));
    until("the lost batch clears B", || {
        gaps(&registry, "cleared") == 1.0
    })
    .await;
    until("engine B holds nothing after the loss", || {
        held(&registry) == 0.0
    })
    .await;

    // The engine restarts (its sequence starts again): old entries go, new ones count.
    publisher.send(json!({"op": "store", "tokens": p, "block_size": BLOCK}));
    until("engine B holds 3 blocks again", || held(&registry) == 3.0).await;
    publisher.send(json!({"op": "restart"}));
    publisher.send(json!({"op": "store", "tokens": other, "block_size": BLOCK}));
    until("the restart is seen", || gaps(&registry, "restart") == 1.0).await;
    until("engine B holds the 2 new blocks only", || {
        held(&registry) == 2.0
    })
    .await;

    // AllBlocksCleared empties it.
    publisher.send(json!({"op": "clear"}));
    until("engine B is cleared", || held(&registry) == 0.0).await;
    assert!(events(&registry, "cleared") >= 1.0);
    shutdown.cancel();
}

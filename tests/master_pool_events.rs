//! The master publishes the pool's own block events in vLLM's KV event format: a real
//! `kvpool master` with `--kv-events-config` and a real `kvpool agent run` (DRAM and SSD
//! tiers) on 127.0.0.1, and an independent consumer in Python
//! (tests/python/pool_events_consumer.py, written from vLLM's documented wire format with pyzmq
//! and msgpack). The test puts and removes objects through the pool client; the consumer's
//! report must show one `BlockStored` per object with the medium of its tier (`cpu`, `disk`),
//! the engine's integer hash for block keys and the key's bytes for others, one `BlockRemoved`
//! per removal, and contiguous sequence numbers; a late consumer asking the replay socket from
//! sequence 0 gets the start-up `AllBlocksCleared` and every batch it missed. I/O boundary:
//! child processes, loopback sockets, temp dirs.

mod pool_support;
mod py_support;

use std::collections::BTreeSet;
use std::time::Duration;

use kvpool_core::master::{PutOptions, Tier};
use kvpool_harness::{Launcher, MasterSpec, free_port};
use pool_support::*;
use py_support::PyChild;
use serde_json::{Value, json};

const TOPIC: &str = "kvpool";

/// The Python consumer (one JSON command per line), ready once subscribed.
fn consumer(publish: u16, replay: u16) -> PyChild {
    let c = PyChild::start(
        "pool_events_consumer.py",
        &[
            format!("tcp://127.0.0.1:{publish}"),
            format!("tcp://127.0.0.1:{replay}"),
            TOPIC.to_owned(),
        ],
    );
    assert_eq!(c.greeting["ready"], true, "{}", c.greeting);
    c
}

/// The hash as the consumer reports it: a number, or `{"bytes": hex}`.
fn int(v: u64) -> Value {
    json!(v)
}

fn bytes(b: &[u8]) -> Value {
    json!({ "bytes": b.iter().map(|x| format!("{x:02x}")).collect::<String>() })
}

/// (kind, hash, medium) of every block of `batches`, in order.
fn blocks(batches: &[Value]) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for b in batches {
        for e in b["events"].as_array().expect("events") {
            let kind = e["type"].as_str().expect("type").to_owned();
            let medium = e["medium"].as_str().unwrap_or("").to_owned();
            for h in e["hashes"].as_array().expect("hashes") {
                out.push((kind.clone(), h.to_string(), medium.clone()));
            }
        }
    }
    out
}

fn seqs(batches: &[Value]) -> Vec<u64> {
    batches
        .iter()
        .map(|b| b["seq"].as_u64().expect("seq"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_master_publishes_the_pool_s_blocks_in_vllm_s_format() {
    let dir = tempfile::tempdir().expect("tempdir");
    let logs = dir.path();
    let key_file = write_key(logs, KEY);
    let (publish, replay) = (free_port().expect("port"), free_port().expect("port"));
    let config = json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": format!("tcp://127.0.0.1:{publish}"),
        "replay_endpoint": format!("tcp://127.0.0.1:{replay}"),
        "topic": TOPIC,
        "buffer_steps": 1000,
    });
    let m = MasterSpec::new(KVPOOL, &key_file)
        .expect("ports")
        .args([
            "--heartbeat-timeout".to_owned(),
            "5s".to_owned(),
            "--tick-interval".to_owned(),
            "100ms".to_owned(),
            "--kv-events-config".to_owned(),
            config.to_string(),
            "--kv-events-block-size".to_owned(),
            "16".to_owned(),
        ])
        .start(&Launcher::new(logs), "master", DEADLINE)
        .expect("kvpool master");
    let (mut master, grpc, admin) = (m.process, m.grpc, m.admin);
    let (_ssd, ssd) = ssd_tier(logs);
    let (mut agent, _addrs) = start_agent_with(logs, "agent-a", grpc, &key_file, "8MiB", &ssd);
    let client = master_client(grpc, KEY);
    wait_stats(
        &client,
        "the agent's DRAM and SSD segments mounted",
        &mut [&mut master, &mut agent],
        |s| s.nodes_alive == 1 && s.segments == 2,
    )
    .await;

    let mut live = consumer(publish, replay);
    // A SUB socket receives only after its subscription reached the publisher.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let pool = pool_client(grpc, KEY, "test-client", |_| {});
    let on = |tier| PutOptions {
        tier: Some(tier),
        ..PutOptions::default()
    };
    let dram: Vec<u64> = vec![0x1111, 0xdead_beef_0000_0001, 3];
    let ssd_blocks: Vec<u64> = vec![0xffff_ffff_ffff_fff0, 5];
    let plain = b"plain/object-key".to_vec();
    for (i, h) in dram.iter().enumerate() {
        let key = kvpool_core::sched::pool_key("m", *h);
        pool.put(&key, &vec![i as u8; 5000], &on(Tier::Dram))
            .await
            .expect("put DRAM");
    }
    for h in &ssd_blocks {
        let key = kvpool_core::sched::pool_key("m", *h);
        pool.put(&key, &vec![7u8; 9000], &on(Tier::Ssd))
            .await
            .expect("put SSD");
    }
    pool.put(&plain, b"value", &on(Tier::Dram))
        .await
        .expect("put plain");
    // A second put of a committed key publishes nothing new.
    pool.put(
        &kvpool_core::sched::pool_key("m", dram[0]),
        &[0u8; 5000],
        &on(Tier::Dram),
    )
    .await
    .expect("put again");
    for key in [
        kvpool_core::sched::pool_key("m", dram[1]),
        kvpool_core::sched::pool_key("m", ssd_blocks[1]),
        plain.clone(),
    ] {
        client.remove(&key).await.expect("remove");
    }

    let seen = live.send(json!({
        "op": "collect", "stored": 6, "removed": 3, "timeout_ms": 60_000, "settle_ms": 1000,
    }));
    let batches = seen["batches"].as_array().expect("batches").clone();
    let got = blocks(&batches);
    let s =
        |kind: &str, h: Value, medium: &str| (kind.to_owned(), h.to_string(), medium.to_owned());
    let mut want: Vec<_> = dram
        .iter()
        .map(|h| s("BlockStored", int(*h), "cpu"))
        .chain(ssd_blocks.iter().map(|h| s("BlockStored", int(*h), "disk")))
        .chain([s("BlockStored", bytes(&plain), "cpu")])
        .collect();
    want.extend([
        s("BlockRemoved", int(dram[1]), "cpu"),
        s("BlockRemoved", int(ssd_blocks[1]), "disk"),
        s("BlockRemoved", bytes(&plain), "cpu"),
    ]);
    assert_eq!(got, want, "the consumer saw {seen}");
    for b in &batches {
        for e in b["events"].as_array().expect("events") {
            if e["type"] == "BlockStored" {
                assert_eq!(e["block_size"], 16, "{e}");
                assert_eq!(e["parent"], Value::Null, "{e}");
                assert_eq!(e["token_ids"], json!([]), "{e}");
                assert_eq!(e["lora_id"], Value::Null, "{e}");
            }
        }
        assert_eq!(b["rank"], Value::Null);
        assert!(b["ts"].as_f64().is_some_and(|t| t > 1.0e9), "{b}");
    }
    let live_seqs = seqs(&batches);
    let first = live_seqs[0];
    assert!(
        first >= 1,
        "sequence 0 is the start-up snapshot, before the consumer came"
    );
    assert_eq!(
        live_seqs,
        (first..first + live_seqs.len() as u64).collect::<Vec<_>>(),
        "contiguous sequence numbers"
    );

    // A consumer that joins late asks the replay socket for everything from sequence 0.
    let mut late = consumer(publish, replay);
    let replayed = late.send(json!({"op": "replay", "start": 0, "timeout_ms": 30_000}));
    assert_eq!(replayed["ended"], true, "{replayed}");
    let old = replayed["batches"].as_array().expect("batches").clone();
    let last = *live_seqs.last().expect("seq");
    assert_eq!(seqs(&old), (0..=last).collect::<Vec<_>>(), "{replayed}");
    assert_eq!(
        old[0]["events"],
        json!([{"type": "AllBlocksCleared", "hashes": [], "medium": null, "parent": null,
                "token_ids": null, "block_size": null, "lora_id": null}]),
        "the publisher starts with a snapshot (an empty pool)"
    );
    let tail: Vec<Value> = old
        .iter()
        .filter(|b| b["seq"].as_u64().is_some_and(|q| q >= first))
        .map(|b| b["events"].clone())
        .collect();
    let live_events: Vec<Value> = batches.iter().map(|b| b["events"].clone()).collect();
    assert_eq!(tail, live_events, "replayed batches equal the live ones");
    let mut keys = BTreeSet::new();
    for (kind, hash, medium) in blocks(&old) {
        keys.insert((kind, hash, medium));
    }
    assert_eq!(
        keys.len(),
        want.len(),
        "nothing published before the consumer came"
    );

    // The master counts what it published.
    let metrics = http_get(admin, "/metrics").await.expect("metrics").1;
    assert!(
        metric(&metrics, "kvpool_master_kv_event_batches_total", &[])
            .is_some_and(|v| v >= (last + 1) as f64),
        "{metrics}"
    );
    assert_eq!(
        metric(
            &metrics,
            "kvpool_master_kv_events_total",
            &["kind=\"block_removed\""]
        ),
        Some(3.0)
    );
    assert_eq!(
        metric(&metrics, "kvpool_master_kv_event_resyncs_total", &[]),
        Some(1.0)
    );
}

//! A real pool across processes on 127.0.0.1: one `kvpool master` and two or three
//! `kvpool agent run` processes in pool mode (shared key file, random ports, temp dirs).
//! - `values_survive_the_death_of_one_replica_holder`: the test, as a client with its own
//!   transfer engine, puts values with two replicas (master allocates, the engine WRITEs to
//!   both agents, master commits), reads them back (master locates, the engine READs) and
//!   checks every byte; then SIGKILLs one agent and, once the master has declared it dead,
//!   reads every value again from the survivor. Finally SIGTERM on the survivor must unmount
//!   its segment.
//! - `engine_puts_land_in_the_agents_dram_tier`: an engine put through one agent's Unix socket
//!   is allocated by the master in that agent's DRAM-tier segment and read byte-exact by an
//!   engine of the other agent; exists/remove go through the pool; `/readyz` and `/metrics`
//!   reflect the pool membership and the transfer engine.
//! - `a_surviving_agent_repairs_lost_replicas`: three agents, values put with two replicas
//!   through an agent; one holder is SIGKILLed; the master's repair tasks are executed by the
//!   third agent, the objects have two replicas again and read back byte-exact from the new
//!   copies (through the repairing agent, which reads its own segment).
//! - `dram_eviction_demotes_to_the_agents_ssd_segment`: a small DRAM tier overflows; the
//!   master's demotion tasks are executed by the agent into its SSD segment and every value
//!   still reads back byte-exact through the engine API.
//!
//! Every process is this build's `kvpool` binary with its role (`CARGO_BIN_EXE_kvpool`), started
//! through `pool_support` and `kvpool_harness`, logging into the test's directory.

mod pool_support;

use std::time::{Duration, Instant};

use kvpool_agent::api::client::{EngineClient, GetOutcome};
use kvpool_agent::proto::Status;
use kvpool_client::pool::PoolClient;
use kvpool_core::master::{PutOptions, Tier};
use pool_support::*;

const OBJECTS: usize = 12;

fn value(i: usize) -> Vec<u8> {
    // Sizes from 1 byte to a few slices' worth, content distinct per object.
    let len = [1, 4095, 4096, 70_000, 300_000][i % 5] + i;
    (0..len)
        .map(|j| (j.wrapping_mul(31) ^ i.wrapping_mul(7)) as u8)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_survive_the_death_of_one_replica_holder() {
    let (dir, key_file, mut master, grpc, client) = test_pool("5s");
    let [mut a, mut b] = start_agents(dir.path(), grpc, &key_file, "8MiB");
    wait_mounted(&client, 2, &mut [&mut master, &mut a, &mut b]).await;

    let engine = client_engine("test-client", KEY, |_| {});
    let pool = PoolClient::new(client.clone(), engine, "test-client".into(), None);
    let opts = PutOptions {
        replicas: 2,
        ..PutOptions::default()
    };

    let keys = numbered_keys("block", OBJECTS);
    for (i, key) in keys.iter().enumerate() {
        let replicas = pool.put(key, &value(i), &opts).await.expect("put");
        let mut nodes: Vec<_> = replicas.iter().map(|r| r.node.clone()).collect();
        nodes.sort();
        assert_eq!(nodes, ["agent-a", "agent-b"], "one replica per agent");
        assert!(replicas.iter().all(|r| r.tier == Tier::Dram));
    }
    for (i, key) in keys.iter().enumerate() {
        let got = pool.get(key).await.expect("get");
        let want = value(i);
        assert_eq!(got.len(), want.len());
        assert_eq!(crc32c::crc32c(&got), crc32c::crc32c(&want), "object {i}");
        assert!(got == want, "object {i} differs");
    }

    // One replica holder dies without a word.
    a.signal(nix::sys::signal::Signal::SIGKILL).expect("signal");
    let _ = a.wait();
    wait_stats(
        &client,
        "the master to declare agent-a dead",
        &mut [&mut master, &mut b],
        |s| s.nodes_alive == 1,
    )
    .await;
    for (i, key) in keys.iter().enumerate() {
        let nodes = replica_nodes(&client, key)
            .await
            .expect("locate after death");
        assert!(
            nodes.iter().all(|n| n == "agent-b"),
            "object {i}: the dead node's replica is no longer handed out"
        );
        assert!(!nodes.is_empty(), "object {i} lost");
        let got = pool.get(key).await.expect("get from the survivor");
        let want = value(i);
        assert_eq!(crc32c::crc32c(&got), crc32c::crc32c(&want), "object {i}");
        assert!(got == want, "object {i} differs after the death of agent-a");
    }

    // A clean stop unmounts: the master is left with no segment.
    b.signal(nix::sys::signal::Signal::SIGTERM).expect("signal");
    let started = Instant::now();
    let status = loop {
        if let Some(s) = b.try_status().expect("wait") {
            break s;
        }
        assert!(started.elapsed() < DEADLINE, "agent-b ignored SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "agent-b exited with {status}");
    wait_stats(
        &client,
        "agent-b's segments unmounted",
        &mut [&mut master],
        |s| s.segments == 0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_puts_land_in_the_agents_dram_tier() {
    let (dir, key_file, mut master, grpc, client) = test_pool("5s");
    let logs = dir.path();
    let (mut a, addr_a) = start_agent(logs, "agent-a", grpc, &key_file, "8MiB");
    let (mut b, addr_b) = start_agent(logs, "agent-b", grpc, &key_file, "8MiB");
    wait_ready(&addr_a, &mut a);
    wait_ready(&addr_b, &mut b);
    wait_stats(
        &client,
        "both agents mounted",
        &mut [&mut master, &mut a, &mut b],
        |s| s.nodes_alive == 2 && s.segments == 2,
    )
    .await;
    let before = client.stats().await.expect("stats");
    assert_eq!(before.used_bytes.first().copied(), Some(0));
    assert_eq!(
        before.capacity_bytes.first().copied(),
        Some(16 << 20),
        "the master got exactly the two DRAM tiers"
    );

    let mut engine_a = engine(&addr_a, "engine-a").await;
    let mut engine_b = engine(&addr_b, "engine-b").await;
    let keys = numbered_keys("engine-block", 6);
    put_each(&mut engine_a, &keys, value).await;
    let after = client.stats().await.expect("stats");
    assert_eq!(after.objects, keys.len() as u64);
    let want_used: u64 = (0..keys.len())
        .map(|i| (value(i).len() as u64).div_ceil(4096) * 4096)
        .sum();
    assert_eq!(
        after.used_bytes.first().copied(),
        Some(want_used),
        "the master allocated every block in DRAM"
    );
    for key in &keys {
        let located = replicas(&client, key).await.expect("locate");
        let nodes: Vec<_> = located
            .iter()
            .map(|r| (r.node.as_str(), r.segment.as_str()))
            .collect();
        assert_eq!(
            nodes,
            [("agent-a", "dram0")],
            "one replica, in the writer's DRAM tier segment"
        );
    }
    // The other agent's engine reads them through its own agent (transfer from agent-a).
    for (i, key) in keys.iter().enumerate() {
        let got = engine_b.get(key).await.expect("get").expect("present");
        assert!(
            got == value(i),
            "object {i} differs when read through agent-b"
        );
    }
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    assert_eq!(
        engine_b.exists(&refs).await.expect("exists"),
        vec![true; keys.len()]
    );
    assert_eq!(engine_b.get(b"never-put").await.expect("get missing"), None);
    // One batch of 12 blocks each way: statuses come back in item order, each block at its
    // own staging offset, with a missing key and a too-small range among them.
    let batch_keys = numbered_keys("batch-block", 12);
    let slot = 320 * 1024u64;
    for (i, _) in batch_keys.iter().enumerate() {
        engine_a
            .staging()
            .write_from(i as u64 * slot, &value(i))
            .expect("stage");
    }
    let items: Vec<(&[u8], u64, u64)> = batch_keys
        .iter()
        .enumerate()
        .map(|(i, k)| (k.as_slice(), i as u64 * slot, value(i).len() as u64))
        .collect();
    assert_eq!(
        engine_a.put_batch(&items, None).await.expect("put batch"),
        vec![Status::Ok; batch_keys.len()]
    );
    let mut gets: Vec<(&[u8], u64, u64)> = batch_keys
        .iter()
        .enumerate()
        .map(|(i, k)| (k.as_slice(), i as u64 * slot, slot))
        .collect();
    gets.insert(3, (b"never-put".as_slice(), 0, 4096));
    gets.push((batch_keys[4].as_slice(), 0, 100));
    let out = engine_b.get_batch(&gets).await.expect("get batch");
    check_batch(&out, &engine_b, slot, "through agent-b");
    // The writer's own agent holds every replica: it serves the same batch with memory copies
    // from its DRAM tier in one step (staging cleared first, so stale bytes cannot pass).
    for (i, _) in batch_keys.iter().enumerate() {
        engine_a
            .staging()
            .write_from(i as u64 * slot, &vec![0u8; value(i).len()])
            .expect("clear staging");
    }
    let out = engine_a.get_batch(&gets).await.expect("local get batch");
    check_batch(&out, &engine_a, slot, "from agent-a's own tier");
    let batch_refs: Vec<&[u8]> = batch_keys.iter().map(Vec::as_slice).collect();
    assert_eq!(
        engine_a.remove(&batch_refs).await.expect("remove batch"),
        vec![true; batch_keys.len()]
    );

    // agent-a served the bytes as a transfer target; both show the pool in /metrics.
    let (code, text) = http_get(addr_a.admin, "/metrics").await.expect("metrics a");
    assert_eq!(code, 200);
    let served = metric(
        &text,
        "kvpool_transfer_served_bytes_total",
        &["op=\"read\""],
    );
    assert!(
        served.unwrap_or(0.0) > 0.0,
        "transfer-engine metrics are exported:\n{text}"
    );
    assert_eq!(
        metric(&text, "kvpool_agent_pool_mounted_segments", &[]),
        Some(1.0)
    );
    assert_eq!(
        metric(&text, "kvpool_agent_pool_rdma_fallback", &[]),
        Some(0.0)
    );
    // Removal through either agent removes from the pool.
    assert_eq!(
        engine_b.remove(&refs[..1]).await.expect("remove"),
        vec![true]
    );
    assert_eq!(
        engine_a.remove(&refs[..1]).await.expect("remove again"),
        vec![false]
    );
    assert_eq!(
        engine_a.exists(&refs[..2]).await.expect("exists"),
        vec![false, true]
    );
    assert_eq!(
        client.stats().await.expect("stats").objects,
        keys.len() as u64 - 1
    );

    // Readiness follows the membership: the master going away makes the agents unready.
    master
        .signal(nix::sys::signal::Signal::SIGKILL)
        .expect("signal");
    let started = Instant::now();
    loop {
        if let Some((503, _)) = http_get(addr_a.admin, "/readyz").await {
            break;
        }
        a.assert_running().expect("running");
        assert!(
            started.elapsed() < DEADLINE,
            "agent-a stayed ready without a master"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The outcomes of the get batch of `engine_puts_land_in_the_agents_dram_tier`'s 12 blocks (each at its own staging
/// slot) with a missing key at index 3 and a too-small range of block 4 at the end: statuses in
/// item order, and every block's bytes in `engine`'s staging area.
fn check_batch(out: &[GetOutcome], engine: &EngineClient, slot: u64, how: &str) {
    assert_eq!(out.len(), 14, "{how}");
    for (j, o) in out.iter().enumerate() {
        match j {
            3 => assert_eq!((o.status, o.length), (Status::NotFound, 0), "{how}"),
            13 => assert_eq!(
                (o.status, o.length),
                (Status::BufferTooSmall, value(4).len() as u64),
                "the block's size is reported ({how})"
            ),
            _ => {
                let i = if j < 3 { j } else { j - 1 };
                assert_eq!(
                    (o.status, o.length),
                    (Status::Ok, value(i).len() as u64),
                    "{how}"
                );
                let mut got = vec![0u8; value(i).len()];
                engine
                    .staging()
                    .read_into(i as u64 * slot, &mut got)
                    .expect("read staging");
                assert!(got == value(i), "batch item {i} differs ({how})");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_surviving_agent_repairs_lost_replicas() {
    let (dir, key_file, mut master, grpc, client) = test_pool("5s");
    let logs = dir.path();
    let extra = "  replicas: 2\n";
    let (mut a, addr_a) = start_agent_with(logs, "agent-a", grpc, &key_file, "8MiB", extra);
    let (b, addr_b) = start_agent_with(logs, "agent-b", grpc, &key_file, "8MiB", extra);
    let (c, addr_c) = start_agent_with(logs, "agent-c", grpc, &key_file, "8MiB", extra);
    let mut others = [(b, addr_b), (c, addr_c)];
    wait_ready(&addr_a, &mut a);
    for (p, addr) in &mut others {
        wait_ready(addr, p);
    }
    wait_stats(&client, "three agents mounted", &mut [&mut master], |s| {
        s.nodes_alive == 3 && s.segments == 3
    })
    .await;

    // Two replicas each, the first on the writer (agent-a), the second on b or c.
    let keys = numbered_keys("repair-block", 8);
    put_through(&addr_a, "engine-a", &keys, value).await;
    let mut on_b = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let nodes = replica_nodes(&client, key).await.expect("locate");
        assert_eq!(nodes.len(), 2, "object {i}: two replicas");
        assert_eq!(nodes[0], "agent-a", "object {i}: one on the writer");
        if nodes[1] == "agent-b" {
            on_b.push(i);
        }
    }
    // Kill the holder of the most second replicas, so the repair work lands on the other.
    let (victim, survivor) = if on_b.len() * 2 >= keys.len() {
        (0, 1)
    } else {
        (1, 0)
    };
    let victim_name = others[victim].0.name().to_owned();
    let survivor_name = others[survivor].0.name().to_owned();
    others[victim]
        .0
        .signal(nix::sys::signal::Signal::SIGKILL)
        .expect("signal");
    let _ = others[victim].0.wait();
    let lost: Vec<usize> = (0..keys.len())
        .filter(|i| on_b.contains(i) == (victim_name == "agent-b"))
        .collect();
    assert!(!lost.is_empty(), "the victim held some replicas");

    // The master declares it dead and asks the survivor to copy from agent-a.
    let started = Instant::now();
    'repaired: loop {
        others[survivor].0.assert_running().expect("running");
        master.assert_running().expect("running");
        assert!(started.elapsed() < DEADLINE, "replicas never repaired");
        tokio::time::sleep(Duration::from_millis(200)).await;
        for &i in &lost {
            let Ok(nodes) = replica_nodes(&client, &keys[i]).await else {
                continue 'repaired;
            };
            if nodes != ["agent-a".to_owned(), survivor_name.to_owned()] {
                continue 'repaired;
            }
        }
        break;
    }
    // Read through the repairing agent: its nearest replica is its own new copy.
    let mut engine_s = engine(&others[survivor].1, "engine-survivor").await;
    for (i, key) in keys.iter().enumerate() {
        let got = engine_s.get(key).await.expect("get").expect("present");
        assert!(got == value(i), "object {i} differs after the repair");
    }
    let (_, text) = http_get(others[survivor].1.admin, "/metrics")
        .await
        .expect("metrics");
    let repaired = metric(
        &text,
        "kvpool_agent_pool_tasks_total",
        &["kind=\"repair\"", "outcome=\"ok\""],
    )
    .unwrap_or(0.0);
    assert_eq!(
        repaired,
        lost.len() as f64,
        "one repair per lost replica:\n{text}"
    );
    // And now agent-a can go too: the new copies alone serve every value.
    a.signal(nix::sys::signal::Signal::SIGKILL).expect("signal");
    let _ = a.wait();
    for &i in &lost {
        let got = engine_s.get(&keys[i]).await.expect("get").expect("present");
        assert!(
            got == value(i),
            "object {i} differs with only the new copy left"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dram_eviction_demotes_to_the_agents_ssd_segment() {
    let (dir, key_file, mut master, grpc, client) = test_pool("5s");
    let (ssd_dir, _, mut a, addr_a) = start_ssd_agent(dir.path(), grpc, &key_file);
    let s = client.stats().await.expect("stats");
    assert_eq!(s.segments, 2, "DRAM and SSD segments mounted");
    assert_eq!(s.capacity_bytes, vec![1 << 20, 8 << 20]);

    // 16 blocks of 100 KiB: 1.6 MiB into 1 MiB of DRAM.
    let mut engine_a = engine(&addr_a, "engine-a").await;
    let block = |i: usize| -> Vec<u8> {
        (0..100 * 1024)
            .map(|j: usize| (j.wrapping_mul(13) ^ i.wrapping_mul(101)) as u8)
            .collect()
    };
    let keys = numbered_keys("demote-block", 16);
    put_each(&mut engine_a, &keys, block).await;
    // Demotions finish (no task left) with blocks on the SSD segment.
    wait_stats(&client, "demotions done", &mut [&mut master, &mut a], |s| {
        s.tasks == 0 && s.used_bytes.get(1).copied().unwrap_or(0) > 0
    })
    .await;
    let mut on_ssd = 0;
    for key in &keys {
        on_ssd += replicas(&client, key)
            .await
            .expect("locate")
            .iter()
            .filter(|r| r.tier == Tier::Ssd && r.segment == "ssd0")
            .count();
    }
    assert!(on_ssd > 0, "some blocks live on the SSD segment");
    for (i, key) in keys.iter().enumerate() {
        let got = engine_a.get(key).await.expect("get").expect("present");
        assert!(got == block(i), "object {i} differs after demotion");
    }
    let (_, text) = http_get(addr_a.admin, "/metrics").await.expect("metrics");
    assert!(
        metric(
            &text,
            "kvpool_agent_pool_tasks_total",
            &["kind=\"demote\"", "outcome=\"ok\""],
        )
        .unwrap_or(0.0)
            >= 1.0,
        "demotions executed by the agent:\n{text}"
    );
    assert!(ssd_dir.join("pool-ssd.dat").exists());
}

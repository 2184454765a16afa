//! Per-node figures in the master's `Stats` (what the operator turns into a KVCachePool's
//! `status.nodes`), across real processes on 127.0.0.1: a `kvpool master` and two
//! `kvpool agent run` processes in pool mode (see `pool_support`, over `kvpool_harness`).
//! - Engine puts through each agent land on its own node: the nodes' used bytes add up to the
//!   pool's per tier, and each node's NUMA rows add up to its own figures.
//! - Engine gets through agent-b of the blocks agent-a holds: every Get hit the master counts
//!   lands on agent-a's DRAM, none on agent-b, and the nodes' hits add up to the pool's Get
//!   hits; the master's `kvpool_master_node_get_hits_total` says the same.
//!
//! The operator's side (Stats of a real master turned into the patched `status.nodes`) is
//! tested in operator/tests/reconcile.rs (`status_carries_the_figures_of_a_real_master`): the
//! root tests may not depend on the operator.

mod pool_support;

use kvpool_proto::master::{NodeStats, StatsResponse};
use pool_support::*;

fn value(i: usize) -> Vec<u8> {
    let len = 4096 + 17 * i;
    (0..len).map(|j| (j.wrapping_mul(31) ^ i) as u8).collect()
}

fn node<'a>(s: &'a StatsResponse, name: &str) -> &'a NodeStats {
    s.nodes
        .iter()
        .find(|n| n.node == name)
        .unwrap_or_else(|| panic!("{name} in {s:?}"))
}

fn at(v: &[u64], i: usize) -> u64 {
    v.get(i).copied().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_split_use_and_get_hits_by_the_node_that_serves_them() {
    let (dir, key_file, m, client) = test_pool_with("5s", &[]);
    let (mut master, grpc, admin) = (m.process, m.grpc, m.admin);
    let logs = dir.path();
    let (mut a, a_addrs) = start_agent(logs, "agent-a", grpc, &key_file, "8MiB");
    let (mut b, b_addrs) = start_agent(logs, "agent-b", grpc, &key_file, "8MiB");
    wait_ready(&a_addrs, &mut a);
    wait_ready(&b_addrs, &mut b);
    wait_stats(&client, "two agents mounted", &mut [&mut master], |s| {
        s.nodes_alive == 2 && s.nodes.len() == 2
    })
    .await;

    // Four blocks written through agent-a, two through agent-b: each writer keeps its own.
    let (on_a, on_b) = (numbered_keys("a-block", 4), numbered_keys("b-block", 2));
    put_through(&a_addrs, "engine-a", &on_a, value).await;
    let mut engine_b = engine(&b_addrs, "engine-b").await;
    put_each(&mut engine_b, &on_b, |i| value(100 + i)).await;

    let before = client.stats().await.expect("stats");
    let names: Vec<&str> = before.nodes.iter().map(|n| n.node.as_str()).collect();
    assert_eq!(names, ["agent-a", "agent-b"], "sorted by node name");
    for t in 0..2 {
        let used: u64 = before.nodes.iter().map(|n| at(&n.used_bytes, t)).sum();
        let capacity: u64 = before.nodes.iter().map(|n| at(&n.capacity_bytes, t)).sum();
        assert_eq!(
            (used, capacity),
            (at(&before.used_bytes, t), at(&before.capacity_bytes, t)),
            "tier {t}: {before:?}"
        );
    }
    for n in &before.nodes {
        assert!(
            at(&n.used_bytes, 0) >= 4096,
            "{n:?} holds its writer's blocks"
        );
        assert_eq!(at(&n.capacity_bytes, 0), 8 << 20, "{n:?}");
        // The NUMA split is there, bound to a node or announced unbound, and adds up.
        assert!(!n.numa.is_empty(), "{n:?}");
        for t in 0..2 {
            let rows = n.numa.iter().filter(|r| r.tier == t as i32);
            let (u, c) = rows.fold((0, 0), |(u, c), r| (u + r.used_bytes, c + r.capacity_bytes));
            assert_eq!(
                (u, c),
                (at(&n.used_bytes, t), at(&n.capacity_bytes, t)),
                "{n:?}"
            );
        }
    }

    // agent-b reads agent-a's blocks: the master directs it to agent-a's DRAM replicas.
    for (i, key) in on_a.iter().enumerate() {
        let got = engine_b.get(key).await.expect("get").expect("present");
        assert!(got == value(i), "block {i} differs");
    }
    drop(engine_b);
    let after = client.stats().await.expect("stats");
    let hits = |s: &StatsResponse, name: &str, t: usize| at(&node(s, name).get_hits, t);
    let served = hits(&after, "agent-a", 0) - hits(&before, "agent-a", 0);
    assert!(served >= on_a.len() as u64, "{before:?}\n{after:?}");
    assert_eq!(
        served,
        after.get_hits - before.get_hits,
        "every Get hit on agent-a"
    );
    assert_eq!(hits(&after, "agent-b", 0), hits(&before, "agent-b", 0));
    let all: u64 = after.nodes.iter().flat_map(|n| n.get_hits.iter()).sum();
    assert_eq!(all, after.get_hits, "the nodes' hits add up to the pool's");

    // The metric follows at the next tick.
    let master_admin = AgentAddrs {
        admin,
        socket: Default::default(),
    };
    let expected = hits(&after, "agent-a", 0) as f64;
    wait_metric(
        &master_admin,
        &mut master,
        "kvpool_master_node_get_hits_total",
        &["node=\"agent-a\"", "tier=\"dram\""],
        |v| v == expected,
    )
    .await;
    let (_, text) = http_get(admin, "/metrics").await.expect("master metrics");
    assert_eq!(
        metric(
            &text,
            "kvpool_master_node_get_hits_total",
            &["node=\"agent-b\"", "tier=\"dram\""]
        ),
        Some(hits(&after, "agent-b", 0) as f64),
        "{text}"
    );
    for (name, p) in [("agent-a", &mut a), ("agent-b", &mut b)] {
        p.assert_running().unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

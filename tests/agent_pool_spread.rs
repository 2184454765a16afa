//! Replicas spread over failure domains, across real processes on 127.0.0.1: a `kvpool master`
//! with `--replica-spread failure-domain` (what the operator passes for a KVCachePool's
//! `replication.spreadLabelKey`) and four `kvpool agent run` processes in pool mode that
//! announce their failure domain (`pool.failure_domain`, the agent's `--failure-domain`): two
//! in `rack-1`, one in `rack-2`, one in `rack-3`.
//! - Engine puts through agent-a (rack-1) with two replicas: one copy on the writer, the other
//!   never on agent-b (its rack), although agent-b has the lowest segment id after agent-a and
//!   would be chosen under a node-only spread.
//! - A client's put with three replicas lands once in each rack.
//! - agent-c (rack-2) is SIGKILLed: its copies are repaired onto agent-d (rack-3), never onto
//!   agent-b, and read back byte-exact.

mod pool_support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvpool_client::pool::PoolClient;
use kvpool_core::master::PutOptions;
use pool_support::*;

const RACKS: [(&str, &str); 4] = [
    ("agent-a", "rack-1"),
    ("agent-b", "rack-1"),
    ("agent-c", "rack-2"),
    ("agent-d", "rack-3"),
];

fn rack(node: &str) -> &'static str {
    RACKS
        .iter()
        .find(|(n, _)| *n == node)
        .map(|(_, r)| *r)
        .unwrap_or_else(|| panic!("unknown node {node}"))
}

fn value(i: usize) -> Vec<u8> {
    let len = [1, 4096, 70_000][i % 3] + i;
    (0..len).map(|j| (j.wrapping_mul(13) ^ i) as u8).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_never_share_a_failure_domain() {
    let spread = ["--replica-spread", "failure-domain"];
    let (dir, key_file, m, client) = test_pool_with("5s", &spread);
    let (mut master, grpc) = (m.process, m.grpc);
    let logs = dir.path();
    let mut agents = BTreeMap::new();
    // One at a time, so the master mounts (and numbers) their segments in this order.
    for (name, rack) in RACKS {
        let extra = format!("  replicas: 2\n  failure_domain: {rack}\n");
        let (mut p, addrs) = start_agent_with(logs, name, grpc, &key_file, "8MiB", &extra);
        wait_ready(&addrs, &mut p);
        agents.insert(name, (p, addrs));
    }
    wait_stats(&client, "four agents mounted", &mut [&mut master], |s| {
        s.nodes_alive == 4 && s.segments == 4
    })
    .await;

    // Engine puts through agent-a: the writer keeps one copy, the other goes to another rack.
    let keys = numbered_keys("spread-block", 12);
    put_through(&agents["agent-a"].1, "engine-a", &keys, value).await;
    let mut on_c = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let nodes = replica_nodes(&client, key).await.expect("locate");
        assert_eq!(nodes.len(), 2, "object {i}: {nodes:?}");
        assert!(
            nodes.contains(&"agent-a".to_owned()),
            "object {i}: on the writer"
        );
        assert_ne!(rack(&nodes[0]), rack(&nodes[1]), "object {i}: {nodes:?}");
        if nodes.contains(&"agent-c".to_owned()) {
            on_c.push(i);
        }
    }

    // Three replicas from a client outside the pool: one per rack.
    let pool = PoolClient::new(
        client.clone(),
        client_engine("test-client", KEY, |_| {}),
        "test-client".into(),
        None,
    );
    let three = PutOptions {
        replicas: 3,
        ..PutOptions::default()
    };
    for i in 0..4 {
        let replicas = pool
            .put(format!("three-{i}").as_bytes(), &value(i), &three)
            .await
            .expect("put");
        let mut racks: Vec<&str> = replicas.iter().map(|r| rack(&r.node)).collect();
        racks.sort_unstable();
        assert_eq!(racks, ["rack-1", "rack-2", "rack-3"], "three-{i}");
    }

    // agent-c dies: its copies are repaired into rack-3 (agent-d), the only rack left that
    // does not hold the other copy. (Placement by free space alternates the second copies
    // between agent-c and agent-d.)
    assert!(!on_c.is_empty(), "no second copy landed on agent-c");
    let (mut c, _) = agents.remove("agent-c").expect("agent-c");
    c.signal(nix::sys::signal::Signal::SIGKILL).expect("signal");
    let _ = c.wait();
    let started = Instant::now();
    'repaired: loop {
        master.assert_running().expect("master running");
        assert!(
            started.elapsed() < DEADLINE,
            "copies on agent-c never repaired"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        for &i in &on_c {
            let Ok(nodes) = replica_nodes(&client, &keys[i]).await else {
                continue 'repaired;
            };
            // Until the master declares agent-c dead its copy is still listed.
            if nodes.len() < 2 || nodes.iter().any(|n| n == "agent-c") {
                continue 'repaired;
            }
            assert_eq!(
                nodes,
                ["agent-a", "agent-d"],
                "object {i} repaired in rack-3"
            );
        }
        break;
    }
    // Read back through agent-d, which holds the repaired copies.
    let mut engine_d = engine(&agents["agent-d"].1, "engine-d").await;
    for &i in &on_c {
        let got = engine_d.get(&keys[i]).await.expect("get").expect("present");
        assert!(got == value(i), "object {i} differs after the repair");
    }
    for (name, (p, _)) in &mut agents {
        p.assert_running().unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

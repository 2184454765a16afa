//! The transfer engine's transport state travels from a real `kvpool agent run` to a real
//! `kvpool master` with the heartbeat and comes back in `Stats` (what the operator turns into
//! the KVCachePool's `TransportDegraded` condition):
//! - an agent configured with `pool.transport: rdma` on a host without a usable RDMA device (or
//!   a build without feature `rdma`) is reported as fallen back, with the reason, and its
//!   `kvpool_agent_pool_rdma_fallback` gauge is 1, and it is not ready (RDMA only); on a host
//!   with a device it is reported on RDMA with its devices instead, and ready;
//! - an agent with `pool.transport: tcp` reports RDMA not requested and no fallback.
//!
//! Both run as child processes on 127.0.0.1 with temp dirs (see `pool_support`, over
//! `kvpool_harness`).

mod pool_support;

use kvpool_proto::master::NodeTransport;
use pool_support::*;

fn find<'a>(t: &'a [NodeTransport], node: &str) -> Option<&'a NodeTransport> {
    t.iter().find(|n| n.node == node)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_report_their_transport_and_the_master_returns_it_in_stats() {
    let (dir, key_file, mut master, grpc, client) = test_pool("5s");
    let logs = dir.path();
    let (mut rdma, rdma_addrs) = start_agent_with(
        logs,
        "agent-rdma",
        grpc,
        &key_file,
        "8MiB",
        "  transport: rdma\n",
    );
    let (mut tcp, tcp_addrs) = start_agent_with(
        logs,
        "agent-tcp",
        grpc,
        &key_file,
        "8MiB",
        "  transport: tcp\n",
    );
    // `transport: rdma` is RDMA only: ready where a device exists; on a host without one the
    // agent joins the pool over TCP (it heartbeats below) but never reports ready.
    let has_device = kvpool_transfer::rdma::transport_available();
    if has_device {
        wait_ready(&rdma_addrs, &mut rdma);
    }
    wait_ready(&tcp_addrs, &mut tcp);

    wait_stats(
        &client,
        "both agents' transport reports",
        &mut [&mut master, &mut rdma, &mut tcp],
        |s| find(&s.transport, "agent-rdma").is_some() && find(&s.transport, "agent-tcp").is_some(),
    )
    .await;
    let stats = client.stats().await.expect("stats");
    let names: Vec<&str> = stats.transport.iter().map(|n| n.node.as_str()).collect();
    assert_eq!(names, ["agent-rdma", "agent-tcp"], "sorted by node name");

    let on_tcp = find(&stats.transport, "agent-tcp")
        .and_then(|n| n.report.clone())
        .expect("tcp agent report");
    assert!(!on_tcp.rdma_requested && !on_tcp.fallback, "{on_tcp:?}");
    assert!(on_tcp.fallback_reason.is_empty() && on_tcp.rdma_devices.is_empty());

    let wanted = find(&stats.transport, "agent-rdma")
        .and_then(|n| n.report.clone())
        .expect("rdma agent report");
    assert!(wanted.rdma_requested, "{wanted:?}");
    let (_, metrics) = http_get(rdma_addrs.admin, "/metrics")
        .await
        .expect("agent metrics");
    let gauge = metric(&metrics, "kvpool_agent_pool_rdma_fallback", &[]);
    if has_device {
        // A host with a NIC: the agent opened it and did not fall back.
        assert!(!wanted.fallback, "{wanted:?}");
        assert!(!wanted.rdma_devices.is_empty(), "{wanted:?}");
        assert_eq!(gauge, Some(0.0));
    } else {
        assert!(wanted.fallback, "no device: the agent uses TCP, {wanted:?}");
        assert!(
            wanted.fallback_reason.contains("RDMA device"),
            "the reason says why: {wanted:?}"
        );
        assert!(wanted.rdma_devices.is_empty());
        assert_eq!(gauge, Some(1.0), "the agent gauge shows the fallback");
        let (status, body) = http_get(rdma_addrs.admin, "/readyz")
            .await
            .expect("agent readyz");
        assert_eq!(status, 503, "no RDMA device: not ready ({body})");
    }
    let (_, tcp_metrics) = http_get(tcp_addrs.admin, "/metrics")
        .await
        .expect("agent metrics");
    assert_eq!(
        metric(&tcp_metrics, "kvpool_agent_pool_rdma_fallback", &[]),
        Some(0.0)
    );
}

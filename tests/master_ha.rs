//! Master HA against a real etcd (Debian etcd-server) on 127.0.0.1: two `kvpool master`
//! processes elect a leader; the leader is SIGKILLed; the standby takes over with every
//! committed object, the same replica locations and the same allocation state, and clients
//! follow it.

mod pool_support;
mod skip_support;

use std::net::SocketAddr;
use std::time::Instant;

use kvpool_core::master::{PutOptions, PutStarted};
use kvpool_harness::http;
use nix::sys::signal::Signal;
use pool_support::{etcd_dir, ha_master_client, mount_dram, spawn_ha_master};

const KEY: &[u8] = b"kvpool-ha-test-pool-key-0123456789";
const MIB: u64 = 1 << 20;
/// Where the masters campaign in etcd.
const PREFIX: &str = "/kvpool/ha-test";

fn readyz(addr: SocketAddr) -> Option<u16> {
    http::get(addr, "/readyz").map(|r| r.status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_takes_over_with_every_committed_object() {
    let Some((dir, key_file, etcd)) = etcd_dir(KEY) else {
        return skip_support::skip(pool_support::ETCD_MISSING);
    };
    let spawn = |name| {
        let args = ["--heartbeat-timeout", "120s"];
        spawn_ha_master(dir.path(), &key_file, &etcd.client_url, PREFIX, name, &args)
    };
    let mut masters = vec![spawn("master-0"), spawn("master-1")];
    let grpcs: Vec<SocketAddr> = masters.iter().map(|m| m.grpc).collect();
    let client = ha_master_client(&grpcs, KEY);
    // Whichever answered is the leader (the client followed the standby's hint).
    mount_dram(&client, &["a", "b", "c"], 256 * MIB).await;
    let leader_addr = client.current_endpoint().expect("connected");
    let leader = masters
        .iter()
        .position(|m| m.grpc.to_string() == leader_addr)
        .expect("leader is one of ours");
    let standby = 1 - leader;
    assert_eq!(readyz(masters[leader].admin), Some(200));
    assert_eq!(
        readyz(masters[standby].admin),
        Some(503),
        "standby is not ready"
    );

    let opts = PutOptions {
        replicas: 2,
        writer_node: Some("a".into()),
        ..PutOptions::default()
    };
    let keys: Vec<Vec<u8>> = (0..120)
        .map(|i| format!("block/{i}").into_bytes())
        .collect();
    for chunk in keys.chunks(40) {
        let items: Vec<(&[u8], u64)> = chunk.iter().map(|k| (k.as_slice(), 64 * 1024)).collect();
        let started = client
            .put_start_batch(&items, &opts)
            .await
            .expect("put_start");
        let ends: Vec<(&[u8], u64)> = chunk
            .iter()
            .zip(started)
            .map(|(k, r)| match r.expect("allocated") {
                PutStarted::Allocated { put_id, .. } => (k.as_slice(), put_id),
                other => panic!("{other:?}"),
            })
            .collect();
        for r in client.put_end_batch(&ends).await.expect("put_end") {
            r.expect("committed");
        }
    }
    let removed: Vec<&[u8]> = keys[..10].iter().map(Vec::as_slice).collect();
    for r in client.remove_batch(&removed).await.expect("remove") {
        r.expect("removed");
    }
    // A put left pending across the failover: its space must not be handed out again.
    let pending = match client.put_start(b"pending", MIB, &opts).await.expect("put") {
        PutStarted::Allocated { put_id, replicas } => (put_id, replicas),
        other => panic!("{other:?}"),
    };
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let mut before = Vec::new();
    for r in client.get_batch(&refs[10..]).await.expect("get") {
        before.push(r.expect("found").replicas);
    }
    let stats_before = client.stats().await.expect("stats");

    // Crash the leader.
    let killed = Instant::now();
    masters[leader].process.kill().expect("SIGKILL the leader");
    let stats_after = client.stats().await.expect("standby answers");
    let takeover = killed.elapsed();
    println!("takeover after leader SIGKILL: {takeover:?}");
    assert_eq!(
        client.current_endpoint().as_deref(),
        Some(masters[standby].grpc.to_string().as_str())
    );
    assert_eq!(readyz(masters[standby].admin), Some(200));

    // Nothing committed was lost, nothing removed came back, locations are identical.
    let exists = client.exists(&refs).await.expect("exists");
    assert_eq!(&exists[..10], &[false; 10]);
    assert_eq!(&exists[10..], &[true; 110][..]);
    let mut after = Vec::new();
    for r in client.get_batch(&refs[10..]).await.expect("get") {
        after.push(r.expect("found").replicas);
    }
    assert_eq!(after, before);
    assert_eq!(stats_after.objects, stats_before.objects);
    assert_eq!(
        stats_after.used_bytes, stats_before.used_bytes,
        "reservations kept"
    );
    assert_eq!(stats_after.segments, 3);

    // The old put id means nothing now; the writer retries and gets fresh space.
    assert!(client.put_end(b"pending", pending.0).await.is_err());
    let retried = match client
        .put_start(b"pending", MIB, &opts)
        .await
        .expect("retry")
    {
        PutStarted::Allocated { put_id, replicas } => {
            client.put_end(b"pending", put_id).await.expect("commit");
            replicas
        }
        other => panic!("{other:?}"),
    };
    for old in &pending.1 {
        for new in &retried {
            let same_segment = old.segment_id == new.segment_id;
            let overlap =
                new.offset < old.offset + old.length && old.offset < new.offset + new.length;
            assert!(
                !(same_segment && overlap),
                "reserved space reused: {old:?} {new:?}"
            );
        }
    }

    // A third master joins as standby; the current leader is stopped cleanly (SIGTERM: it
    // resigns), and the newcomer takes over with the same state again.
    let third = spawn("master-2");
    let stats_before = client.stats().await.expect("stats");
    masters[standby]
        .process
        .signal(Signal::SIGTERM)
        .expect("SIGTERM");
    let exit = masters[standby].process.wait().expect("wait");
    assert!(exit.success(), "leader exits 0 after SIGTERM: {exit:?}");
    let client3 = ha_master_client(&[third.grpc], KEY);
    let stats_after = client3.stats().await.expect("third master leads");
    assert_eq!(stats_after.objects, stats_before.objects);
    assert_eq!(stats_after.used_bytes, stats_before.used_bytes);
    assert_eq!(
        client3.exists(&refs[10..]).await.expect("exists"),
        vec![true; 110]
    );
    drop(third);
    drop(masters);
    drop(etcd);
}

//! Striping across real processes on 127.0.0.1: one `kvpool master`, two `kvpool agent run`
//! processes in pool mode, this test as the client with striping at 1 MiB. A large value's parts
//! land on both agents and read back byte-exact; `remove` frees every part; under eviction
//! pressure no part of an evicted striped object stays behind (a partly evicted object reads as
//! `StripeIncomplete` and is cleaned up). Values of manifest length that are not manifests stay
//! ordinary values.

mod pool_support;

use std::collections::BTreeMap;

use kvpool_client::master::MasterClient;
use kvpool_client::pool::{MANIFEST_LEN, PoolClient, StripeConfig, stripe_part_key};
use kvpool_core::master::PutOptions;
use pool_support::*;

const MIB: u64 = 1 << 20;

fn value(seed: u64, len: usize) -> Vec<u8> {
    kvpool_harness::bytes::pseudo_random(seed, len)
}

async fn parts_present(client: &MasterClient, key: &[u8], parts: u32) -> usize {
    let keys: Vec<Vec<u8>> = (0..parts).map(|i| stripe_part_key(key, i)).collect();
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    client
        .exists(&refs)
        .await
        .expect("exists")
        .into_iter()
        .filter(|b| *b)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn striped_objects_spread_over_nodes_and_free_every_part() {
    let (dir, key_file, mut master, grpc, client) = test_pool("3s");
    let [mut a, mut b] = start_agents(dir.path(), grpc, &key_file, "64MiB");
    let empty = wait_mounted(&client, 2, &mut [&mut master, &mut a, &mut b]).await;
    let engine = client_engine("test-client", KEY, |c| c.prefer_shm = false);
    let pool = PoolClient::new(client.clone(), engine, "test-client".into(), None).with_striping(
        StripeConfig {
            threshold: MIB,
            part_size: MIB,
        },
    );
    let opts = PutOptions::default();

    // 6.5 MiB: six full parts and a half one, spread over both agents.
    let big_key = b"striped/big".as_slice();
    let big = value(1, (6 * MIB + MIB / 2) as usize);
    let replicas = pool.put(big_key, &big, &opts).await.expect("striped put");
    assert_eq!(replicas.len(), 7, "one replica per part");
    let mut per_node = BTreeMap::new();
    for r in &replicas {
        *per_node.entry(r.node.clone()).or_insert(0) += 1;
    }
    assert_eq!(per_node.len(), 2, "parts on both agents: {per_node:?}");
    let s = client.stats().await.expect("stats");
    assert_eq!(s.objects, 8, "seven parts and the manifest");
    assert_eq!(parts_present(&client, big_key, 7).await, 7);
    // Read back whole, into a caller buffer, and again after an idempotent re-put.
    assert!(pool.get(big_key).await.expect("striped get") == big);
    let mut buf = vec![0u8; big.len() + 10];
    let n = pool.get_into(big_key, &mut buf).await.expect("get_into");
    assert!(n == big.len() && buf[..n] == big[..]);
    assert!(
        pool.put(big_key, &big, &opts)
            .await
            .expect("re-put")
            .is_empty()
    );
    assert_eq!(client.stats().await.expect("stats").objects, 8);

    // A value of manifest length that is not a manifest stays an ordinary value.
    let plain = value(2, MANIFEST_LEN);
    pool.put(b"plain/52", &plain, &opts).await.expect("put");
    assert!(pool.get(b"plain/52").await.expect("get") == plain);
    pool.remove(b"plain/52").await.expect("remove plain");

    // Remove frees every part and all their bytes.
    pool.remove(big_key).await.expect("remove striped");
    let after = client.stats().await.expect("stats");
    assert_eq!(after.objects, 0);
    assert_eq!(after.used_bytes, empty.used_bytes, "every byte freed");
    assert_eq!(parts_present(&client, big_key, 7).await, 0);
    let e = pool.get(big_key).await.expect_err("gone");
    assert_eq!(e.category(), "master");

    // Eviction: the striped object is the oldest; fill the pool with plain 4 MiB values until
    // the master has evicted it. Afterwards no part of it may stay.
    pool.put(big_key, &big, &opts)
        .await
        .expect("striped put again");
    let filler = value(3, (4 * MIB) as usize);
    let mut evicted = false;
    for i in 0..64 {
        let k = format!("filler/{i}");
        pool.put(k.as_bytes(), &filler, &opts)
            .await
            .expect("filler put");
        if parts_present(&client, big_key, 7).await < 7
            || !client.exists(&[big_key]).await.expect("exists")[0]
        {
            evicted = true;
            break;
        }
    }
    assert!(
        evicted,
        "filling 2 x 64 MiB agents never evicted the oldest object"
    );
    // Whatever eviction took first, reading the object fails cleanly and leaves nothing behind.
    let e = pool.get(big_key).await.expect_err("evicted");
    assert!(
        ["master", "stripe_incomplete"].contains(&e.category()),
        "{e:#}"
    );
    assert_eq!(parts_present(&client, big_key, 7).await, 0, "orphan parts");
    assert!(!client.exists(&[big_key]).await.expect("exists")[0]);
}

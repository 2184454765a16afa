//! Unit tests of the master client: replica choice, batch limits and grouping, the coalescing
//! queues, and failures that reach every caller (no master runs: port 1 refuses).

use std::time::Duration;

use super::coalesce::{BatchOp, Coalescer, Pending, take_front};
use super::puts::PutStartOp;
use super::*;
use kvpool_core::master::types::{PutOptions, PutStarted, ReplicaInfo, Tier};
use kvpool_proto::master::MAX_BATCH;

fn rep(node: &str, numa: u32, tier: Tier) -> ReplicaInfo {
    ReplicaInfo {
        node: node.into(),
        segment_id: 1,
        segment: "s".into(),
        tier,
        numa_node: numa,
        endpoints: vec![],
        offset: 0,
        length: 1,
    }
}

#[test]
fn nearest_replica_prefers_node_then_numa_then_dram() {
    let reps = vec![
        rep("b", 0, Tier::Ssd),
        rep("c", 0, Tier::Dram),
        rep("a", 0, Tier::Dram),
        rep("a", 1, Tier::Dram),
    ];
    let pick = |n: &str, numa| pick_nearest(&reps, n, numa).map(|r| (r.node.clone(), r.numa_node));
    assert_eq!(pick("a", Some(1)), Some(("a".into(), 1)));
    assert_eq!(pick("a", Some(0)), Some(("a".into(), 0)));
    assert_eq!(pick("b", None), Some(("b".into(), 0)));
    assert_eq!(pick("z", None), Some(("c".into(), 0)), "DRAM before SSD");
    assert_eq!(pick_nearest(&[], "a", None), None);
}

#[test]
fn batches_stop_at_the_master_limit_and_put_starts_group_by_options() {
    let mut items: Vec<u32> = (0..(MAX_BATCH as u32 + 5)).collect();
    let first = take_front(&mut items);
    assert_eq!(first.len(), MAX_BATCH);
    assert_eq!(
        items,
        (MAX_BATCH as u32..MAX_BATCH as u32 + 5).collect::<Vec<_>>()
    );
    assert_eq!(take_front(&mut items).len(), 5);
    assert!(items.is_empty());

    let two = PutOptions {
        replicas: 2,
        ..PutOptions::default()
    };
    let item = |k: &str, o: &PutOptions| ((k.as_bytes().to_vec(), 1, o.clone()), None);
    let mut queue = vec![
        item("a", &PutOptions::default()),
        item("b", &PutOptions::default()),
        item("c", &two),
        item("d", &PutOptions::default()),
    ];
    type Queued = Pending<<PutStartOp as BatchOp>::Item, PutStarted>;
    let keys =
        |v: &[Queued]| -> Vec<Vec<u8>> { v.iter().map(|((k, _, _), _)| k.clone()).collect() };
    let batch = PutStartOp::take(&mut queue);
    assert_eq!(keys(&batch), vec![b"a".to_vec(), b"b".to_vec()]);
    assert_eq!(keys(&PutStartOp::take(&mut queue)), vec![b"c".to_vec()]);
    assert_eq!(keys(&PutStartOp::take(&mut queue)), vec![b"d".to_vec()]);
    assert!(queue.is_empty());
}

#[tokio::test]
async fn a_queue_has_one_sender_and_is_idle_only_when_drained() {
    let q: Coalescer<u64, ()> = Coalescer::default();
    q.idle().await; // idle from the start
    assert!(q.push(1, None), "the first item starts a sender");
    assert!(!q.push(2, None), "a running sender takes the next items");
    let batch = q.next(take_front).expect("two items wait");
    assert_eq!(batch.len(), 2);
    assert!(!q.push(3, None), "still running while a call is in flight");
    assert_eq!(q.next(take_front).map(|b| b.len()), Some(1));
    assert!(q.next(take_front).is_none(), "drained: the sender stops");
    q.idle().await;
    assert!(q.push(4, None), "a new item after that starts a new sender");
}

#[test]
fn a_release_queued_outside_a_runtime_leaves_with_the_next_call() {
    let key = AuthKey::from_bytes(b"0123456789abcdef").expect("key");
    let client = MasterClient::new(vec!["127.0.0.1:1".into()], key, ClientConfig::default())
        .expect("client");
    client.release_lease_later(5); // no runtime here: must not panic
    let q = &client.batch.release;
    assert!(!q.state.lock().running);
    assert_eq!(q.state.lock().items.len(), 1, "kept for the next call");
}

#[tokio::test]
async fn a_failed_batched_call_reaches_every_caller() {
    let key = AuthKey::from_bytes(b"0123456789abcdef").expect("key");
    let config = ClientConfig {
        connect_timeout: Duration::from_millis(200),
        request_timeout: Duration::from_secs(1),
        failover_budget: Duration::from_millis(100),
        ..Default::default()
    };
    // Nothing listens on port 1.
    let client = MasterClient::new(vec!["127.0.0.1:1".into()], key, config).expect("client");
    let (a, b, c) = tokio::join!(client.get(b"x"), client.get(b"y"), client.put_end(b"z", 7));
    for e in [a.map(|_| ()), b.map(|_| ()), c] {
        let e = e.expect_err("no master");
        assert_eq!(e.category(), "connect", "{e}");
    }
    // The failed calls were sent as batches: both gets in one.
    assert_eq!(client.batched_calls().get, 1);
    client.flush_releases().await;
}

#[test]
fn bad_endpoints_are_refused_up_front() {
    let key = AuthKey::from_bytes(b"0123456789abcdef").expect("key");
    assert!(matches!(
        MasterClient::new(vec![], key.clone(), ClientConfig::default()),
        Err(ClientError::NoEndpoints)
    ));
    assert!(matches!(
        MasterClient::new(
            vec!["http://bad host:1".into()],
            key,
            ClientConfig::default()
        ),
        Err(ClientError::Endpoint { .. })
    ));
}

#[test]
fn master_addresses_become_https_uris_with_tls_and_give_their_host_to_verify() {
    use super::connection::{host, uri};
    assert_eq!(uri("10.0.0.1:50051", false), "http://10.0.0.1:50051");
    assert_eq!(uri("10.0.0.1:50051", true), "https://10.0.0.1:50051");
    assert_eq!(uri("http://m:1", true), "https://m:1");
    assert_eq!(uri("https://m:1", true), "https://m:1");
    assert_eq!(host("master.pool.svc:50051"), "master.pool.svc");
    assert_eq!(host("https://master:50051/"), "master");
    assert_eq!(host("[::1]:50051"), "[::1]");
    assert_eq!(host("localhost"), "localhost");
}

#[test]
fn tls_settings_that_cannot_work_are_refused_naming_the_variable() {
    let key = AuthKey::from_bytes(b"0123456789abcdef").expect("key");
    let dir = tempfile::tempdir().expect("tmp");
    let with = |tls: MasterTls, endpoint: &str| {
        let config = ClientConfig {
            tls,
            ..ClientConfig::default()
        };
        MasterClient::new(vec![endpoint.into()], key.clone(), config)
            .expect_err("refused")
            .to_string()
    };
    let e = with(MasterTls::default(), "https://m:1");
    assert!(e.contains(CA_FILE_ENV), "{e}");
    let missing = dir.path().join("missing.pem");
    let e = with(
        MasterTls {
            ca_file: Some(missing.clone()),
            ..MasterTls::default()
        },
        "m:1",
    );
    assert!(e.contains(CA_FILE_ENV) && e.contains("missing.pem"), "{e}");
    let not_pem = dir.path().join("ca.pem");
    std::fs::write(&not_pem, "not a certificate").expect("write");
    let e = with(
        MasterTls {
            ca_file: Some(not_pem),
            ..MasterTls::default()
        },
        "m:1",
    );
    assert!(e.contains("holds no PEM certificate"), "{e}");
    let e = with(
        MasterTls {
            cert_file: Some(missing),
            ..MasterTls::default()
        },
        "m:1",
    );
    assert!(e.contains(CA_FILE_ENV), "{e}");
}

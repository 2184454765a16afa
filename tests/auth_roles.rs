//! Per-role credentials against an in-process master and a real transfer target on 127.0.0.1
//! (issue 15): each role's file, made from the pool key as the operator and `kvpool up` make
//! it, can make exactly its role's calls; a credential captured for one call is refused for
//! another method, another body or a second time; the conductor's file opens no transfer
//! connection.

mod pool_support;
mod transfer_util;

use std::sync::Arc;
use std::time::Duration;

use kvpool_client::credentials::{node_file, role_file};
use kvpool_client::master::{ClientConfig, ClientError, MasterClient};
use kvpool_core::master::{PutOptions, PutStarted};
use kvpool_proto::auth::{AUTH_HEADER, AuthKey, Role};
use kvpool_proto::fast::{self, Method};
use kvpool_proto::master::KeysRequest;
use kvpool_proto::master::master_client::MasterClient as RawClient;
use kvpool_transfer::{
    Endpoint, EngineConfig, HostOptions, Segment, StaticDirectory, TransferEngine, TransferMetrics,
};
use pool_support::{InProcessMaster, dram_segment, in_process_master};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

const KEY: &[u8] = b"kvpool-roles-test-pool-key-0123456789";

/// The credential file of `role`, written to `dir`.
fn role_path(dir: &std::path::Path, role: Role) -> std::path::PathBuf {
    let path = dir.join(format!("{role}.json"));
    std::fs::write(&path, role_file(KEY, role).expect("role file")).expect("write");
    path
}

/// The credential file of the agent on `node`, written to `dir`.
fn node_path(dir: &std::path::Path, node: &str) -> std::path::PathBuf {
    let path = dir.join(format!("agent-{node}.json"));
    std::fs::write(&path, node_file(KEY, node).expect("node file")).expect("write");
    path
}

fn client_of(f: &InProcessMaster, path: &std::path::Path) -> MasterClient {
    let key = AuthKey::from_file(path).expect("role key");
    let config = ClientConfig {
        failover_budget: Duration::from_millis(200),
        ..ClientConfig::default()
    };
    MasterClient::new(vec![f.master.grpc_addr.to_string()], key, config).expect("client")
}

fn status_code(e: &ClientError) -> Option<Code> {
    match e {
        ClientError::Rpc { source, .. } => Some(source.code()),
        _ => None,
    }
}

#[tokio::test]
async fn each_role_makes_its_calls_and_is_refused_the_others() {
    let f = in_process_master(KEY, |_| {}).await;
    let dir = tempfile::tempdir().expect("tmp");
    let agent = client_of(&f, &node_path(dir.path(), "a"));
    let engine = client_of(&f, &role_path(dir.path(), Role::Engine));
    let conductor = client_of(&f, &role_path(dir.path(), Role::Conductor));
    let observer = client_of(&f, &role_path(dir.path(), Role::Observer));

    agent
        .mount_segment(&dram_segment("a", 64 << 20))
        .await
        .expect("agent mounts");
    let started = engine
        .put_start(b"k/0", 4096, &PutOptions::default())
        .await
        .expect("engine puts");
    let PutStarted::Allocated { put_id, .. } = started else {
        panic!("unexpected {started:?}");
    };
    engine
        .put_end(b"k/0", put_id)
        .await
        .expect("engine commits");
    let located = engine.get(b"k/0").await.expect("engine gets");
    engine
        .release_lease(located.lease_id)
        .await
        .expect("engine releases");

    let keys: [&[u8]; 2] = [b"k/0", b"k/1"];
    assert_eq!(conductor.longest_prefix(&keys).await.expect("lookup"), 1);
    assert_eq!(
        conductor.exists(&keys).await.expect("exists"),
        vec![true, false]
    );
    let refused = conductor
        .put_start(b"k/2", 4096, &PutOptions::default())
        .await
        .expect_err("the conductor may not write");
    assert_eq!(
        status_code(&refused),
        Some(Code::PermissionDenied),
        "{refused}"
    );
    let message = refused.to_string() + &format!("{:?}", refused);
    assert!(
        message.contains("conductor") && message.contains("PutStart"),
        "{message}"
    );
    for (who, e) in [
        ("conductor get", conductor.get(b"k/0").await.map(|_| ())),
        ("conductor remove", conductor.remove(b"k/0").await),
        ("conductor stats", conductor.stats().await.map(|_| ())),
        ("observer get", observer.get(b"k/0").await.map(|_| ())),
        (
            "engine adopt",
            engine.adopt_replicas("a", 0, &[], false).await.map(|_| ()),
        ),
        ("agent remove_all", agent.remove_all().await.map(|_| ())),
    ] {
        let e = e.expect_err(who);
        assert_eq!(status_code(&e), Some(Code::PermissionDenied), "{who}: {e}");
    }
    observer.stats().await.expect("observer reads stats");
    // Refused calls changed nothing: k/0 is still there, k/2 never started.
    assert_eq!(
        f.client.exists(&[b"k/0", b"k/2"]).await.expect("exists"),
        vec![true, false]
    );
}

/// Issue 38: an engine's credential makes no membership call (mount, unmount, heartbeat, task
/// report, adoption) and cannot empty the pool; an agent's credential acts for its own node
/// only; the agent role's node-less credential makes node calls only where the master allows
/// shared agent credentials, and even then a node-bound one stays bound.
#[tokio::test]
async fn membership_calls_are_refused_to_engines_and_bound_to_the_agents_node() {
    let f = in_process_master(KEY, |_| {}).await;
    let dir = tempfile::tempdir().expect("tmp");
    let engine = client_of(&f, &role_path(dir.path(), Role::Engine));
    let shared = client_of(&f, &role_path(dir.path(), Role::Agent));
    let agent_a = client_of(&f, &node_path(dir.path(), "node-a"));
    let agent_b = client_of(&f, &node_path(dir.path(), "node-b.example.com"));

    let id_a = agent_a
        .mount_segment(&dram_segment("node-a", 64 << 20))
        .await
        .expect("an agent mounts for its own node");
    agent_a.heartbeat("node-a").await.expect("own heartbeat");
    let id_b = agent_b
        .mount_segment(&dram_segment("node-b.example.com", 64 << 20))
        .await
        .expect("a node name with dots");
    let started = engine
        .put_start(b"k/0", 4096, &PutOptions::default())
        .await
        .expect("engine puts");
    let PutStarted::Allocated { put_id, .. } = started else {
        panic!("unexpected {started:?}");
    };
    engine.put_end(b"k/0", put_id).await.expect("commit");
    let before = f.client.stats().await.expect("stats");

    let huge = dram_segment("node-a", 1 << 40);
    for (who, r, reason) in [
        (
            "engine mounts under an agent's node",
            engine.mount_segment(&huge).await.map(|_| ()),
            "engine may not call MountSegment",
        ),
        (
            "engine mounts a node of its own",
            engine
                .mount_segment(&dram_segment("engine-x", 1 << 20))
                .await
                .map(|_| ()),
            "engine may not call MountSegment",
        ),
        (
            "engine unmounts",
            engine.unmount_segment("node-a", id_a).await,
            "engine may not call UnmountSegment",
        ),
        (
            "engine heartbeats",
            engine.heartbeat("node-a").await.map(|_| ()),
            "engine may not call Heartbeat",
        ),
        (
            "engine reports a task",
            engine.complete_task("node-a", 1, true).await,
            "engine may not call CompleteTask",
        ),
        (
            "engine adopts",
            engine
                .adopt_replicas("node-a", id_a, &[], false)
                .await
                .map(|_| ()),
            "engine may not call AdoptReplicas",
        ),
        (
            "engine empties the pool",
            engine.remove_all().await.map(|_| ()),
            "engine may not call RemoveAll",
        ),
        (
            "agent b mounts as node a",
            agent_b.mount_segment(&huge).await.map(|_| ()),
            "may not act for node",
        ),
        (
            "agent b unmounts node a's segment",
            agent_b.unmount_segment("node-a", id_a).await,
            "may not act for node",
        ),
        (
            "agent b heartbeats for node a",
            agent_b.heartbeat("node-a").await.map(|_| ()),
            "may not act for node",
        ),
        (
            "agent b reports node a's task",
            agent_b.complete_task("node-a", 1, true).await,
            "may not act for node",
        ),
        (
            "agent b adopts on node a",
            agent_b
                .adopt_replicas("node-a", id_a, &[], false)
                .await
                .map(|_| ()),
            "may not act for node",
        ),
        (
            "the shared agent credential mounts",
            shared
                .mount_segment(&dram_segment("node-c", 1 << 20))
                .await
                .map(|_| ()),
            "not bound to a node",
        ),
        (
            "the shared agent credential unmounts",
            shared.unmount_segment("node-b.example.com", id_b).await,
            "not bound to a node",
        ),
        (
            "an agent empties the pool",
            agent_a.remove_all().await.map(|_| ()),
            "agent may not call RemoveAll",
        ),
    ] {
        let e = r.expect_err(who);
        assert_eq!(status_code(&e), Some(Code::PermissionDenied), "{who}: {e}");
        let message = format!("{e} {e:?}");
        assert!(message.contains(reason), "{who}: {message}");
    }
    // Nothing changed: the same segments, capacity and object.
    let after = f.client.stats().await.expect("stats");
    assert_eq!(after.segments, 2);
    assert_eq!(after.capacity_bytes, before.capacity_bytes);
    assert_eq!(after.objects, 1);
    assert_eq!(
        f.client.exists(&[b"k/0"]).await.expect("exists"),
        vec![true]
    );
    // Its own node's segment, the agent may unmount.
    agent_b
        .unmount_segment("node-b.example.com", id_b)
        .await
        .expect("own unmount");
    assert_eq!(f.client.stats().await.expect("stats").segments, 1);

    // Where the master allows shared agent credentials, the node-less one acts for any node;
    // a node-bound one stays bound.
    let g = in_process_master(KEY, |a| a.shared_agent_credentials = true).await;
    let shared = client_of(&g, &role_path(dir.path(), Role::Agent));
    let agent_b = client_of(&g, &node_path(dir.path(), "node-b.example.com"));
    shared
        .mount_segment(&dram_segment("node-c", 1 << 20))
        .await
        .expect("shared credentials allowed");
    let e = agent_b
        .mount_segment(&dram_segment("node-c", 1 << 20))
        .await
        .expect_err("still bound");
    assert_eq!(status_code(&e), Some(Code::PermissionDenied), "{e}");
    let e = engine_of(&g, dir.path())
        .mount_segment(&dram_segment("node-c", 1 << 20))
        .await
        .expect_err("engines never");
    assert_eq!(status_code(&e), Some(Code::PermissionDenied), "{e}");
}

fn engine_of(f: &InProcessMaster, dir: &std::path::Path) -> MasterClient {
    client_of(f, &role_path(dir, Role::Engine))
}

/// A raw gRPC call of `Exists` or `Stats` with `credential` as its header.
async fn raw_call(
    f: &InProcessMaster,
    method: &str,
    credential: &str,
) -> Result<(), tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", f.master.grpc_addr))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let mut c = RawClient::new(channel);
    let value: tonic::metadata::MetadataValue<_> = credential.parse().expect("header");
    match method {
        "Exists" => {
            let mut req = tonic::Request::new(KeysRequest { keys: vec![] });
            req.metadata_mut().insert(AUTH_HEADER, value);
            c.exists(req).await.map(|_| ())
        }
        _ => {
            let mut req = tonic::Request::new(kvpool_proto::master::Empty {});
            req.metadata_mut().insert(AUTH_HEADER, value);
            c.stats(req).await.map(|_| ())
        }
    }
}

/// Send one fast-lane request (after the preface) and read the reply's code.
async fn fast_call(f: &InProcessMaster, frame: Vec<u8>) -> u8 {
    let mut s = tokio::net::TcpStream::connect(f.master.grpc_addr)
        .await
        .expect("connect");
    let mut bytes = fast::PREFACE.to_vec();
    bytes.extend_from_slice(&frame);
    s.write_all(&bytes).await.expect("write");
    let mut head = [0u8; 13];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut head))
        .await
        .expect("answered")
        .expect("read");
    assert_eq!(&head[..8], &fast::PREFACE);
    head[12]
}

#[tokio::test]
async fn a_captured_credential_serves_only_its_own_call_once() {
    let f = in_process_master(KEY, |_| {}).await;
    let pool = AuthKey::from_bytes(KEY).expect("pool");
    let engine = pool.derive(Role::Engine).expect("engine");

    // gRPC: made for Exists, used for Stats: refused; then used for Exists once, not twice.
    let captured = engine.sign("Exists");
    let e = raw_call(&f, "Stats", &captured)
        .await
        .expect_err("other method");
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    raw_call(&f, "Exists", &captured)
        .await
        .expect("its own call");
    let e = raw_call(&f, "Exists", &captured)
        .await
        .expect_err("replayed");
    assert_eq!(e.code(), Code::Unauthenticated);
    assert!(e.message().contains("replayed"), "{e:?}");
    // A fast-lane credential (bound to a body) is not taken on gRPC.
    let bound = engine.sign_body("Exists", b"");
    let e = raw_call(&f, "Exists", &bound)
        .await
        .expect_err("body-bound");
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");

    // Fast lane: the credential binds the method and the body.
    let body = prost::Message::encode_to_vec(&KeysRequest {
        keys: vec![b"a".to_vec()],
    });
    let other = prost::Message::encode_to_vec(&KeysRequest {
        keys: vec![b"b".to_vec()],
    });
    let frame = |method: Method, cred: &str, releases: &[u64], body: &[u8]| {
        let mut out = Vec::new();
        fast::encode_request(&mut out, method, cred, releases, body);
        out
    };
    let tail = fast::request_tail(&[], &body);
    let good = engine.sign_body("Exists", &tail);
    assert_eq!(
        fast_call(&f, frame(Method::Exists, &good, &[], &body)).await,
        0
    );
    let for_exists = engine.sign_body("Exists", &tail);
    let code = fast_call(&f, frame(Method::LongestPrefix, &for_exists, &[], &body)).await;
    assert_eq!(code, Code::Unauthenticated as u8, "another method");
    let for_body = engine.sign_body("Exists", &tail);
    let code = fast_call(&f, frame(Method::Exists, &for_body, &[], &other)).await;
    assert_eq!(code, Code::Unauthenticated as u8, "another body");
    let unbound = engine.sign("Exists");
    let code = fast_call(&f, frame(Method::Exists, &unbound, &[], &body)).await;
    assert_eq!(code, Code::Unauthenticated as u8, "no body digest");
    // The conductor may look up, but not release leases on the side.
    let conductor = pool.derive(Role::Conductor).expect("conductor");
    let with_release = fast::request_tail(&[7], &body);
    let cred = conductor.sign_body("LongestPrefix", &with_release);
    let code = fast_call(&f, frame(Method::LongestPrefix, &cred, &[7], &body)).await;
    assert_eq!(code, Code::PermissionDenied as u8);
    let cred = conductor.sign_body("LongestPrefix", &tail);
    let code = fast_call(&f, frame(Method::LongestPrefix, &cred, &[], &body)).await;
    assert_eq!(code, 0);
}

/// A transfer target keyed like an agent (its role file), holding a 64 KiB segment.
fn agent_target(
    agent_file: &std::path::Path,
) -> (
    TransferEngine,
    kvpool_transfer::TcpServer,
    Arc<StaticDirectory>,
) {
    let dir = Arc::new(StaticDirectory::new());
    let engine = TransferEngine::new(
        engine_config("agent"),
        kvpool_transfer::AuthKey::from_file(agent_file).expect("agent transfer key"),
        dir.clone(),
        TransferMetrics::unregistered().expect("metrics"),
    )
    .expect("engine");
    let seg = engine
        .register(
            "seg",
            Arc::new(Segment::host(65536, HostOptions::default()).expect("segment")),
        )
        .expect("register");
    seg.segment().write_at(0, b"kv block bytes").expect("write");
    let server = engine
        .listen_tcp("127.0.0.1:0".parse().expect("addr"))
        .expect("listen");
    dir.insert(engine.describe(&seg, vec![Endpoint::Tcp(server.local_addr())]));
    std::mem::forget(seg);
    (engine, server, dir)
}

/// The transfer engine settings of node `node` in these tests: 5 s to connect and per transfer.
fn engine_config(node: &str) -> EngineConfig {
    EngineConfig {
        node: node.into(),
        timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_secs(5),
        ..EngineConfig::default()
    }
}

/// Read the target's first 14 bytes with an engine keyed by `key`.
fn read_with(key: kvpool_transfer::AuthKey, dir: Arc<StaticDirectory>) -> Result<Vec<u8>, String> {
    let client = TransferEngine::new(
        engine_config("client"),
        key,
        dir,
        TransferMetrics::unregistered().map_err(|e| e.to_string())?,
    )
    .map_err(|e| e.to_string())?;
    transfer_util::read_head(&client, "seg", 14)
}

#[test]
fn the_conductors_file_opens_no_transfer_connection() {
    let dir = tempfile::tempdir().expect("tmp");
    let agent_file = role_path(dir.path(), Role::Agent);
    let (_target, _server, directory) = agent_target(&agent_file);

    // Engines (their role file) and raw pool-key holders reach the agent's bytes.
    let engine = kvpool_transfer::AuthKey::from_file(&role_path(dir.path(), Role::Engine))
        .expect("engine transfer key");
    assert_eq!(
        read_with(engine, directory.clone()).expect("engine reads"),
        b"kv block bytes"
    );
    let pool = kvpool_transfer::AuthKey::new(KEY).expect("pool");
    assert_eq!(
        read_with(pool, directory.clone()).expect("pool key reads"),
        b"kv block bytes"
    );

    // The conductor's file carries no transfer key at all...
    let conductor_file = role_path(dir.path(), Role::Conductor);
    let e = kvpool_transfer::AuthKey::from_file(&conductor_file).expect_err("no transfer key");
    assert!(e.to_string().contains("conductor"), "{e}");
    // ...and its master key, tried as one, fails the handshake.
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&conductor_file).expect("read")).expect("json");
    let hex = doc["master"].as_str().expect("master");
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect();
    let forged = kvpool_transfer::AuthKey::from_transfer_key(&bytes).expect("key");
    let e = read_with(forged, directory).expect_err("handshake refused");
    assert!(!e.is_empty());
}

/// Issue 38: docs/reliability.md's role table ("Credentials") lists, for each role, exactly the
/// master calls the code lets it make.
#[test]
fn the_role_table_here_is_the_codes() {
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/reliability.md"),
    )
    .expect("docs/reliability.md");
    let section = doc
        .split("\n## Credentials\n")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("a Credentials section");
    let mut seen = Vec::new();
    for line in section.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // | `role` | who | master calls | transfer key |
        let Some(role) = cells
            .get(1)
            .and_then(|c| c.strip_prefix('`'))
            .and_then(|c| c.strip_suffix('`'))
            .and_then(Role::from_name)
        else {
            continue;
        };
        let listed: std::collections::BTreeSet<&str> = cells[3]
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|w| w.starts_with(|c: char| c.is_ascii_uppercase()))
            .collect();
        let allowed: std::collections::BTreeSet<&str> = kvpool_proto::auth::METHODS
            .iter()
            .copied()
            .filter(|m| role.allows(m))
            .collect();
        assert_eq!(listed, allowed, "the row of role {role}");
        seen.push(role);
    }
    assert_eq!(seen, Role::ALL, "one row per role, in order");
}

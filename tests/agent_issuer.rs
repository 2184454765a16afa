//! The agent credential issuer end to end (issue 38, docs/adr/0009-node-bound-agent-credentials.md):
//! the operator's HTTPS issuer in front of a Kubernetes API double (TokenReview, pods,
//! DaemonSets answered as the API server answers them, and every request checked), the
//! agent's own client dialling it over TLS with the CA from the pool document, and the issued
//! credential used against a real master that runs without `--shared-agent-credentials`: the
//! agent mounts for its node and is refused for another node. Pods that are not the pool's
//! agents, tokens the API server rejects and an issuer under another CA get nothing.

mod pool_support;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use kube::client::Body;
use kvpool_agent::issuer::{IssueError, IssuerConfig, fetch, fetch_once};
use kvpool_client::master::{ClientConfig, MasterClient};
use kvpool_operator::issuer::{self, IssuerCa, IssuerState};
use kvpool_operator::root_key::RootKey;
use kvpool_proto::auth::{AuthKey, RoleDocument};
use kvpool_proto::issuer::AUDIENCE;
use parking_lot::Mutex;
use pool_support::{dram_segment, in_process_master};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const NS: &str = "ml";
const POOL: &str = "kv";
const POOL_UID: &str = "6f1c-pool-uid";
const DS_UID: &str = "0a2b-ds-uid";

/// Tokens the double's TokenReview knows: token → (pod name, pod uid).
fn known_tokens() -> BTreeMap<&'static str, (&'static str, &'static str)> {
    BTreeMap::from([
        ("token-of-agent-a", ("kv-agent-aaaa", "uid-a")),
        ("token-of-agent-b", ("kv-agent-bbbb", "uid-b")),
        // A pod in the namespace that names the DaemonSet as its owner by hand.
        ("token-of-impostor", ("impostor", "uid-i")),
    ])
}

fn pod(name: &str, uid: &str, node: &str, ds_uid: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "uid": uid, "ownerReferences": [{
            "apiVersion": "apps/v1", "kind": "DaemonSet", "name": "kv-agent", "uid": ds_uid,
            "controller": true}]},
        "spec": {"nodeName": node, "serviceAccountName": "kv-agent", "containers": []},
    })
}

fn not_found(what: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": "NotFound",
        "code": 404, "message": format!("{what} not found")})
}

/// The API double: answers what the issuer may ask and records anything else.
#[derive(Default)]
struct Api {
    unexpected: Mutex<Vec<String>>,
    reviews: Mutex<usize>,
}

impl Api {
    fn answer(&self, method: &str, path: &str, body: &[u8]) -> (u16, Value) {
        match (method, path) {
            ("POST", "/apis/authentication.k8s.io/v1/tokenreviews") => {
                *self.reviews.lock() += 1;
                let review: Value = serde_json::from_slice(body).expect("TokenReview JSON");
                assert_eq!(review["kind"], "TokenReview");
                assert_eq!(
                    review["spec"]["audiences"],
                    json!([AUDIENCE]),
                    "audience asked"
                );
                let token = review["spec"]["token"].as_str().expect("token");
                let status = match known_tokens().get(token) {
                    Some((pod, uid)) => json!({
                        "authenticated": true, "audiences": [AUDIENCE],
                        "user": {"username": format!("system:serviceaccount:{NS}:kv-agent"),
                            "extra": {"authentication.kubernetes.io/pod-name": [pod],
                                "authentication.kubernetes.io/pod-uid": [uid]}}}),
                    None => json!({"authenticated": false, "error": "invalid bearer token"}),
                };
                let mut answer = review.clone();
                answer["status"] = status;
                (201, answer)
            }
            ("GET", "/api/v1/namespaces/ml/pods/kv-agent-aaaa") => {
                (200, pod("kv-agent-aaaa", "uid-a", "node-a", DS_UID))
            }
            ("GET", "/api/v1/namespaces/ml/pods/kv-agent-bbbb") => {
                (200, pod("kv-agent-bbbb", "uid-b", "node-b", DS_UID))
            }
            ("GET", "/api/v1/namespaces/ml/pods/impostor") => {
                (200, pod("impostor", "uid-i", "node-a", "copied-by-hand"))
            }
            ("GET", "/apis/apps/v1/namespaces/ml/daemonsets/kv-agent") => (
                200,
                json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
                    "metadata": {"name": "kv-agent", "namespace": NS, "uid": DS_UID,
                        "ownerReferences": [{"apiVersion": "kvpool.dev/v1alpha1",
                            "kind": "KVCachePool", "name": POOL, "uid": POOL_UID,
                            "controller": true}]},
                    "spec": {"selector": {}, "template": {"spec": {
                        "serviceAccountName": "kv-agent", "containers": []}}}}),
            ),
            _ => {
                self.unexpected.lock().push(format!("{method} {path}"));
                (404, not_found(path))
            }
        }
    }
}

fn kube_client(api: Arc<Api>) -> kube::Client {
    let service = tower::service_fn(move |req: http::Request<Body>| {
        let api = api.clone();
        async move {
            let (parts, body) = req.into_parts();
            let bytes = body.collect().await.expect("request body").to_bytes();
            let (status, answer) = api.answer(parts.method.as_str(), parts.uri.path(), &bytes);
            let response = http::Response::builder()
                .status(status)
                .header("content-type", "application/json")
                .body(Full::new(bytes::Bytes::from(answer.to_string())))
                .expect("response");
            Ok::<_, Infallible>(response)
        }
    });
    kube::Client::new(service, "default")
}

struct Issuer {
    url: String,
    ca_pem: String,
    api: Arc<Api>,
    root: RootKey,
    stop: CancellationToken,
}

async fn start_issuer() -> Issuer {
    let api = Arc::new(Api::default());
    let root = RootKey::for_tests();
    let ca = IssuerCa::derive(&root).expect("CA");
    let tls = ca.server_config(&["localhost".to_owned()]).expect("TLS");
    let listener = issuer::serve::bind("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let outcomes =
        prometheus::IntCounterVec::new(prometheus::Opts::new("outcomes", "test"), &["outcome"])
            .expect("counter");
    let state = Arc::new(IssuerState {
        client: kube_client(api.clone()),
        root: root.clone(),
        outcomes,
    });
    let stop = CancellationToken::new();
    tokio::spawn(issuer::serve(
        listener,
        tls,
        issuer::serve::router(state),
        stop.clone(),
    ));
    Issuer {
        url: format!("https://localhost:{port}"),
        ca_pem: ca.ca_pem(),
        api,
        root,
        stop,
    }
}

fn agent_config(issuer: &Issuer, dir: &std::path::Path, token: &str) -> IssuerConfig {
    let token_file = dir.join(format!("{token}.jwt"));
    std::fs::write(&token_file, format!("{token}\n")).expect("token");
    IssuerConfig {
        url: issuer.url.clone(),
        ca_pem: issuer.ca_pem.clone(),
        token_file,
        namespace: NS.to_owned(),
        pool: POOL.to_owned(),
    }
}

#[tokio::test]
async fn each_agent_gets_its_own_nodes_credential_and_the_master_binds_it_to_that_node() {
    let issuer = start_issuer().await;
    let dir = tempfile::tempdir().expect("tmp");
    let stop = CancellationToken::new();
    let doc_a = fetch(
        &agent_config(&issuer, dir.path(), "token-of-agent-a"),
        &stop,
    )
    .await
    .expect("agent a gets a credential");
    let doc_b = fetch_once(&agent_config(&issuer, dir.path(), "token-of-agent-b"))
        .await
        .expect("agent b gets a credential");
    let parsed = RoleDocument::parse(&doc_a).expect("a credential file");
    assert_eq!(parsed.node.as_deref(), Some("node-a"));
    assert_eq!(
        RoleDocument::parse(&doc_b).expect("file").node.as_deref(),
        Some("node-b")
    );
    // Exactly the file `kvpool auth derive --role agent --node node-a` makes from the pool key
    // the operator derives for this pool.
    let pool_key = issuer.root.pool_key_hex(NS, POOL, POOL_UID);
    assert_eq!(
        String::from_utf8(doc_a.clone()).expect("utf-8"),
        kvpool_client::credentials::node_file(pool_key.as_bytes(), "node-a").expect("file")
    );
    assert!(
        issuer.api.unexpected.lock().is_empty(),
        "{:?}",
        issuer.api.unexpected.lock()
    );

    // The master (no --shared-agent-credentials) takes a's node calls for node-a only.
    let master = in_process_master(pool_key.as_bytes(), |_| {}).await;
    let client = |doc: &[u8]| {
        let config = ClientConfig {
            failover_budget: Duration::from_millis(200),
            ..ClientConfig::default()
        };
        let key = AuthKey::from_document(doc).expect("master key");
        MasterClient::new(vec![master.master.grpc_addr.to_string()], key, config).expect("client")
    };
    let agent_a = client(&doc_a);
    agent_a
        .mount_segment(&dram_segment("node-a", 64 << 20))
        .await
        .expect("agent a mounts on its node");
    let refused = agent_a
        .mount_segment(&dram_segment("node-b", 64 << 20))
        .await
        .expect_err("agent a may not act for node-b");
    let why = format!("{:?}", refused);
    assert!(why.contains("node-b"), "{why}");
    client(&doc_b)
        .mount_segment(&dram_segment("node-b", 64 << 20))
        .await
        .expect("agent b mounts on its node");
    issuer.stop.cancel();
}

#[tokio::test]
async fn callers_that_are_not_the_pools_agents_get_nothing_and_are_not_retried() {
    let issuer = start_issuer().await;
    let dir = tempfile::tempdir().expect("tmp");
    let stop = CancellationToken::new();
    for (token, status, reason) in [
        ("token-of-impostor", 403, "not_an_agent"),
        ("a-token-the-api-server-rejects", 401, "token_rejected"),
    ] {
        let before = *issuer.api.reviews.lock();
        let started = std::time::Instant::now();
        let err = fetch(&agent_config(&issuer, dir.path(), token), &stop)
            .await
            .expect_err(token);
        match &err {
            IssueError::Refused {
                status: s,
                reason: r,
                ..
            } => assert_eq!((*s, r.as_str()), (status, reason), "{err}"),
            other => panic!("{token}: {other}"),
        }
        // A refusal is final: one review, no retry loop.
        assert_eq!(*issuer.api.reviews.lock(), before + 1);
        assert!(started.elapsed() < Duration::from_secs(5));
    }
    // Another namespace's pool: refused before any pod is read.
    let mut elsewhere = agent_config(&issuer, dir.path(), "token-of-agent-a");
    elsewhere.namespace = "other".to_owned();
    let err = fetch_once(&elsewhere).await.expect_err("other namespace");
    assert!(err.to_string().contains("wrong_namespace"), "{err}");
    // An empty token: named before the API server is asked.
    let before = *issuer.api.reviews.lock();
    let err = fetch_once(&agent_config(&issuer, dir.path(), ""))
        .await
        .expect_err("no token");
    assert!(
        matches!(&err, IssueError::Refused { status: 401, reason, .. } if reason == "no_token"),
        "{err}"
    );
    assert_eq!(*issuer.api.reviews.lock(), before);
    assert!(
        issuer.api.unexpected.lock().is_empty(),
        "{:?}",
        issuer.api.unexpected.lock()
    );
    issuer.stop.cancel();
}

#[tokio::test]
async fn an_agent_trusts_only_the_ca_of_its_pool_document() {
    let issuer = start_issuer().await;
    let dir = tempfile::tempdir().expect("tmp");
    let mut cfg = agent_config(&issuer, dir.path(), "token-of-agent-a");
    // The CA of an operator with another root key.
    let other = RootKey::from_bytes(b"another-operator-root-key-0123456789abcdef").expect("key");
    cfg.ca_pem = IssuerCa::derive(&other).expect("CA").ca_pem();
    let err = fetch_once(&cfg).await.expect_err("untrusted issuer");
    assert!(matches!(err, IssueError::Connect { .. }), "{err}");
    // The token never reached the API double.
    assert_eq!(*issuer.api.reviews.lock(), 0);
    // The same root key gives the same CA certificate, byte for byte (pool documents stay
    // the same across operator restarts and replicas).
    assert_eq!(
        IssuerCa::derive(&RootKey::for_tests())
            .expect("CA")
            .ca_pem(),
        issuer.ca_pem
    );
    issuer.stop.cancel();
}

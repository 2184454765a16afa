//! Reconcile scenarios driven through kube's real `Client` against an in-process API double
//! (`tower_test::mock::pair`): every request the operator makes is checked for method, path,
//! query (fieldManager, force, labelSelector) and body, and answered the way the Kubernetes API
//! server answers (echo of the applied object with server-set fields, 201 on create, 409
//! AlreadyExists, 404 NotFound as a `Status`, lists). When the reconcile returns, the client is
//! dropped and the double checks that no request is left over, so "no status write" is proven
//! rather than assumed.

use std::collections::BTreeMap;
use std::sync::Arc;

use http::{Method, Request, Response, StatusCode};
use kube::Client;
use kube::client::Body;
use kube::runtime::reflector;
use kube::runtime::watcher;
use kvpool_crd::{DecodePool, KVCachePool, KVCachePoolStatus, PrefillPool};
use kvpool_operator::cachepool::{self, Outcome};
use kvpool_operator::context::Context;
use kvpool_operator::enginepool::{self, EnginePool};
use kvpool_operator::error::Result as OperatorResult;
use kvpool_proto::auth::Role;
use serde_json::{Value, json};

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

fn fixture<T: serde::de::DeserializeOwned>(name: &str) -> T {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("read fixture");
    serde_saphyr::from_str(&text).expect("parse fixture")
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).expect("utf8");
                out.push(u8::from_str_radix(hex, 16).expect("hex"));
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).expect("utf8")
}

/// The RBAC (group, resource, verb) a namespaced request needs.
fn permission(method: &Method, path: &str) -> (&'static str, &'static str, &'static str) {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (group, rest) = match parts.as_slice() {
        ["api", "v1", rest @ ..] => ("", rest),
        ["apis", group, _version, rest @ ..] => (*group, rest),
        _ => panic!("unexpected path {path}"),
    };
    let (resource, name, sub) = match rest {
        ["namespaces", _, resource] => (*resource, None, None),
        ["namespaces", _, resource, name] => (*resource, Some(*name), None),
        ["namespaces", _, resource, name, sub] => (*resource, Some(*name), Some(*sub)),
        _ => panic!("unexpected path {path}"),
    };
    let resource = match sub {
        Some(sub) => format!("{resource}/{sub}"),
        None => resource.to_owned(),
    };
    let verb = match (method.as_str(), name) {
        ("GET", Some(_)) => "get",
        ("GET", None) => "list",
        ("POST", _) => "create",
        ("PATCH", _) => "patch",
        ("PUT", _) => "update",
        ("DELETE", _) => "delete",
        other => panic!("unexpected method {other:?}"),
    };
    // Leak to 'static: a handful of short strings per test process.
    let group: &'static str = Box::leak(group.to_owned().into_boxed_str());
    let resource: &'static str = Box::leak(resource.into_boxed_str());
    (group, resource, verb)
}

/// One request as the double saw it.
#[derive(Debug)]
struct Seen {
    method: Method,
    path: String,
    query: BTreeMap<String, String>,
    body: Value,
}

/// The API-server side of the mock pair.
struct ApiServer {
    handle: Handle,
}

impl ApiServer {
    /// Take the next request, check method and path, and hand it to the caller with the
    /// responder.
    async fn expect(
        &mut self,
        method: Method,
        path: &str,
    ) -> (Seen, tower_test::mock::SendResponse<Response<Body>>) {
        let (request, send) = self
            .handle
            .next_request()
            .await
            .unwrap_or_else(|| panic!("expected {method} {path}, but the client hung up"));
        let (parts, body) = request.into_parts();
        let bytes = body.collect_bytes().await.expect("request body");
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).expect("request body is JSON")
        };
        let query = parts
            .uri
            .query()
            .unwrap_or_default()
            .split('&')
            .filter(|kv| !kv.is_empty())
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                (percent_decode(k), percent_decode(v))
            })
            .collect();
        let seen = Seen {
            method: parts.method,
            path: parts.uri.path().to_owned(),
            query,
            body,
        };
        // The operator may create Secrets and nothing else: it derives every pool key from its
        // root key instead of reading one back. The one exception is its own root key Secret
        // (`--root-key-secret`), read at start.
        let own_root_key = seen.path.ends_with("/secrets/kvpool-operator-root-key");
        assert!(
            !seen.path.contains("/secrets") || seen.method == Method::POST || own_root_key,
            "the operator must not {} a Secret: {}",
            seen.method,
            seen.path
        );
        assert_eq!(
            (&seen.method, seen.path.as_str()),
            (&method, path),
            "unexpected request {seen:?}"
        );
        let needed = permission(&seen.method, &seen.path);
        let granted = if own_root_key {
            kvpool_operator::rbac::root_key_permissions()
        } else {
            kvpool_operator::rbac::permissions()
        };
        assert!(
            granted.contains(&needed),
            "{} {} needs {needed:?}, which kvpool_operator::rbac::PERMISSIONS lacks",
            seen.method,
            seen.path
        );
        (seen, send)
    }

    /// Expect a server-side apply (PATCH, fieldManager=kvpool-operator, force=true) of `path`
    /// and answer with the applied object plus server-set fields and `status`.
    async fn expect_apply(&mut self, path: &str, status: Option<Value>) -> Value {
        let (seen, send) = self.expect(Method::PATCH, path).await;
        assert_eq!(
            seen.query.get("fieldManager").map(String::as_str),
            Some("kvpool-operator")
        );
        assert_eq!(
            seen.query.get("force").map(String::as_str),
            Some("true"),
            "{path}"
        );
        let mut object = seen.body.clone();
        object["metadata"]["resourceVersion"] = json!("1001");
        object["metadata"]["uid"] = json!("00000000-0000-4000-8000-00000000beef");
        if let Some(status) = status {
            object["status"] = status;
        }
        reply(send, StatusCode::OK, &object);
        seen.body
    }

    /// Expect a server-side apply of the status subresource of `object` and answer with the
    /// whole object carrying the applied status (as the API server does).
    async fn expect_status(&mut self, path: &str, object: &Value) -> Value {
        let (seen, send) = self.expect(Method::PATCH, path).await;
        assert!(path.ends_with("/status"), "{path}");
        assert_eq!(
            seen.query.get("fieldManager").map(String::as_str),
            Some("kvpool-operator")
        );
        assert_eq!(seen.query.get("force").map(String::as_str), Some("true"));
        assert!(
            seen.body.get("spec").is_none(),
            "a status write carries no spec: {}",
            seen.body
        );
        let mut reply_obj = object.clone();
        reply_obj["status"] = seen.body["status"].clone();
        reply_obj["metadata"]["resourceVersion"] = json!("1003");
        reply(send, StatusCode::OK, &reply_obj);
        seen.body
    }

    /// Expect the applies of the Service and then the Deployment `name` in `namespace`, the
    /// Deployment answered with `status`; returns the Deployment applied.
    async fn expect_workload(&mut self, namespace: &str, name: &str, status: Value) -> Value {
        let service = format!("/api/v1/namespaces/{namespace}/services/{name}");
        self.expect_apply(&service, None).await;
        let deployment = format!("/apis/apps/v1/namespaces/{namespace}/deployments/{name}");
        self.expect_apply(&deployment, Some(status)).await
    }

    /// An engine pool's children: its NetworkPolicy (the engine pods' ingress: everything from
    /// the pool's own pods), then [`Self::expect_workload`].
    async fn expect_engine_workload(
        &mut self,
        namespace: &str,
        name: &str,
        status: Value,
    ) -> Value {
        let policy =
            format!("/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies/{name}");
        let applied = self.expect_apply(&policy, None).await;
        assert_eq!(applied["spec"]["policyTypes"], json!(["Ingress"]));
        let from_pool = &applied["spec"]["ingress"][0];
        assert!(
            from_pool["ports"].is_null(),
            "every port from the pool's pods: {applied}"
        );
        assert!(
            from_pool["from"][0]["podSelector"]["matchLabels"]["kvpool.dev/pool"].is_string(),
            "{applied}"
        );
        self.expect_workload(namespace, name, status).await
    }

    /// Expect a GET of `path` and answer with `object`.
    /// GET of the `roce` KVCachePool an engine pool names, answered with `pool`.
    async fn expect_roce_pool(&mut self, pool: &Value) {
        self.expect_get(&format!("{POOLS}/kvcachepools/roce"), pool)
            .await;
    }

    /// The status write of the `roce` KVCachePool; returns the status body.
    async fn expect_roce_status(&mut self, object: &Value) -> Value {
        self.expect_status(&format!("{POOLS}/kvcachepools/roce/status"), object)
            .await
    }

    /// The status write of the `qwen` DecodePool; returns the status body.
    async fn expect_decode_status(&mut self, object: &Value) -> Value {
        self.expect_status(&format!("{POOLS}/decodepools/qwen/status"), object)
            .await
    }

    async fn expect_get(&mut self, path: &str, object: &Value) {
        let (_, send) = self.expect(Method::GET, path).await;
        reply(send, StatusCode::OK, object);
    }

    /// Expect a label-selected list and answer with `items`.
    async fn expect_list(&mut self, path: &str, selector: &str, kind: &str, items: Vec<Value>) {
        // `/apis/<group>/<version>/...` or `/api/v1/...`.
        let api_version = match path.strip_prefix("/apis/") {
            Some(rest) => rest.splitn(3, '/').take(2).collect::<Vec<_>>().join("/"),
            None => "v1".to_owned(),
        };
        let (seen, send) = self.expect(Method::GET, path).await;
        assert_eq!(
            seen.query.get("labelSelector").map(String::as_str),
            Some(selector)
        );
        reply(
            send,
            StatusCode::OK,
            &json!({"apiVersion": api_version, "kind": kind, "metadata": {"resourceVersion": "1002"}, "items": items}),
        );
    }

    /// The lists of every PrefillPool and then every DecodePool in `namespace` (whole: the
    /// operator filters by `kvCachePoolRef` itself), answered with `prefill` and `decode`.
    async fn expect_engine_pools_in(
        &mut self,
        namespace: &str,
        prefill: Vec<Value>,
        decode: Vec<Value>,
    ) {
        for (resource, kind, items) in [
            ("prefillpools", "PrefillPoolList", prefill),
            ("decodepools", "DecodePoolList", decode),
        ] {
            let path = format!("/apis/kvpool.dev/v1alpha1/namespaces/{namespace}/{resource}");
            let (seen, send) = self.expect(Method::GET, &path).await;
            assert!(
                !seen.query.contains_key("labelSelector")
                    && !seen.query.contains_key("fieldSelector"),
                "{seen:?}"
            );
            reply(
                send,
                StatusCode::OK,
                &json!({"apiVersion": "kvpool.dev/v1alpha1", "kind": kind,
                        "metadata": {"resourceVersion": "1002"}, "items": items}),
            );
        }
    }

    /// [`Self::expect_engine_pools_in`] `llm`.
    async fn expect_engine_pools(&mut self, prefill: Vec<Value>, decode: Vec<Value>) {
        self.expect_engine_pools_in("llm", prefill, decode).await;
    }

    /// Expect an Event created in `llm`, answer 201 with it, and return it.
    async fn expect_event(&mut self) -> Value {
        let (seen, send) = self
            .expect(Method::POST, "/apis/events.k8s.io/v1/namespaces/llm/events")
            .await;
        reply(send, StatusCode::CREATED, &seen.body);
        seen.body
    }

    /// The lists by which an engine pool in `namespace` looks for orphaned Deployments,
    /// Services and NetworkPolicies (selected by `selector`), answered empty.
    async fn expect_no_engine_orphans(&mut self, namespace: &str, selector: &str) {
        let deployments = format!("/apis/apps/v1/namespaces/{namespace}/deployments");
        self.expect_list(&deployments, selector, "DeploymentList", vec![])
            .await;
        let services = format!("/api/v1/namespaces/{namespace}/services");
        self.expect_list(&services, selector, "ServiceList", vec![])
            .await;
        let policies = format!("/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies");
        self.expect_list(&policies, selector, "NetworkPolicyList", vec![])
            .await;
    }

    /// Expect a DELETE of `path` in the background (dependents collected after the owner) and
    /// answer with `object`.
    async fn expect_delete(&mut self, path: &str, object: &Value) {
        let (seen, send) = self.expect(Method::DELETE, path).await;
        assert_eq!(seen.body["propagationPolicy"], "Background", "{path}");
        reply(send, StatusCode::OK, object);
    }

    /// After the reconcile returned and every client was dropped: nothing else was sent.
    async fn expect_done(mut self) {
        if let Some((request, _)) = self.handle.next_request().await {
            assert!(
                !request.uri().path().contains("/secrets") || request.method() == Method::POST,
                "the operator must not {} a Secret: {}",
                request.method(),
                request.uri()
            );
            panic!(
                "unexpected extra request {} {}",
                request.method(),
                request.uri()
            );
        }
    }
}

fn reply(send: tower_test::mock::SendResponse<Response<Body>>, code: StatusCode, body: &Value) {
    let bytes = serde_json::to_vec(body).expect("json");
    send.send_response(
        Response::builder()
            .status(code)
            .header("content-type", "application/json")
            .body(Body::from(bytes))
            .expect("response"),
    );
}

/// The condition of `type_` in a status write's body.
fn condition<'a>(body: &'a Value, type_: &str) -> &'a Value {
    body["status"]["conditions"]
        .as_array()
        .expect("conditions")
        .iter()
        .find(|c| c["type"] == type_)
        .unwrap_or_else(|| panic!("{type_} condition"))
}

/// A status write of an engine pool that cannot be reconciled: Ready carries `reason`, and its
/// message names `field`.
fn assert_not_ready_because(body: &Value, reason: &str, field: &str) {
    let ready = condition(body, "Ready");
    assert_eq!(ready["reason"], reason);
    let message = ready["message"].as_str().expect("message");
    assert!(message.contains(field), "{message}");
}

fn status_error(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

fn double() -> (Context, ApiServer) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(service, "default");
    (Context::for_tests(client), ApiServer { handle })
}

/// The KVCachePool controller's pass over `pool`, as the work of [`drive`].
fn pool_pass(pool: KVCachePool) -> impl AsyncFnOnce(Arc<Context>) -> OperatorResult<Outcome> {
    async move |ctx: Arc<Context>| cachepool::reconcile_pool(&pool, &ctx).await
}

/// The engine-pool controller's pass over `engine`, as the work of [`drive`].
fn engine_pass<K: EnginePool>(
    engine: K,
) -> impl AsyncFnOnce(Arc<Context>) -> OperatorResult<enginepool::Outcome> {
    async move |ctx: Arc<Context>| enginepool::reconcile_engine_pool(&engine, &ctx).await
}

/// `work` (a reconcile), bounded by a timeout that only turns a missing reply into a failure
/// instead of a hang.
async fn finishing<T>(work: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(std::time::Duration::from_secs(60), work)
        .await
        .expect("reconcile finished (a request left unanswered would hang it)")
}

/// Run `scenario` as the API server while `work` runs against the double's context, prepared by
/// `setup` (both polled on this task); then, with the context dropped, check that no request was
/// left over. Returns what each returned.
async fn drive_with<T, R, W, S>(setup: impl FnOnce(&mut Context), work: W, scenario: S) -> (T, R)
where
    W: AsyncFnOnce(Arc<Context>) -> T,
    S: AsyncFnOnce(&mut ApiServer) -> R,
{
    let (mut ctx, mut server) = double();
    setup(&mut ctx);
    let ctx = Arc::new(ctx);
    // Boxed: a reconcile's future is large, and debug builds copy it on the stack.
    let (out, seen) = tokio::join!(finishing(Box::pin(work(ctx))), scenario(&mut server));
    server.expect_done().await;
    (out, seen)
}

/// [`drive_with`] on the double's context as it is.
async fn drive_both<T, R, W, S>(work: W, scenario: S) -> (T, R)
where
    W: AsyncFnOnce(Arc<Context>) -> T,
    S: AsyncFnOnce(&mut ApiServer) -> R,
{
    drive_with(|_| {}, work, scenario).await
}

/// [`drive_both`] for a scenario that only answers: what `work` returned.
async fn drive<T, W, S>(work: W, scenario: S) -> T
where
    W: AsyncFnOnce(Arc<Context>) -> T,
    S: AsyncFnOnce(&mut ApiServer),
{
    drive_both(work, scenario).await.0
}

const NS: &str = "/api/v1/namespaces/llm";
const APPS: &str = "/apis/apps/v1/namespaces/llm";
const POOLS: &str = "/apis/kvpool.dev/v1alpha1/namespaces/llm";
const RBAC: &str = "/apis/rbac.authorization.k8s.io/v1/namespaces/llm";
const NET: &str = "/apis/networking.k8s.io/v1/namespaces/llm";
const OWNED_BY_ROCE: &str = "app.kubernetes.io/managed-by=kvpool-operator,kvpool.dev/owner-kind=KVCachePool,kvpool.dev/owner-name=roce";

fn ds_status(ready: i32, desired: i32) -> Value {
    json!({"desiredNumberScheduled": desired, "numberReady": ready, "currentNumberScheduled": desired,
           "numberMisscheduled": 0})
}

fn deploy_status(ready: i32) -> Value {
    json!({"replicas": ready, "readyReplicas": ready})
}

/// The pool key of the roce fixture (`llm/roce` and its uid) derived from the test root key:
/// the key the operator puts in a new Secret and signs with.
fn stored_key() -> String {
    kvpool_operator::root_key::RootKey::for_tests().pool_key_hex(
        "llm",
        "roce",
        "6f1d2c3b-0000-4000-8000-000000000001",
    )
}

/// The applies of the roce pool's master (Service, then Deployment with 3 ready) and agents
/// (DaemonSet with `agents_ready` of 4 ready); returns the DaemonSet applied.
async fn master_and_agents(server: &mut ApiServer, agents_ready: i32) -> Value {
    server
        .expect_workload("llm", "roce-master", deploy_status(3))
        .await;
    let agent = format!("{APPS}/daemonsets/roce-agent");
    server
        .expect_apply(&agent, Some(ds_status(agents_ready, 4)))
        .await
}

/// The requests of a successful KVCachePool pass up to (not including) the status write.
/// Returns the bodies of the applied DaemonSet and of the secret create.
async fn pool_children(
    server: &mut ApiServer,
    agents_ready: i32,
    secret_exists: bool,
) -> (Value, Value) {
    let (agent, secret, _) =
        pool_children_using(server, agents_ready, secret_exists, vec![], vec![]).await;
    (agent, secret)
}

/// [`pool_children`] of a pool used by the engine pools `prefill` and `decode` (what the lists
/// of PrefillPools and DecodePools answer); returns the bodies of the applied DaemonSet, the
/// secret create and the conductor Deployment.
async fn pool_children_using(
    server: &mut ApiServer,
    agents_ready: i32,
    secret_exists: bool,
    prefill: Vec<Value>,
    decode: Vec<Value>,
) -> (Value, Value, Value) {
    server.expect_engine_pools(prefill, decode).await;
    let (seen, send) = server.expect(Method::POST, &format!("{NS}/secrets")).await;
    assert_eq!(
        seen.query.get("fieldManager").map(String::as_str),
        Some("kvpool-operator")
    );
    let secret = seen.body.clone();
    if secret_exists {
        reply(
            send,
            StatusCode::CONFLICT,
            &status_error(409, "AlreadyExists", "secrets \"roce-auth\" already exists"),
        );
        // Nothing is read back: the key is derived again.
    } else {
        reply(send, StatusCode::CREATED, &seen.body);
    }
    server
        .expect_apply(&format!("{NS}/configmaps/roce-config"), None)
        .await;
    // The NetworkPolicies before the pods they protect.
    for component in ["master", "agent", "conductor"] {
        let policy = server
            .expect_apply(&format!("{NET}/networkpolicies/roce-{component}"), None)
            .await;
        assert_eq!(policy["apiVersion"], "networking.k8s.io/v1");
        assert_eq!(policy["kind"], "NetworkPolicy");
    }
    let agent = master_and_agents(server, agents_ready).await;
    // The conductor's identity first, then the conductor.
    let sa = server
        .expect_apply(&format!("{NS}/serviceaccounts/roce-conductor"), None)
        .await;
    assert_eq!(sa["kind"], "ServiceAccount");
    let role = server
        .expect_apply(&format!("{RBAC}/roles/roce-conductor"), None)
        .await;
    assert_eq!(role["rules"][0]["verbs"], json!(["list", "watch"]));
    let binding = server
        .expect_apply(&format!("{RBAC}/rolebindings/roce-conductor"), None)
        .await;
    assert_eq!(binding["subjects"][0]["name"], "roce-conductor");
    let conductor = server
        .expect_workload("llm", "roce-conductor", deploy_status(2))
        .await;
    assert_eq!(
        conductor["spec"]["template"]["spec"]["serviceAccountName"],
        "roce-conductor"
    );
    server
        .expect_list(
            &format!("{APPS}/deployments"),
            OWNED_BY_ROCE,
            "DeploymentList",
            vec![],
        )
        .await;
    server
        .expect_list(
            &format!("{NS}/services"),
            OWNED_BY_ROCE,
            "ServiceList",
            vec![],
        )
        .await;
    server
        .expect_list(
            &format!("{NET}/networkpolicies"),
            OWNED_BY_ROCE,
            "NetworkPolicyList",
            vec![],
        )
        .await;
    (agent, secret, conductor)
}

#[tokio::test]
async fn create_applies_every_child_and_writes_status() {
    let pool: KVCachePool = fixture("kvcachepool-roce.yaml");
    let pool_json = serde_json::to_value(&pool).expect("json");
    let (outcome, status) = drive_both(
        pool_pass(pool),
        async move |server: &mut ApiServer| {
            let (agent, secret) = pool_children(server, 2, false).await;
            // The key: derived from the root key for llm/roce/<uid>, hex, base64 in the data.
            let key = secret["data"]["key"].as_str().expect("key");
            assert_eq!(key.len(), 88, "base64 of 64 hex characters: {key}");
            let stored: k8s_openapi::ByteString =
                serde_json::from_value(secret["data"]["key"].clone()).expect("base64");
            assert_eq!(stored.0, stored_key().into_bytes());
            assert_eq!(
                secret["metadata"]["annotations"]["kvpool.dev/auth-derivation"],
                "v1"
            );
            for role in ["agent", "engine", "conductor", "observer"] {
                assert!(secret["data"][role].is_string(), "no {role} item: {secret}");
            }
            // Each workload mounts its own item only.
            let items = &agent["spec"]["template"]["spec"]["volumes"];
            let auth = items
                .as_array()
                .and_then(|v| v.iter().find(|v| v["name"] == "auth"))
                .expect("auth volume");
            assert_eq!(auth["secret"]["items"], json!([{"key": "agent", "path": "key"}]));
            assert_eq!(secret["metadata"]["ownerReferences"][0]["kind"], "KVCachePool");
            // The applied DaemonSet is the built one, apiVersion and kind included (SSA needs them).
            assert_eq!(agent["apiVersion"], "apps/v1");
            assert_eq!(agent["kind"], "DaemonSet");
            assert_eq!(
                agent["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"][0],
                "IPC_LOCK"
            );
            let body = server.expect_roce_status(&pool_json).await;
            assert_eq!(body["apiVersion"], "kvpool.dev/v1alpha1");
            assert_eq!(body["kind"], "KVCachePool");
            body["status"].clone()
        },
    )
    .await;
    // The test twin's master never answers: the pass succeeds and says so.
    assert_eq!(outcome.expect("reconcile"), Outcome::ReconciledWithoutUsage);
    let status: KVCachePoolStatus = serde_json::from_value(status).expect("status parses");
    assert_eq!((status.nodes_ready, status.nodes_desired), (2, 4));
    assert_eq!(status.observed_generation, Some(3));
    assert_eq!(
        kvpool_crd::conditions::status_and_reason(&status.conditions, "Ready"),
        Some(("False", "ReplicasUnavailable"))
    );
    let progressing =
        kvpool_crd::conditions::find(&status.conditions, "Progressing").expect("Progressing");
    assert_eq!(progressing.status, "True");
}

/// One pass over `pool` whose children come back with `agents_ready` of 4 agents ready (and the
/// auth Secret created, or found when `secret_exists`): the status it writes.
async fn status_after_pass(
    pool: KVCachePool,
    agents_ready: i32,
    secret_exists: bool,
) -> KVCachePoolStatus {
    let pool_json = serde_json::to_value(&pool).expect("json");
    let (outcome, status) = drive_both(pool_pass(pool), async move |server: &mut ApiServer| {
        pool_children(server, agents_ready, secret_exists).await;
        let body = server.expect_roce_status(&pool_json).await;
        body["status"].clone()
    })
    .await;
    outcome.expect("pass");
    serde_json::from_value(status).expect("status")
}

/// First pass writes status; a second pass over the object carrying that status, with the same
/// children, writes nothing; a third, with all agents ready, writes Ready=True.
#[tokio::test]
async fn status_is_written_only_when_it_changes() {
    let mut pool: KVCachePool = fixture("kvcachepool-roce.yaml");
    let first = status_after_pass(pool.clone(), 2, false).await;
    pool.status = Some(first.clone());

    // Same children, secret already there (409): no status write.
    let again = pool.clone();
    drive(pool_pass(again), async move |server: &mut ApiServer| {
        pool_children(server, 2, true).await;
    })
    .await
    .expect("second pass");

    // All agents ready: Ready flips, and only the flipped conditions get a new time.
    let third = status_after_pass(pool.clone(), 4, true).await;
    assert!(kvpool_crd::conditions::is_true(&third.conditions, "Ready"));
    let degraded_before = kvpool_crd::conditions::find(&first.conditions, "Degraded").expect("d");
    let degraded_after = kvpool_crd::conditions::find(&third.conditions, "Degraded").expect("d");
    assert_eq!(
        (
            &degraded_before.status,
            &degraded_before.last_transition_time
        ),
        (&degraded_after.status, &degraded_after.last_transition_time),
        "Degraded did not flip: status and transition time kept"
    );
}

#[tokio::test]
async fn children_of_a_feature_turned_off_are_deleted_by_label() {
    let mut pool: KVCachePool = fixture("kvcachepool-roce.yaml");
    pool.spec.conductor.enabled = false;
    let pool_json = serde_json::to_value(&pool).expect("json");
    drive(pool_pass(pool), async move |server: &mut ApiServer| {
        server.expect_engine_pools(vec![], vec![]).await;
        let (_, send) = server.expect(Method::POST, &format!("{NS}/secrets")).await;
        reply(
            send,
            StatusCode::CONFLICT,
            &status_error(409, "AlreadyExists", "exists"),
        );
        server
            .expect_apply(&format!("{NS}/configmaps/roce-config"), None)
            .await;
        // The master's and agents' policies only.
        for component in ["master", "agent"] {
            server
                .expect_apply(&format!("{NET}/networkpolicies/roce-{component}"), None)
                .await;
        }
        master_and_agents(server, 4).await;
        // No conductor applies; the leftover conductor is listed and deleted.
        let item = |kind: &str, name: &str| {
            let api_version = match kind {
                "Deployment" => "apps/v1",
                "Role" | "RoleBinding" => "rbac.authorization.k8s.io/v1",
                "NetworkPolicy" => "networking.k8s.io/v1",
                _ => "v1",
            };
            json!({"apiVersion": api_version, "kind": kind,
                    "metadata": {"name": name, "namespace": "llm"}})
        };
        // Listed by label, the conductor's children of each kind are deleted and the others
        // stay: its identity first (RoleBinding, Role, ServiceAccount), then its Deployment,
        // Service and NetworkPolicy. The Service is already gone by the time it is deleted: fine.
        let conductor_only = &["roce-conductor"][..];
        let with_master = &["roce-master", "roce-conductor"][..];
        let policies = &["roce-master", "roce-agent", "roce-conductor"][..];
        for (base, resource, kind, listed) in [
            (RBAC, "rolebindings", "RoleBinding", conductor_only),
            (RBAC, "roles", "Role", conductor_only),
            (NS, "serviceaccounts", "ServiceAccount", conductor_only),
            (APPS, "deployments", "Deployment", with_master),
            (NS, "services", "Service", with_master),
            (NET, "networkpolicies", "NetworkPolicy", policies),
        ] {
            let items = listed.iter().map(|name| item(kind, name)).collect();
            let list = format!("{base}/{resource}");
            server
                .expect_list(&list, OWNED_BY_ROCE, &format!("{kind}List"), items)
                .await;
            let gone = format!("{list}/roce-conductor");
            if kind == "Service" {
                let (_, send) = server.expect(Method::DELETE, &gone).await;
                let not_found = status_error(404, "NotFound", "gone");
                reply(send, StatusCode::NOT_FOUND, &not_found);
            } else {
                server
                    .expect_delete(&gone, &item(kind, "roce-conductor"))
                    .await;
            }
        }
        let body = server.expect_roce_status(&pool_json).await;
        assert!(body["status"].get("conductorEndpoint").is_none(), "{body}");
    })
    .await
    .expect("reconcile");
}

#[tokio::test]
async fn invalid_spec_gets_an_event_and_a_condition_and_no_children() {
    let mut pool: KVCachePool = fixture("kvcachepool-roce.yaml");
    pool.spec.eviction.low_watermark_percent = 96;
    let pool_json = serde_json::to_value(&pool).expect("json");
    let outcome = drive(
        async move |ctx: Arc<Context>| {
            let out = cachepool::reconcile_pool(&pool, &ctx).await;
            assert_eq!(
                ctx.metrics.reconciles("KVCachePool", "invalid"),
                0,
                "counted by reconcile()"
            );
            out
        },
        async move |server: &mut ApiServer| {
            let event = server.expect_event().await;
            assert_eq!(event["type"], "Warning");
            assert_eq!(event["reason"], "InvalidSpec");
            assert_eq!(event["regarding"]["kind"], "KVCachePool");
            assert_eq!(event["regarding"]["name"], "roce");
            let note = event["note"].as_str().expect("note");
            assert!(note.contains("eviction.lowWatermarkPercent"), "{note}");
            assert_eq!(event["reportingController"], "kvpool-operator");
            let body = server.expect_roce_status(&pool_json).await;
            let ready = condition(&body, "Ready");
            assert_eq!(ready["status"], "False");
            assert_eq!(ready["reason"], "InvalidSpec");
            let degraded = condition(&body, "Degraded");
            assert_eq!(degraded["status"], "True");
        },
    )
    .await
    .expect("reconcile");
    assert_eq!(outcome, Outcome::Invalid);
}

#[tokio::test]
async fn an_object_being_deleted_is_left_to_the_garbage_collector() {
    let mut pool: KVCachePool = fixture("kvcachepool-roce.yaml");
    pool.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::from_second(Context::TEST_TIME).expect("ts"),
    ));
    let outcome = drive(pool_pass(pool), async move |_server: &mut ApiServer| {})
        .await
        .expect("reconcile");
    assert_eq!(outcome, Outcome::Deleting);
}

#[tokio::test]
async fn transient_failures_back_off_per_object_and_are_counted() {
    let pool = Arc::new(fixture::<KVCachePool>("kvcachepool-tcp.yaml"));
    drive(
        async move |ctx: Arc<Context>| {
            let err = cachepool::reconcile(pool.clone(), ctx.clone())
                .await
                .expect_err("server error");
            assert_eq!(err.category(), "create");
            assert_eq!(ctx.metrics.failures("KVCachePool", "create"), 1);
            assert_eq!(ctx.metrics.reconciles("KVCachePool", "error"), 1);
            let first = cachepool::error_policy(pool.clone(), &err, ctx.clone());
            let second = cachepool::error_policy(pool.clone(), &err, ctx.clone());
            assert_eq!(
                first,
                kube::runtime::controller::Action::requeue(std::time::Duration::from_secs(5))
            );
            assert_eq!(
                second,
                kube::runtime::controller::Action::requeue(std::time::Duration::from_secs(10))
            );
            let invalid = kvpool_operator::error::Error::InvalidSpec("x".into());
            assert_eq!(
                cachepool::error_policy(pool, &invalid, ctx),
                kube::runtime::controller::Action::await_change()
            );
        },
        async move |server: &mut ApiServer| {
            server
                .expect_engine_pools_in("default", vec![], vec![])
                .await;
            let (_, send) = server
                .expect(Method::POST, "/api/v1/namespaces/default/secrets")
                .await;
            reply(
                send,
                StatusCode::INTERNAL_SERVER_ERROR,
                &status_error(500, "InternalError", "etcd timeout"),
            );
        },
    )
    .await;
}

const DEFAULT_NS: &str = "/api/v1/namespaces/default";

#[tokio::test]
async fn missing_pool_reference_is_reported_then_reconciled_when_the_pool_appears() {
    let prefill: PrefillPool = fixture("prefillpool-custom.yaml");
    let pool: KVCachePool = fixture("kvcachepool-tcp.yaml");

    // 1. The KVCachePool does not exist: Ready=False/KVCachePoolNotFound, nothing applied.
    let first = prefill.clone();
    let engine_json = serde_json::to_value(&first).expect("json");
    let (outcome, status) = drive_both(engine_pass(first), async move |server: &mut ApiServer| {
        let (_, send) = server
            .expect(
                Method::GET,
                "/apis/kvpool.dev/v1alpha1/namespaces/default/kvcachepools/tcp",
            )
            .await;
        reply(
            send,
            StatusCode::NOT_FOUND,
            &status_error(404, "NotFound", "kvcachepools.kvpool.dev \"tcp\" not found"),
        );
        let body = server
            .expect_status(
                "/apis/kvpool.dev/v1alpha1/namespaces/default/prefillpools/synthetic/status",
                &engine_json,
            )
            .await;
        body["status"].clone()
    })
    .await;
    assert_eq!(
        outcome.expect("reconcile"),
        enginepool::Outcome::PoolNotFound
    );
    let status: kvpool_crd::EnginePoolStatus = serde_json::from_value(status).expect("status");
    assert_eq!(
        kvpool_crd::conditions::status_and_reason(&status.conditions, "Ready"),
        Some(("False", "KVCachePoolNotFound"))
    );

    // 2. The watch mapping: a KVCachePool event maps to the engine pools that reference it.
    let (reader, mut writer) = reflector::store::<PrefillPool>();
    let mut other = prefill.clone();
    other.metadata.name = Some("elsewhere".into());
    other.spec.kv_cache_pool_ref.name = "another-pool".into();
    writer.apply_watcher_event(&watcher::Event::Apply(prefill.clone()));
    writer.apply_watcher_event(&watcher::Event::Apply(other));
    let mapped = enginepool::referencing(&reader, &pool);
    assert_eq!(mapped.len(), 1);
    assert_eq!(mapped[0].name, "synthetic");
    assert_eq!(mapped[0].namespace.as_deref(), Some("default"));

    // 3. The pool exists now: engine children applied, status says so.
    let mut second = prefill.clone();
    second.status = Some(status);
    let pool_json = serde_json::to_value(&pool).expect("pool json");
    let selector = "app.kubernetes.io/managed-by=kvpool-operator,kvpool.dev/owner-kind=PrefillPool,kvpool.dev/owner-name=synthetic";
    let engine_json = serde_json::to_value(&second).expect("json");
    let outcome = drive(
        engine_pass(second),
        async move |server: &mut ApiServer| {
            server
                .expect_get("/apis/kvpool.dev/v1alpha1/namespaces/default/kvcachepools/tcp", &pool_json)
                .await;
            server.expect_engine_pools_in("default", vec![engine_json.clone()], vec![]).await;
            let policy = server
                .expect_apply("/apis/networking.k8s.io/v1/namespaces/default/networkpolicies/synthetic-prefill", None)
                .await;
            // No conductor on the `tcp` pool: the namespace's pods may call the engines.
            assert_eq!(policy["spec"]["ingress"][1]["ports"][0]["port"], 8000, "{policy}");
            let svc = server.expect_apply(&format!("{DEFAULT_NS}/services/synthetic-prefill"), None).await;
            assert_eq!(svc["spec"]["ports"][0]["port"], 8000);
            let deploy = server
                .expect_apply("/apis/apps/v1/namespaces/default/deployments/synthetic-prefill",
                    Some(json!({"replicas": 1, "readyReplicas": 1})))
                .await;
            let container = &deploy["spec"]["template"]["spec"]["containers"][0];
            assert_eq!(container["command"], json!(["kvpool"]));
            assert_eq!(container["args"], json!(["engine", "--role", "prefill"]));
            let env = container["env"].as_array().expect("env");
            assert!(env.iter().any(|e| e["name"] == "KVPOOL_MASTER"
                && e["value"] == "tcp-master.default.svc:50051"));
            assert_eq!(deploy["metadata"]["ownerReferences"][0]["kind"], "PrefillPool");
            server.expect_no_engine_orphans("default", selector).await;
            let body = server.expect_status("/apis/kvpool.dev/v1alpha1/namespaces/default/prefillpools/synthetic/status", &engine_json).await;
            let ready = condition(&body, "Ready");
            assert_eq!(ready["status"], "True");
            assert_eq!(body["status"]["readyReplicas"], 1);
            assert_eq!(body["status"]["endpoints"][0], "synthetic-prefill.default.svc:8000");
            assert_eq!(
                body["status"]["selector"],
                "app.kubernetes.io/name=kvpool,kvpool.dev/component=prefill,kvpool.dev/instance=synthetic,kvpool.dev/pool=tcp"
            );
        },
    )
    .await
    .expect("reconcile");
    assert_eq!(outcome, enginepool::Outcome::Reconciled);
}

/// A pass of the engine-pool controller over `decode`, whose KVCachePool is `pool`, that runs
/// nothing: after the pool is read, `events` answers what the controller sends before its
/// status write. Returns the outcome and the body of that status write.
async fn refused_decode_pass(
    decode: DecodePool,
    pool: &KVCachePool,
    events: impl AsyncFnOnce(&mut ApiServer),
) -> (enginepool::Outcome, Value) {
    let pool_json = serde_json::to_value(pool).expect("json");
    let engine_json = serde_json::to_value(&decode).expect("json");
    let (outcome, body) = drive_both(engine_pass(decode), async move |server: &mut ApiServer| {
        server.expect_roce_pool(&pool_json).await;
        events(server).await;
        server.expect_decode_status(&engine_json).await
    })
    .await;
    (outcome.expect("reconcile"), body)
}

#[tokio::test]
async fn engine_pool_of_an_invalid_kvcachepool_waits_without_children() {
    let decode: DecodePool = fixture("decodepool-sglang.yaml");
    let mut pool: KVCachePool = fixture("kvcachepool-roce.yaml");
    pool.spec.master.etcd_endpoints.clear(); // 3 replicas without etcd
    let (outcome, body) = refused_decode_pass(decode, &pool, async |_| {}).await;
    assert_eq!(outcome, enginepool::Outcome::PoolInvalid);
    assert_not_ready_because(&body, "KVCachePoolInvalid", "master.etcdEndpoints");
}

#[tokio::test]
async fn invalid_engine_spec_gets_an_event_and_a_condition() {
    let mut decode: DecodePool = fixture("decodepool-sglang.yaml");
    decode.spec.resources.gpus = 3; // not a multiple of TP 2
    let pool: KVCachePool = fixture("kvcachepool-roce.yaml");
    let (outcome, body) = refused_decode_pass(decode, &pool, async |server| {
        let event = server.expect_event().await;
        assert_eq!(event["reason"], "InvalidSpec");
        assert_eq!(event["regarding"]["kind"], "DecodePool");
    })
    .await;
    assert_eq!(outcome, enginepool::Outcome::Invalid);
    assert_not_ready_because(&body, "InvalidSpec", "resources.gpus");
}

/// The engine-pool controller also writes status only when it changes: a second pass over the
/// object carrying the status of the first, with the same Deployment status, writes nothing.
#[tokio::test]
async fn engine_pool_status_is_not_rewritten_when_unchanged() {
    let pool_json =
        serde_json::to_value(fixture::<KVCachePool>("kvcachepool-roce.yaml")).expect("json");
    let selector = "app.kubernetes.io/managed-by=kvpool-operator,kvpool.dev/owner-kind=DecodePool,kvpool.dev/owner-name=qwen";
    async fn children(server: &mut ApiServer, pool_json: &Value, selector: &str) {
        server.expect_roce_pool(pool_json).await;
        server.expect_engine_pools(vec![], vec![]).await;
        let deploy = server
            .expect_engine_workload(
                "llm",
                "qwen-decode",
                json!({"replicas": 3, "readyReplicas": 2}),
            )
            .await;
        let c = &deploy["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "2");
        server.expect_no_engine_orphans("llm", selector).await;
    }

    let first: DecodePool = fixture("decodepool-sglang.yaml");
    let engine_json = serde_json::to_value(&first).expect("json");
    let pool = pool_json.clone();
    let (outcome, status) = drive_both(engine_pass(first), async move |server: &mut ApiServer| {
        children(server, &pool, selector).await;
        let body = server.expect_decode_status(&engine_json).await;
        body["status"].clone()
    })
    .await;
    outcome.expect("first pass");
    let status: kvpool_crd::EnginePoolStatus = serde_json::from_value(status).expect("status");
    assert_eq!((status.replicas, status.ready_replicas), (3, 2));
    let progressing =
        kvpool_crd::conditions::find(&status.conditions, "Progressing").expect("Progressing");
    assert_eq!(progressing.status, "True");

    let mut second: DecodePool = fixture("decodepool-sglang.yaml");
    second.status = Some(status);
    let outcome = drive(engine_pass(second), async move |server: &mut ApiServer| {
        children(server, &pool_json, selector).await
    })
    .await
    .expect("second pass");
    assert_eq!(outcome, enginepool::Outcome::Reconciled);
}

/// An update (a new generation with a changed setting) re-applies the children with the new
/// values: the agent pods' config hash changes, so they roll, and status reports the new
/// generation.
#[tokio::test]
async fn update_reapplies_children_and_reports_the_new_generation() {
    async fn pass(pool: KVCachePool) -> (Value, Value) {
        let pool_json = serde_json::to_value(&pool).expect("json");
        let (outcome, written) =
            drive_both(pool_pass(pool), async move |server: &mut ApiServer| {
                let (agent, _) = pool_children(server, 4, true).await;
                let body = server.expect_roce_status(&pool_json).await;
                (agent, body["status"].clone())
            })
            .await;
        outcome.expect("reconcile");
        written
    }
    let before: KVCachePool = fixture("kvcachepool-roce.yaml");
    let mut after = before.clone();
    after.spec.block_size_tokens = 1024;
    after.metadata.generation = Some(4);
    let (agent_before, status_before) = pass(before).await;
    let (agent_after, status_after) = pass(after).await;
    let hash = |ds: &Value| {
        ds["spec"]["template"]["metadata"]["annotations"]["kvpool.dev/config-hash"].clone()
    };
    assert_ne!(hash(&agent_before), hash(&agent_after), "agent pods roll");
    assert_eq!(status_before["observedGeneration"], 3);
    assert_eq!(status_after["observedGeneration"], 4);
    let ready = status_after["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
        .expect("Ready");
    assert_eq!(ready["observedGeneration"], 4);
}

/// One pass of the roce pool over existing children and Secret, with `ctx` prepared by `setup`;
/// returns the outcome and the status written.
async fn usage_pass(
    setup: impl FnOnce(&mut Context),
    previous: Option<KVCachePoolStatus>,
) -> (Outcome, KVCachePoolStatus) {
    let mut pool: KVCachePool = fixture("kvcachepool-roce.yaml");
    pool.status = previous;
    usage_pass_of(pool, setup).await
}

/// [`usage_pass`] over `pool` as given.
async fn usage_pass_of(
    pool: KVCachePool,
    setup: impl FnOnce(&mut Context),
) -> (Outcome, KVCachePoolStatus) {
    let pool_json = serde_json::to_value(&pool).expect("json");
    let (outcome, status) = drive_with(
        setup,
        pool_pass(pool),
        async move |server: &mut ApiServer| {
            pool_children(server, 4, true).await;
            let body = server.expect_roce_status(&pool_json).await;
            body["status"].clone()
        },
    )
    .await;
    let status = serde_json::from_value(status).expect("status");
    (outcome.expect("reconcile"), status)
}

/// The master's own figures in `status` (objects, registered nodes, hit ratio and lookups),
/// with `MasterReachable=True`.
fn assert_master_figures(
    status: &KVCachePoolStatus,
    objects: i64,
    nodes: i32,
    hit_ratio: &str,
    lookups: i64,
) {
    assert_eq!(
        (status.objects, status.nodes_registered),
        (Some(objects), Some(nodes))
    );
    assert_eq!(
        (status.hit_ratio.as_deref(), status.lookups),
        (Some(hit_ratio), Some(lookups))
    );
    assert!(kvpool_crd::conditions::is_true(
        &status.conditions,
        "MasterReachable"
    ));
}

/// `TransportDegraded=True` naming gpu-1 (of two reporting nodes) and its reason.
fn assert_gpu_1_fell_back(status: &KVCachePoolStatus) {
    let t = kvpool_crd::conditions::find(&status.conditions, "TransportDegraded")
        .expect("TransportDegraded condition");
    assert_eq!(
        (t.status.as_str(), t.reason.as_str()),
        ("True", "RdmaFallback")
    );
    assert_eq!(
        t.message,
        "1 of 2 reporting nodes fell back from RDMA to TCP: gpu-1 (no usable RDMA device on this host)"
    );
}

/// A usage reader that records the address and key it was called with.
struct Recording {
    usage: Option<cachepool::usage::PoolUsage>,
    calls: std::sync::Mutex<Vec<String>>,
}

impl cachepool::usage::MasterStats for Recording {
    fn stats<'a>(
        &'a self,
        addr: &'a str,
        _tls: Option<&'a kvpool_crd::MasterTlsSpec>,
        key: kvpool_proto::auth::AuthKey,
    ) -> futures::future::BoxFuture<
        'a,
        Result<cachepool::usage::PoolUsage, cachepool::usage::UsageError>,
    > {
        // The observer's key of the derived pool key (a signature with it verifies).
        let verifier = kvpool_proto::auth::Verifier::new(
            &kvpool_proto::auth::AuthKey::from_bytes(stored_key().as_bytes()).expect("key"),
        )
        .expect("pool key");
        assert_eq!(
            key.role(),
            Role::Observer,
            "the least power that reads Stats"
        );
        assert!(
            verifier.verify(Some(&key.sign("Stats")), "Stats").is_ok(),
            "signed with the derived key"
        );
        self.calls.lock().expect("lock").push(addr.to_owned());
        let answer = self
            .usage
            .clone()
            .ok_or_else(|| cachepool::usage::UsageError::Timeout {
                addr: addr.to_owned(),
                timeout: std::time::Duration::ZERO,
            });
        Box::pin(std::future::ready(answer))
    }
}

#[tokio::test]
async fn usage_is_read_from_the_master_with_the_stored_key_and_kept_when_it_goes_silent() {
    let usage = cachepool::usage::PoolUsage {
        dram_used: 3 << 30,
        dram_capacity: 2 << 40,
        ssd_used: 1 << 30,
        ssd_capacity: 6 << 40,
        objects: 12,
        nodes_alive: 4,
        segments: 8,
        lookup_hits: 9,
        lookup_misses: 1,
        transport: vec![
            cachepool::usage::NodeTransport {
                node: "gpu-0".into(),
                rdma_requested: true,
                devices: vec!["mlx5_0".into()],
                ..Default::default()
            },
            cachepool::usage::NodeTransport {
                node: "gpu-1".into(),
                rdma_requested: true,
                fallback: true,
                reason: "no usable RDMA device on this host".into(),
                devices: vec![],
            },
        ],
        ..Default::default()
    };
    let reader = Arc::new(Recording {
        usage: Some(usage),
        calls: Default::default(),
    });
    let r = reader.clone();
    let slot = Arc::new(std::sync::Mutex::new(None));
    let metrics_out = slot.clone();
    let (outcome, first) = usage_pass(
        move |ctx| {
            ctx.master_stats = r;
            *metrics_out.lock().expect("lock") = Some(ctx.metrics.clone());
        },
        None,
    )
    .await;
    let reader_metrics = slot.lock().expect("lock").clone().expect("metrics");
    assert_eq!(outcome, Outcome::Reconciled);
    assert_eq!(
        *reader.calls.lock().expect("lock"),
        vec!["roce-master.llm.svc:50051".to_owned()],
        "the master Service's cluster DNS address"
    );
    let dram = first.dram.clone().expect("dram");
    assert_eq!(
        (dram.used.0.as_str(), dram.capacity.0.as_str()),
        ("3Gi", "2Ti")
    );
    assert_eq!(first.ssd.as_ref().map(|s| s.used.0.as_str()), Some("1Gi"));
    assert_master_figures(&first, 12, 4, "0.900", 10);
    // The pool asked for RDMA and gpu-1 reported a fallback: the condition names it and why.
    assert_gpu_1_fell_back(&first);
    assert_eq!(
        reader_metrics.transport_degraded("llm", "roce"),
        1,
        "the alert's gauge counts the node"
    );

    // The master stops answering: the pass still succeeds (sooner requeue), figures are kept.
    let (outcome, second) = usage_pass(|_| {}, Some(first.clone())).await;
    assert_eq!(outcome, Outcome::ReconciledWithoutUsage);
    assert_eq!(second.dram, first.dram);
    assert_eq!(second.objects, Some(12));
    let c = kvpool_crd::conditions::find(&second.conditions, "MasterReachable").expect("c");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "MasterUnreachable")
    );
    assert!(
        c.message.contains("roce-master.llm.svc:50051"),
        "{}",
        c.message
    );
    assert_eq!(
        kvpool_crd::conditions::status_and_reason(&second.conditions, "TransportDegraded"),
        Some(("Unknown", "MasterUnreachable")),
        "nothing is known about the agents without the master"
    );
}

/// The whole path against a real master on 127.0.0.1: the Secret's key signs a real `Stats`
/// call and the status carries the master's own figures for the segments and object put there.
#[tokio::test]
async fn status_carries_the_figures_of_a_real_master() {
    use kvpool_client::master::{ClientConfig, MasterClient};
    use kvpool_core::master::{PutOptions, PutStarted, SegmentSpec, Tier};
    use kvpool_master::cmd::loopback_args as loopback_master_args;
    use kvpool_master::cmd::start;
    use kvpool_proto::auth::AuthKey;

    let dir = tempfile::tempdir().expect("tmp");
    let key_file = dir.path().join("key");
    std::fs::write(&key_file, stored_key()).expect("key");
    let args = loopback_master_args(key_file);
    let shutdown = tokio_util::sync::CancellationToken::new();
    let master = start(args.validate().expect("valid"), shutdown.clone())
        .await
        .expect("master starts");
    let addr = master.grpc_addr.to_string();
    let client = MasterClient::new(
        vec![addr.clone()],
        AuthKey::from_bytes(stored_key().as_bytes()).expect("key"),
        ClientConfig::default(),
    )
    .expect("client");
    const MIB: u64 = 1 << 20;
    for (node, tier, cap) in [
        ("gpu-0", Tier::Dram, 64 * MIB),
        ("gpu-1", Tier::Dram, 32 * MIB),
        ("gpu-0", Tier::Ssd, 256 * MIB),
    ] {
        let name = format!("{}0", tier.as_str());
        let endpoint = format!("tcp://{node}:15500");
        let segment = SegmentSpec::new(node, &name, tier, cap, endpoint);
        client.mount_segment(&segment).await.expect("mount");
    }
    let started = client
        .put_start(b"block/0", MIB, &PutOptions::default())
        .await
        .expect("put start");
    let PutStarted::Allocated { put_id, .. } = started else {
        panic!("unexpected {started:?}");
    };
    client.put_end(b"block/0", put_id).await.expect("put end");
    // gpu-1's agent reports with its heartbeat that it fell back to TCP; gpu-0 is on RDMA.
    for (node, fallback, devices) in [
        ("gpu-0", false, vec!["mlx5_0".to_owned()]),
        ("gpu-1", true, vec![]),
    ] {
        client
            .heartbeat_with_transport(
                node,
                Some(kvpool_proto::master::TransportReport {
                    rdma_requested: true,
                    fallback,
                    fallback_reason: if fallback {
                        "no usable RDMA device on this host".into()
                    } else {
                        String::new()
                    },
                    rdma_devices: devices,
                }),
            )
            .await
            .expect("heartbeat");
    }
    // Keys looked up: block/0 is held, the other two are not.
    let held: &[u8] = b"block/0";
    let found = client
        .exists(&[held, b"block/missing"])
        .await
        .expect("exists");
    assert_eq!(found, vec![true, false]);
    assert!(client.get(b"block/gone").await.is_err(), "unknown key");
    // One Get hit: it counts on the node that holds block/0 (hit ratio 1/2 of the Gets).
    let located = client.get(held).await.expect("get");
    let holder = located
        .replicas
        .first()
        .map(|r| r.node.clone())
        .expect("replica");
    let truth = client.stats().await.expect("stats");
    assert_eq!(
        (truth.lookup_hits, truth.lookup_misses),
        (2, 2),
        "{truth:?}"
    );
    assert_eq!((truth.get_hits, truth.get_misses), (1, 1), "{truth:?}");

    let (outcome, status) = usage_pass(
        move |ctx| {
            ctx.master_stats = Arc::new(cachepool::usage::GrpcMasterStats::default());
            ctx.master_addr_override = Some(addr);
        },
        None,
    )
    .await;
    shutdown.cancel();
    let _ = master.join().await;

    assert_eq!(outcome, Outcome::Reconciled);
    assert_gpu_1_fell_back(&status);
    assert_eq!(truth.capacity_bytes.first(), Some(&(96 * MIB)));
    let dram = status.dram.as_ref().expect("dram");
    assert_eq!(dram.capacity.0, "96Mi");
    assert_eq!(
        dram.used.0,
        kvpool_crd::quantity::format_bytes(truth.used_bytes[0]).0
    );
    assert!(truth.used_bytes[0] >= MIB, "{truth:?}");
    let ssd = status.ssd.as_ref().expect("ssd");
    assert_eq!(
        (ssd.capacity.0.as_str(), ssd.used.0.as_str()),
        ("256Mi", "0")
    );
    assert_master_figures(&status, 1, 2, "0.500", 4);
    // status.nodes, as patched: both nodes by name, their tiers and NUMA split, transport, and
    // the Get hit on the holder.
    assert_eq!(status.nodes_omitted, None);
    let names: Vec<&str> = status.nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["gpu-0", "gpu-1"]);
    let gpu0 = &status.nodes[0];
    assert_eq!(
        gpu0.ssd
            .as_ref()
            .map(|t| (t.capacity.0.as_str(), t.used.0.as_str())),
        Some(("256Mi", "0"))
    );
    let numa: Vec<(&str, &str, &str)> = gpu0
        .numa
        .iter()
        .map(|r| (r.numa_node.as_str(), r.tier.as_str(), r.capacity.0.as_str()))
        .collect();
    assert_eq!(numa, [("0", "dram", "64Mi"), ("0", "ssd", "256Mi")]);
    assert_eq!(
        status.nodes[1].dram.as_ref().map(|t| t.capacity.0.as_str()),
        Some("32Mi")
    );
    for n in &status.nodes {
        let expected = if n.name == holder { "0.500" } else { "0.000" };
        assert_eq!(n.hit_ratio.as_deref(), Some(expected), "{n:?}");
        let t = n.transport.as_ref().expect("transport reported");
        if n.name == "gpu-1" {
            assert_eq!(t.protocol, "tcp");
            assert_eq!(
                t.fallback_reason.as_deref(),
                Some("no usable RDMA device on this host")
            );
        } else {
            assert_eq!(
                (t.protocol.as_str(), t.fallback_reason.as_deref()),
                ("rdma", None)
            );
        }
    }
    // Per-node use adds up to the pool's.
    let used: u64 = truth.nodes.iter().map(|n| n.used_bytes[0]).sum();
    assert_eq!(used, truth.used_bytes[0]);
}

/// A pool whose auth Secret holds a key the operator did not derive (here: a random key, as
/// operators before the root key generated), against a real master on 127.0.0.1 holding that
/// key: the master refuses the derived observer credential, the pass still succeeds, a Warning
/// Event and `AuthKeyRejected=True` tell the user to delete the Secret; a second pass over that
/// status publishes no second Event and writes nothing.
#[tokio::test]
async fn a_key_the_operator_did_not_derive_is_reported_not_crash_looped() {
    use kvpool_master::cmd::loopback_args as loopback_master_args;
    use kvpool_master::cmd::start;

    let dir = tempfile::tempdir().expect("tmp");
    let key_file = dir.path().join("key");
    let legacy = "9f8e7d6c5b4a39281706f5e4d3c2b1a09f8e7d6c5b4a39281706f5e4d3c2b1a0";
    assert_ne!(legacy, stored_key());
    std::fs::write(&key_file, legacy).expect("key");
    let shutdown = tokio_util::sync::CancellationToken::new();
    let master = start(
        loopback_master_args(key_file).validate().expect("valid"),
        shutdown.clone(),
    )
    .await
    .expect("master starts");
    let addr = master.grpc_addr.to_string();

    let pass = async |previous: Option<KVCachePoolStatus>, event: bool| {
        let mut pool: KVCachePool = fixture("kvcachepool-roce.yaml");
        pool.status = previous.clone();
        let pool_json = serde_json::to_value(&pool).expect("json");
        let real_master = |ctx: &mut Context| {
            ctx.master_stats = Arc::new(cachepool::usage::GrpcMasterStats::default());
            ctx.master_addr_override = Some(addr.clone());
        };
        let (outcome, status) = drive_with(
            real_master,
            pool_pass(pool),
            async move |server: &mut ApiServer| {
                pool_children(server, 4, true).await;
                if event {
                    let event = server.expect_event().await;
                    assert_eq!(event["type"], "Warning");
                    assert_eq!(event["reason"], "AuthKeyRejected");
                    assert_eq!(event["regarding"]["name"], "roce");
                    let note = event["note"].as_str().expect("note");
                    assert!(
                        note.contains("kubectl -n llm delete secret roce-auth"),
                        "{note}"
                    );
                }
                if previous.is_none() {
                    let body = server.expect_roce_status(&pool_json).await;
                    return Some(body["status"].clone());
                }
                None
            },
        )
        .await;
        (
            outcome.expect("an refused key does not fail the pass"),
            status.map(|s| serde_json::from_value::<KVCachePoolStatus>(s).expect("status")),
        )
    };

    let (outcome, status) = pass(None, true).await;
    assert_eq!(outcome, Outcome::ReconciledWithoutUsage);
    let status = status.expect("status written");
    let c = kvpool_crd::conditions::find(&status.conditions, "AuthKeyRejected").expect("c");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", "DerivedKeyRefused")
    );
    for needle in [
        "roce-auth",
        "kvpool.dev/auth-derivation",
        "kubectl -n llm delete secret roce-auth",
        "restart",
    ] {
        assert!(c.message.contains(needle), "{needle}: {}", c.message);
    }
    assert_eq!(
        kvpool_crd::conditions::status_and_reason(&status.conditions, "MasterReachable"),
        Some(("False", "DerivedKeyRefused"))
    );

    // Still refused: no second Event, and the status is unchanged (nothing written).
    let (outcome, again) = pass(Some(status), false).await;
    assert_eq!(outcome, Outcome::ReconciledWithoutUsage);
    assert!(again.is_none());

    shutdown.cancel();
    let _ = master.join().await;
}

/// A pool with `spec.master.tls` against a real TLS master on 127.0.0.1: with the CA
/// (`--master-ca-file`) the operator reads its usage over TLS; without it the pass still
/// succeeds and `MasterReachable` says `no_master_ca`.
#[tokio::test]
async fn usage_of_a_tls_master_is_read_with_the_operators_ca() {
    use kvpool_master::cmd::loopback_args as loopback_master_args;
    use kvpool_master::cmd::start;

    let dir = tempfile::tempdir().expect("tmp");
    let files = kvpool_harness::tls::write_throwaway(dir.path(), "kvpool test CA", &["127.0.0.1"])
        .expect("certificates");
    let key_file = dir.path().join("key");
    std::fs::write(&key_file, stored_key()).expect("key");
    let mut args = loopback_master_args(key_file);
    args.tls_cert_file = Some(files.master_cert.clone());
    args.tls_key_file = Some(files.master_key.clone());
    let shutdown = tokio_util::sync::CancellationToken::new();
    let master = start(args.validate().expect("valid"), shutdown.clone())
        .await
        .expect("master starts");
    let addr = master.grpc_addr.to_string();

    let mut pool: KVCachePool = fixture("kvcachepool-roce.yaml");
    pool.spec.master.tls = Some(kvpool_crd::MasterTlsSpec {
        secret_name: "roce-master-tls".into(),
        client_secret_name: None,
        server_name: None,
    });
    let (a, ca) = (addr.clone(), files.ca.clone());
    let (outcome, status) = usage_pass_of(pool.clone(), move |ctx| {
        ctx.master_stats = Arc::new(cachepool::usage::GrpcMasterStats {
            ca_file: Some(ca),
            ..Default::default()
        });
        ctx.master_addr_override = Some(a);
    })
    .await;
    assert_eq!(outcome, Outcome::Reconciled);
    assert!(kvpool_crd::conditions::is_true(
        &status.conditions,
        "MasterReachable"
    ));

    let (outcome, status) = usage_pass_of(pool, move |ctx| {
        ctx.master_stats = Arc::new(cachepool::usage::GrpcMasterStats::default());
        ctx.master_addr_override = Some(addr);
    })
    .await;
    assert_eq!(outcome, Outcome::ReconciledWithoutUsage);
    let c = kvpool_crd::conditions::find(&status.conditions, "MasterReachable").expect("c");
    assert!(c.message.contains("no_master_ca"), "{}", c.message);
    shutdown.cancel();
    let _ = master.join().await;
}

/// What one autoscaled pass of the `qwen` DecodePool is expected to do.
struct ScalePass {
    /// Seconds after the test clock's start.
    at_s: i64,
    /// The conductor's answer (`None`: silent).
    p90_tpot_s: Option<f64>,
    /// The engine Deployment's replicas applied.
    replicas: i64,
    /// The Event published (`ScaledUp`/`ScaledDown`), if any; a status write goes with it.
    event: Option<&'static str>,
}

/// Decode load whose predicted TPOT p90 is `p90_s`.
fn decode_load(p90_s: f64) -> kvpool_core::autoscale::LoadReport {
    use kvpool_core::autoscale::{LoadFigures, LoadReport, RoleLoad};
    LoadReport {
        window_s: 30.0,
        prefill: RoleLoad::default(),
        decode: RoleLoad {
            instances: 3,
            queue_depth: 0,
            slo_s: 0.03,
            figures: LoadFigures {
                arrivals: 50,
                rejected: 0,
                predicted_p50_s: Some(p90_s / 2.0),
                predicted_p90_s: Some(p90_s),
                rejection_rate: Some(0.0),
                slo_attainment: Some(1.0),
            },
        },
    }
}

/// A DecodePool with `spec.autoscaling` (1..8 on the predicted TPOT against its 30 ms SLO),
/// driven pass after pass through one context whose clock and conductor are scripted: a
/// lasting high prediction scales up at once (with a `ScaledUp` Event and status), a signal
/// that oscillates afterwards changes nothing (cool-down, then the windows disagree), a silent
/// conductor holds the count, and only once the down window holds nothing but low predictions
/// does it scale down, one step, with a `ScaledDown` Event. `spec.replicas` is never written.
#[tokio::test]
async fn autoscaling_follows_the_conductors_prediction_without_flapping() {
    use kvpool_operator::conductor_load::ScriptedLoad;
    use std::sync::atomic::{AtomicI64, Ordering};

    let pool_json =
        serde_json::to_value(fixture::<KVCachePool>("kvcachepool-roce.yaml")).expect("json");
    let mut decode: DecodePool = fixture("decodepool-sglang.yaml");
    decode.spec.autoscaling = Some(
        serde_json::from_value(
            json!({"minReplicas": 1, "maxReplicas": 8, "signal": "predictedLatency"}),
        )
        .expect("autoscaling"),
    );
    let clock = Arc::new(AtomicI64::new(Context::TEST_TIME));
    let load = Arc::new(ScriptedLoad::default());
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let now = clock.clone();
    let ctx = Arc::new(
        Context::for_tests(Client::new(service, "default"))
            .with_conductor_load(load.clone())
            .with_clock(Arc::new(move || {
                k8s_openapi::jiff::Timestamp::from_second(now.load(Ordering::SeqCst)).expect("time")
            })),
    );
    let mut server = ApiServer { handle };
    let selector = "app.kubernetes.io/managed-by=kvpool-operator,kvpool.dev/owner-kind=DecodePool,kvpool.dev/owner-name=qwen";
    let passes = [
        // At the SLO against a 0.5 target: twice the instances, at once.
        ScalePass {
            at_s: 0,
            p90_tpot_s: Some(0.03),
            replicas: 6,
            event: Some("ScaledUp"),
        },
        // Oscillating: inside the 60 s cool-down nothing moves...
        ScalePass {
            at_s: 15,
            p90_tpot_s: Some(0.006),
            replicas: 6,
            event: None,
        },
        ScalePass {
            at_s: 30,
            p90_tpot_s: Some(0.06),
            replicas: 6,
            event: None,
        },
        // ...the conductor going silent holds the count...
        ScalePass {
            at_s: 45,
            p90_tpot_s: None,
            replicas: 6,
            event: None,
        },
        // ...and after it the up window's low reading and the down window's high ones veto
        // both directions.
        ScalePass {
            at_s: 75,
            p90_tpot_s: Some(0.006),
            replicas: 6,
            event: None,
        },
        ScalePass {
            at_s: 90,
            p90_tpot_s: Some(0.06),
            replicas: 6,
            event: None,
        },
        // Low for longer than the 300 s down window: one step (25 %, at least one) down.
        ScalePass {
            at_s: 400,
            p90_tpot_s: Some(0.006),
            replicas: 5,
            event: Some("ScaledDown"),
        },
    ];
    for pass in passes {
        clock.store(Context::TEST_TIME + pass.at_s, Ordering::SeqCst);
        load.push(pass.p90_tpot_s.map(decode_load));
        let engine_json = serde_json::to_value(&decode).expect("json");
        let obj = decode.clone();
        let work_ctx = ctx.clone();
        let pool = pool_json.clone();
        let (outcome, written) = tokio::join!(
            finishing(Box::pin(enginepool::reconcile_engine_pool(&obj, &work_ctx))),
            async {
                server.expect_roce_pool(&pool).await;
                server.expect_engine_pools(vec![], vec![]).await;
                let deploy = server
                    .expect_engine_workload(
                        "llm",
                        "qwen-decode",
                        json!({"replicas": pass.replicas, "readyReplicas": pass.replicas}),
                    )
                    .await;
                assert_eq!(
                    deploy["spec"]["replicas"], pass.replicas,
                    "at {} s",
                    pass.at_s
                );
                server.expect_no_engine_orphans("llm", selector).await;
                let reason = pass.event?;
                let event = server.expect_event().await;
                assert_eq!(event["type"], "Normal");
                assert_eq!(event["reason"], reason);
                assert_eq!(event["regarding"]["kind"], "DecodePool");
                let note = event["note"].as_str().expect("note").to_owned();
                assert!(note.contains("predictedLatency"), "{note}");
                assert!(note.contains("TPOT SLO 30ms"), "{note}");
                let body = server.expect_decode_status(&engine_json).await;
                Some((note, body["status"].clone()))
            }
        );
        assert_eq!(outcome.expect("reconcile"), enginepool::Outcome::Reconciled);
        if let Some((note, status)) = written {
            let a = &status["autoscaling"];
            assert_eq!(a["desiredReplicas"], pass.replicas);
            assert_eq!(a["reason"], pass.event.expect("event"));
            assert_eq!(a["signal"], "predictedLatency");
            assert!(a["lastScaleTime"].is_string(), "{a}");
            assert_eq!(status["replicas"], pass.replicas);
            if pass.at_s == 0 {
                assert!(note.contains("from 3 to 6"), "{note}");
                assert_eq!(a["value"], "1.000");
            }
            decode.status = Some(serde_json::from_value(status).expect("status"));
        }
        assert_eq!(decode.spec.replicas, 3, "spec.replicas is the user's");
    }
    assert!(
        load.asked()
            .iter()
            .all(|a| a == "roce-conductor.llm.svc:8000"),
        "{:?}",
        load.asked()
    );
    assert!(
        ctx.autoscalers
            .lock()
            .expect("lock")
            .contains_key("DecodePool/llm/qwen"),
        "the decision state is kept between passes"
    );
    drop(ctx);
    server.expect_done().await;
}

/// Issue 34: `--root-key-secret`: the operator makes its root key Secret when there is none
/// (a 404, then a create with 64 hex digits in `root-key`), reads the one that exists, takes the
/// winner's when another replica created it first (409), and refuses one without a usable key.
#[tokio::test]
async fn the_root_key_secret_is_made_when_absent_and_read_when_present() {
    use kvpool_operator::root_key_secret::{RootKeySecretError, load_or_create};
    const SECRET: &str = "/api/v1/namespaces/kvpool-system/secrets/kvpool-operator-root-key";
    let secret = |value: &str| {
        json!({"apiVersion": "v1", "kind": "Secret",
               "metadata": {"name": "kvpool-operator-root-key", "namespace": "kvpool-system"},
               "data": {"root-key": base64_encode(value.as_bytes())}})
    };
    let not_found = status_error(
        404,
        "NotFound",
        "secrets \"kvpool-operator-root-key\" not found",
    );
    let load = async |_: ApiServer| {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        (Client::new(service, "default"), ApiServer { handle })
    };
    // Absent: created, and the key used is the one created.
    let (client, mut server) = load(double().1).await;
    let (key, created) = tokio::join!(
        load_or_create(client, "kvpool-system", "kvpool-operator-root-key"),
        async {
            let (_, send) = server.expect(Method::GET, SECRET).await;
            reply(send, StatusCode::NOT_FOUND, &not_found);
            let (seen, send) = server
                .expect(Method::POST, "/api/v1/namespaces/kvpool-system/secrets")
                .await;
            reply(send, StatusCode::CREATED, &seen.body);
            seen.body
        }
    );
    let key = key.expect("created");
    let written = base64_decode(created["data"]["root-key"].as_str().expect("item"));
    assert_eq!(written.len(), 64, "32 random bytes in hex");
    assert!(written.iter().all(u8::is_ascii_hexdigit));
    let from_written = kvpool_operator::root_key::RootKey::from_bytes(&written).expect("key");
    assert_eq!(
        key.pool_key_hex("llm", "p", "u"),
        from_written.pool_key_hex("llm", "p", "u"),
        "the key in use is the one stored"
    );
    assert_eq!(
        created["metadata"]["labels"]["app.kubernetes.io/component"],
        "operator"
    );

    // Present: read, nothing created.
    let stored = "0123456789abcdef0123456789abcdef0123456789abcdef";
    let (client, mut server) = load(double().1).await;
    let (key, ()) = tokio::join!(
        load_or_create(client, "kvpool-system", "kvpool-operator-root-key"),
        async {
            let (_, send) = server.expect(Method::GET, SECRET).await;
            reply(send, StatusCode::OK, &secret(stored));
        }
    );
    let expected = kvpool_operator::root_key::RootKey::from_bytes(stored.as_bytes()).expect("key");
    assert_eq!(
        key.expect("read").pool_key_hex("llm", "p", "u"),
        expected.pool_key_hex("llm", "p", "u")
    );

    // Another replica won the race: 409, then its Secret is read.
    let (client, mut server) = load(double().1).await;
    let (key, ()) = tokio::join!(
        load_or_create(client, "kvpool-system", "kvpool-operator-root-key"),
        async {
            let (_, send) = server.expect(Method::GET, SECRET).await;
            reply(send, StatusCode::NOT_FOUND, &not_found);
            let (_, send) = server
                .expect(Method::POST, "/api/v1/namespaces/kvpool-system/secrets")
                .await;
            reply(
                send,
                StatusCode::CONFLICT,
                &status_error(409, "AlreadyExists", "exists"),
            );
            let (_, send) = server.expect(Method::GET, SECRET).await;
            reply(send, StatusCode::OK, &secret(stored));
        }
    );
    assert_eq!(
        key.expect("the winner's").pool_key_hex("llm", "p", "u"),
        expected.pool_key_hex("llm", "p", "u")
    );

    // A Secret whose key is too short: refused, naming the Secret and the item.
    let (client, mut server) = load(double().1).await;
    let (key, ()) = tokio::join!(
        load_or_create(client, "kvpool-system", "kvpool-operator-root-key"),
        async {
            let (_, send) = server.expect(Method::GET, SECRET).await;
            reply(send, StatusCode::OK, &secret("short"));
        }
    );
    let e = key.expect_err("unusable");
    assert!(matches!(e, RootKeySecretError::Unusable { .. }));
    assert!(
        e.to_string()
            .contains("kvpool-system/kvpool-operator-root-key")
            && e.to_string().contains("root-key")
    );
}

fn base64_encode(bytes: &[u8]) -> String {
    serde_json::to_value(k8s_openapi::ByteString(bytes.to_vec()))
        .expect("bytes")
        .as_str()
        .expect("base64 text")
        .to_owned()
}

fn base64_decode(text: &str) -> Vec<u8> {
    serde_json::from_value::<k8s_openapi::ByteString>(json!(text))
        .expect("base64")
        .0
}

/// Issue 34's real engine pool: a PrefillPool whose template brings a model-cache claim, a pull
/// secret, a toleration and a node affinity. The Deployment the operator applies carries
/// exactly those next to the operator's own (the pool's pull secret and toleration, the kvpool
/// volumes and mounts), and the status says the template merged cleanly. A second pass with a
/// template that sets operator-owned fields gets the operator's values applied, a Warning
/// Event and `TemplateConflict=True` naming the fields.
#[tokio::test]
async fn a_prefill_pool_template_renders_into_the_deployment_exactly() {
    let mut pool: KVCachePool = fixture("kvcachepool-roce.yaml");
    pool.spec.image_pull_secrets = vec![k8s_openapi::api::core::v1::LocalObjectReference {
        name: "kvpool-mirror".into(),
    }];
    let pool_json = serde_json::to_value(&pool).expect("json");
    let prefill: PrefillPool = fixture("prefillpool-vllm-pvc.yaml");
    let selector = "app.kubernetes.io/managed-by=kvpool-operator,kvpool.dev/owner-kind=PrefillPool,kvpool.dev/owner-name=llama";
    let engine_json = serde_json::to_value(&prefill).expect("json");
    let status_path = format!("{POOLS}/prefillpools/llama/status");

    let pool_for_server = pool_json.clone();
    let (outcome, (deploy, status)) = drive_both(
        engine_pass(prefill.clone()),
        async move |server: &mut ApiServer| {
            server.expect_roce_pool(&pool_for_server).await;
            server.expect_engine_pools(vec![], vec![]).await;
            let deploy = server
                .expect_engine_workload("llm", "llama-prefill", deploy_status(2))
                .await;
            server.expect_no_engine_orphans("llm", selector).await;
            let body = server.expect_status(&status_path, &engine_json).await;
            (deploy, body)
        },
    )
    .await;
    assert_eq!(outcome.expect("reconcile"), enginepool::Outcome::Reconciled);

    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(
        pod["imagePullSecrets"],
        json!([{"name": "kvpool-mirror"}, {"name": "regcred"}]),
        "the pool's secret (the kvpool init container), then the template's"
    );
    assert_eq!(
        pod["tolerations"],
        json!([
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}
        ])
    );
    assert_eq!(
        pod["affinity"],
        json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": ["80000"]}
            ]}]
        }}})
    );
    assert_eq!(
        pod["nodeSelector"],
        json!({"nvidia.com/gpu.product": "H100-SXM"})
    );
    let volume_names: Vec<&str> = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(
        volume_names,
        [
            "config",
            "auth",
            "socket",
            "shm",
            "kvpool-python",
            "model-cache"
        ]
    );
    assert_eq!(
        pod["volumes"][5],
        json!({"name": "model-cache", "persistentVolumeClaim": {"claimName": "llama-70b-weights", "readOnly": true}})
    );
    let containers = pod["containers"].as_array().expect("containers");
    assert_eq!(
        containers.len(),
        1,
        "the template's engine entry is merged, not added"
    );
    let engine = &containers[0];
    assert_eq!(engine["name"], "engine");
    assert_eq!(
        engine["image"],
        "registry.example.com/vllm/vllm-openai:v0.11.0"
    );
    let mounts: Vec<(&str, &str)> = engine["volumeMounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .map(|m| {
            (
                m["name"].as_str().unwrap_or_default(),
                m["mountPath"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        mounts,
        [
            ("config", "/etc/kvpool"),
            ("auth", "/etc/kvpool/auth"),
            ("socket", "/run/kvpool"),
            ("shm", "/dev/shm"),
            ("kvpool-python", "/opt/kvpool/python"),
            ("model-cache", "/root/.cache/huggingface"),
        ]
    );
    assert_eq!(
        engine["volumeMounts"][5],
        json!({"name": "model-cache", "mountPath": "/root/.cache/huggingface", "readOnly": true})
    );
    assert_eq!(pod["initContainers"][0]["name"], "kvpool-python");
    assert_eq!(pod["initContainers"].as_array().map(Vec::len), Some(1));
    let labels = &deploy["spec"]["template"]["metadata"]["labels"];
    assert_eq!(labels["team"], "ml-platform");
    assert_eq!(labels["kvpool.dev/pool"], "roce");
    assert!(deploy["metadata"]["labels"]["team"].is_null(), "pods only");
    let clean = condition(&status, "TemplateConflict");
    assert_eq!(
        (&clean["status"], &clean["reason"]),
        (&json!("False"), &json!("TemplateApplied"))
    );
    assert_eq!(condition(&status, "Ready")["status"], "True");

    // A template that takes operator-owned fields: the operator's values, a Warning Event and
    // the condition naming each field.
    let mut owned = prefill;
    let status_value = status["status"].clone();
    owned.status = Some(serde_json::from_value(status_value).expect("status"));
    let t = owned.spec.template.as_mut().expect("template");
    t.metadata
        .get_or_insert_with(Default::default)
        .labels
        .insert("kvpool.dev/component".into(), "decode".into());
    let spec = t.spec.as_mut().expect("spec");
    spec.containers[0].image = Some("attacker/engine:latest".into());
    spec.volumes.push(k8s_openapi::api::core::v1::Volume {
        name: "auth".into(),
        empty_dir: Some(Default::default()),
        ..Default::default()
    });
    let engine_json = serde_json::to_value(&owned).expect("json");
    let status_path = format!("{POOLS}/prefillpools/llama/status");
    let (outcome, (deploy, event, status)) =
        drive_both(engine_pass(owned), async move |server: &mut ApiServer| {
            server.expect_roce_pool(&pool_json).await;
            server.expect_engine_pools(vec![], vec![]).await;
            let deploy = server
                .expect_engine_workload("llm", "llama-prefill", deploy_status(2))
                .await;
            server.expect_no_engine_orphans("llm", selector).await;
            let event = server.expect_event().await;
            let body = server.expect_status(&status_path, &engine_json).await;
            (deploy, event, body)
        })
        .await;
    assert_eq!(outcome.expect("reconcile"), enginepool::Outcome::Reconciled);
    let template = &deploy["spec"]["template"];
    assert_eq!(
        template["metadata"]["labels"]["kvpool.dev/component"],
        "prefill"
    );
    assert_eq!(
        template["spec"]["containers"][0]["image"],
        "registry.example.com/vllm/vllm-openai:v0.11.0"
    );
    let auth = template["spec"]["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == "auth")
        .expect("auth");
    assert_eq!(auth["secret"]["secretName"], "roce-auth");
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["reason"], "OperatorOwnedFields");
    assert_eq!(event["regarding"]["kind"], "PrefillPool");
    let conflict = condition(&status, "TemplateConflict");
    assert_eq!(conflict["status"], "True");
    assert_eq!(conflict["reason"], "OperatorOwnedFields");
    let message = conflict["message"].as_str().expect("message");
    for field in [
        "spec.template.metadata.labels[\"kvpool.dev/component\"]",
        "spec.template.spec.containers[engine].image",
        "spec.template.spec.volumes[auth]",
    ] {
        assert!(message.contains(field), "{field} in {message}");
    }
    assert!(
        event["note"].as_str().is_some_and(|n| n == message),
        "{event}"
    );
    // The pool still runs: Ready follows the Deployment.
    assert_eq!(condition(&status, "Ready")["status"], "True");
}

/// A Deployment made by an older operator selects its pods by `app.kubernetes.io/instance`
/// (Argo CD's tracking label); the API server refuses the new selector as immutable, so the
/// operator deletes the Deployment (pods in the background) and applies it again.
#[tokio::test]
async fn a_workload_with_an_old_selector_is_recreated_with_the_new_one() {
    let pool_json =
        serde_json::to_value(fixture::<KVCachePool>("kvcachepool-roce.yaml")).expect("json");
    let selector = "app.kubernetes.io/managed-by=kvpool-operator,kvpool.dev/owner-kind=DecodePool,kvpool.dev/owner-name=qwen";
    let decode: DecodePool = fixture("decodepool-sglang.yaml");
    let engine_json = serde_json::to_value(&decode).expect("json");
    let deployment = "/apis/apps/v1/namespaces/llm/deployments/qwen-decode";
    let (outcome, recreated) =
        drive_both(engine_pass(decode), async move |server: &mut ApiServer| {
            server.expect_roce_pool(&pool_json).await;
            server.expect_engine_pools(vec![], vec![]).await;
            server
                .expect_apply(
                    "/apis/networking.k8s.io/v1/namespaces/llm/networkpolicies/qwen-decode",
                    None,
                )
                .await;
            server
                .expect_apply("/api/v1/namespaces/llm/services/qwen-decode", None)
                .await;
            // The API server's answer to a changed selector.
            let (seen, send) = server.expect(Method::PATCH, deployment).await;
            let labels = &seen.body["spec"]["selector"]["matchLabels"];
            assert_eq!(labels["kvpool.dev/instance"], "qwen", "{labels}");
            assert!(labels.get("app.kubernetes.io/instance").is_none(), "{labels}");
            reply(
                send,
                StatusCode::UNPROCESSABLE_ENTITY,
                &status_error(
                    422,
                    "Invalid",
                    "Deployment.apps \"qwen-decode\" is invalid: spec.selector: Invalid value: \
                     v1.LabelSelector{MatchLabels:map[string]string{\"app.kubernetes.io/instance\":\"qwen\"}}: \
                     field is immutable",
                ),
            );
            let (seen, send) = server.expect(Method::DELETE, deployment).await;
            assert_eq!(seen.body["propagationPolicy"], "Background", "{}", seen.body);
            reply(send, StatusCode::OK, &json!({"kind": "Status", "status": "Success"}));
            let applied = server
                .expect_apply(deployment, Some(json!({"replicas": 3, "readyReplicas": 0})))
                .await;
            server.expect_no_engine_orphans("llm", selector).await;
            server.expect_decode_status(&engine_json).await;
            applied
        })
        .await;
    outcome.expect("reconciled after recreating");
    assert_eq!(
        recreated["spec"]["template"]["metadata"]["labels"]["kvpool.dev/instance"],
        "qwen"
    );
}

/// The engine pools `prefill` and `decode` of the roce pool load `/models/Qwen3-32B` from the
/// claim `weights`, mounted at `/models` in the engine container.
fn from_claim(
    spec_model: &mut Option<String>,
    template: &mut Option<kvpool_crd::EnginePodTemplate>,
) {
    *spec_model = Some("/models/Qwen3-32B".into());
    *template = Some(
        serde_saphyr::from_str(
            "spec:
  volumes: [{name: models, persistentVolumeClaim: {claimName: weights, readOnly: true}}]
  containers: [{name: engine, volumeMounts: [{name: models, mountPath: /models, readOnly: true}]}]
",
        )
        .expect("template"),
    );
}

/// A KVCachePool pass over `pool` whose engine pools are `prefill` and `decode`: the conductor
/// Deployment applied, the Warning Event if `event` (its body), and the status written.
async fn pool_pass_with_engines(
    pool: KVCachePool,
    prefill: &PrefillPool,
    decode: &DecodePool,
    event: bool,
) -> (Value, Option<Value>, KVCachePoolStatus) {
    let pool_json = serde_json::to_value(&pool).expect("json");
    let engines = (
        vec![serde_json::to_value(prefill).expect("json")],
        vec![serde_json::to_value(decode).expect("json")],
    );
    let (outcome, out) = drive_both(pool_pass(pool), async move |server: &mut ApiServer| {
        let (_, _, conductor) = pool_children_using(server, 4, true, engines.0, engines.1).await;
        let event = match event {
            true => Some(server.expect_event().await),
            false => None,
        };
        let body = server.expect_roce_status(&pool_json).await;
        (conductor, event, body["status"].clone())
    })
    .await;
    outcome.expect("pool pass");
    let (conductor, event, status) = out;
    (
        conductor,
        event,
        serde_json::from_value(status).expect("status"),
    )
}

/// A DecodePool pass over `decode` (the roce pool's `qwen`) beside `prefill`: the Warning
/// Event if `event`, and the status written.
async fn decode_pass_with_engines(
    decode: DecodePool,
    prefill: &PrefillPool,
    event: bool,
) -> (Option<Value>, kvpool_crd::EnginePoolStatus) {
    let pool_json =
        serde_json::to_value(fixture::<KVCachePool>("kvcachepool-roce.yaml")).expect("json");
    let selector = "app.kubernetes.io/managed-by=kvpool-operator,kvpool.dev/owner-kind=DecodePool,kvpool.dev/owner-name=qwen";
    let engine_json = serde_json::to_value(&decode).expect("json");
    let prefill_json = serde_json::to_value(prefill).expect("json");
    let (outcome, out) = drive_both(engine_pass(decode), async move |server: &mut ApiServer| {
        server.expect_roce_pool(&pool_json).await;
        server
            .expect_engine_pools(vec![prefill_json], vec![engine_json.clone()])
            .await;
        server
            .expect_engine_workload("llm", "qwen-decode", deploy_status(4))
            .await;
        server.expect_no_engine_orphans("llm", selector).await;
        let event = match event {
            true => Some(server.expect_event().await),
            false => None,
        };
        let body = server.expect_decode_status(&engine_json).await;
        (event, body["status"].clone())
    })
    .await;
    assert_eq!(
        outcome.expect("decode pass"),
        enginepool::Outcome::Reconciled
    );
    (out.0, serde_json::from_value(out.1).expect("status"))
}

/// Issue 35: a prefill and a decode pool of one model that split it over different tensor
/// parallel sizes get `ModelMismatch=True/TensorParallelMismatch` on the KVCachePool and on the
/// engine pool, each with one Warning Event naming the pools and the model; nothing is held
/// back (the children are applied as usual). Fixed, the condition clears without an Event, and
/// the conductor is told the size they now agree on and reads the model's claim.
#[tokio::test]
async fn a_mismatched_pool_set_gets_a_condition_that_clears_when_fixed() {
    let mut prefill: PrefillPool = fixture("prefillpool-vllm.yaml"); // qwen, TP 4
    let mut decode: DecodePool = fixture("decodepool-vllm.yaml"); // qwen, TP 2
    from_claim(&mut prefill.spec.engine.model, &mut prefill.spec.template);
    from_claim(&mut decode.spec.engine.model, &mut decode.spec.template);
    let pool: KVCachePool = fixture("kvcachepool-roce.yaml");
    let mismatch = |conditions: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition]| {
        kvpool_crd::conditions::find(conditions, "ModelMismatch")
            .expect("ModelMismatch")
            .clone()
    };

    // 1. Mismatched: the KVCachePool reports it, with an Event.
    let (conductor, event, status) =
        pool_pass_with_engines(pool.clone(), &prefill, &decode, true).await;
    let event = event.expect("event");
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["reason"], "TensorParallelMismatch");
    assert_eq!(event["regarding"]["kind"], "KVCachePool");
    let on_pool = mismatch(&status.conditions);
    assert_eq!(
        (on_pool.status.as_str(), on_pool.reason.as_str()),
        ("True", "TensorParallelMismatch")
    );
    assert_eq!(
        on_pool.message,
        "the pools of KVCachePool roce serving model \"/models/Qwen3-32B\" split it over \
         different tensor parallel sizes, so their KV layout per rank differs: DecodePool qwen \
         (tensorParallelSize 2), PrefillPool qwen (tensorParallelSize 4)"
    );
    assert_eq!(event["note"], on_pool.message.as_str());
    let args = &conductor["spec"]["template"]["spec"]["containers"][0]["args"];
    let has = |flag: &str| args.as_array().expect("args").iter().any(|a| a == flag);
    assert!(
        !has("--engine-tensor-parallel-size"),
        "no size they agree on: {args}"
    );
    assert!(has("--model-dir"), "one model from one claim: {args}");

    // 2. The decode pool reports it too; its children are applied as usual.
    let (event, engine_status) = decode_pass_with_engines(decode.clone(), &prefill, true).await;
    let event = event.expect("event");
    assert_eq!(event["reason"], "TensorParallelMismatch");
    assert_eq!(event["regarding"]["kind"], "DecodePool");
    let on_decode = mismatch(&engine_status.conditions);
    assert_eq!(on_decode.status, "True");
    assert_eq!(on_decode.message, on_pool.message);
    assert!(kvpool_crd::conditions::is_true(
        &engine_status.conditions,
        "Ready"
    ));

    // 3. Fixed (decode over 4 GPUs too): cleared on the pool, no Event; the conductor gets the
    //    size and the model directory in the claim the engines mount.
    decode.spec.tensor_parallel_size = 4;
    decode.spec.resources.gpus = 4;
    decode.metadata.generation = Some(2);
    let mut seen_pool = pool.clone();
    seen_pool.status = Some(status);
    let (conductor, event, status) =
        pool_pass_with_engines(seen_pool, &prefill, &decode, false).await;
    assert!(event.is_none());
    let cleared = mismatch(&status.conditions);
    assert_eq!(
        (cleared.status.as_str(), cleared.reason.as_str()),
        ("False", "EnginePoolsMatch")
    );
    assert!(
        cleared
            .message
            .contains("\"/models/Qwen3-32B\" by DecodePool qwen, PrefillPool qwen"),
        "{}",
        cleared.message
    );
    let pod = &conductor["spec"]["template"]["spec"];
    let args: Vec<&str> = pod["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let after = |flag: &str| args.iter().position(|a| *a == flag).map(|i| args[i + 1]);
    assert_eq!(after("--engine-tensor-parallel-size"), Some("4"));
    assert_eq!(after("--model-dir"), Some("/etc/kvpool/model/Qwen3-32B"));
    assert_eq!(
        after("--tokenizer"),
        None,
        "the model directory's tokenizer"
    );
    let volume = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == "model")
        .expect("model volume");
    assert_eq!(
        volume["persistentVolumeClaim"],
        json!({"claimName": "weights", "readOnly": true})
    );

    // 4. And on the decode pool, without an Event.
    let mut seen_decode = decode.clone();
    seen_decode.status = Some(engine_status);
    let (event, engine_status) = decode_pass_with_engines(seen_decode, &prefill, false).await;
    assert!(event.is_none());
    let cleared = mismatch(&engine_status.conditions);
    assert_eq!(
        (cleared.status.as_str(), cleared.reason.as_str()),
        ("False", "EnginePoolsMatch")
    );

    // The watch mapping: a changed prefill pool maps to the decode pools beside it.
    let (reader, mut writer) = reflector::store::<DecodePool>();
    let mut elsewhere = decode.clone();
    elsewhere.metadata.name = Some("elsewhere".into());
    elsewhere.spec.kv_cache_pool_ref.name = "another-pool".into();
    writer.apply_watcher_event(&watcher::Event::Apply(decode));
    writer.apply_watcher_event(&watcher::Event::Apply(elsewhere));
    let mapped = enginepool::siblings(&reader, &prefill);
    let names: Vec<&str> = mapped.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["qwen"]);
}

/// The check is advice: when the engine pools cannot be listed, an engine pool's pass still
/// applies its children and keeps its last `ModelMismatch` (no Event, and here no status
/// write, since nothing else changed).
#[tokio::test]
async fn a_failed_list_of_the_engine_pools_keeps_the_condition_and_blocks_nothing() {
    let prefill: PrefillPool = fixture("prefillpool-vllm.yaml"); // TP 4
    let decode: DecodePool = fixture("decodepool-vllm.yaml"); // TP 2
    let (_, status) = decode_pass_with_engines(decode.clone(), &prefill, true).await;
    assert!(kvpool_crd::conditions::is_true(
        &status.conditions,
        "ModelMismatch"
    ));

    let mut seen = decode;
    seen.status = Some(status);
    let pool_json =
        serde_json::to_value(fixture::<KVCachePool>("kvcachepool-roce.yaml")).expect("json");
    let selector = "app.kubernetes.io/managed-by=kvpool-operator,kvpool.dev/owner-kind=DecodePool,kvpool.dev/owner-name=qwen";
    let outcome = drive(engine_pass(seen), async move |server: &mut ApiServer| {
        server.expect_roce_pool(&pool_json).await;
        let (_, send) = server
            .expect(Method::GET, &format!("{POOLS}/prefillpools"))
            .await;
        reply(
            send,
            StatusCode::INTERNAL_SERVER_ERROR,
            &status_error(500, "InternalError", "etcd timeout"),
        );
        server
            .expect_engine_workload("llm", "qwen-decode", deploy_status(4))
            .await;
        server.expect_no_engine_orphans("llm", selector).await;
    })
    .await;
    assert_eq!(outcome.expect("pass"), enginepool::Outcome::Reconciled);
}

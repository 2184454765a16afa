//! `kvpool operator` as a real child process (started through `kvpool-harness`): `crd` writes the committed CRDs, a bad
//! flag or a missing cluster exits non-zero with the reason, and `run` against a local fake API
//! server (plain HTTP on 127.0.0.1 answering lists with empty lists, holding watches open and
//! keeping one Lease in memory) becomes ready after the initial sync, takes and releases the
//! leader Lease when asked to, serves metrics, and exits 0 on SIGTERM.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{RawQuery, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use kvpool_harness::{ChildProcess, Launcher, http};
use nix::sys::signal::Signal;
use serde_json::{Value, json};

const KVPOOL: &str = env!("CARGO_BIN_EXE_kvpool");

/// A root key file for `kvpool operator run` (written once per test process).
fn root_key_file() -> std::path::PathBuf {
    static FILE: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    FILE.get_or_init(|| {
        let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("operator-root-key-{}", std::process::id()));
        std::fs::write(&path, "0123456789abcdef0123456789abcdef\n").expect("root key");
        path
    })
    .clone()
}

/// `kvpool operator ...`, with a root key for `run`.
fn operator_command() -> Command {
    let mut cmd = Command::new(KVPOOL);
    cmd.arg("operator")
        .env("KVPOOL_OPERATOR_ROOT_KEY_FILE", root_key_file());
    cmd
}

#[test]
fn crd_subcommand_writes_exactly_the_committed_crds() {
    let dir = tempfile::tempdir().expect("tempdir");
    kvpool_harness::output_ok(
        operator_command()
            .args(["crd", "--out-dir"])
            .arg(dir.path()),
    )
    .expect("kvpool operator crd");
    let committed = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crds");
    for name in [
        "kvcachepools.kvpool.dev.yaml",
        "prefillpools.kvpool.dev.yaml",
        "decodepools.kvpool.dev.yaml",
    ] {
        let fresh = std::fs::read_to_string(dir.path().join(name)).expect("written");
        let old = std::fs::read_to_string(committed.join(name)).expect("committed crds/ file");
        assert!(
            fresh == old,
            "crds/{name} is stale: run `cargo run -p kvpool -- operator crd --out-dir crds/`"
        );
    }
}

#[test]
fn bad_flags_and_a_missing_cluster_exit_non_zero_with_the_reason() {
    let out = operator_command()
        .args(["run", "--concurrency", "0"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--concurrency"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // No root key, or one too short: refused before anything listens, naming the flag.
    let short = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("operator-short-root-key-{}", std::process::id()));
    std::fs::write(&short, "0123456789").expect("short key");
    for (file, needle) in [
        (
            std::path::PathBuf::from("/nonexistent/root-key"),
            "/nonexistent/root-key",
        ),
        (short.clone(), "fewer than 32"),
    ] {
        let out = operator_command()
            .args(["run", "--admin-listen", "127.0.0.1:0"])
            .env("KVPOOL_OPERATOR_ROOT_KEY_FILE", &file)
            .output()
            .expect("run");
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(needle), "{stderr}");
        assert!(stderr.contains("root key"), "{stderr}");
    }

    let out = operator_command()
        .args(["run", "--admin-listen", "127.0.0.1:0"])
        .env("KUBECONFIG", "/nonexistent/kubeconfig")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .output()
        .expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("Kubernetes client"), "{stderr}");
}

/// `apiVersion` of the list at `path` (`/api/v1/...` or `/apis/<group>/<version>/...`).
fn api_version(path: &str) -> String {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match parts.as_slice() {
        ["api", v, ..] => (*v).to_owned(),
        ["apis", g, v, ..] => format!("{g}/{v}"),
        _ => "v1".to_owned(),
    }
}

/// Objects the fake API server holds, keyed by their path (`/apis/<g>/<v>/namespaces/<ns>/<plural>/<name>`).
type Objects = Arc<Mutex<BTreeMap<String, Value>>>;

const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/kvpool-system/leases/kvpool-operator";

fn json_response(code: StatusCode, body: &Value) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn status(code: u16, reason: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
        "code": code, "message": reason})
}

/// Merge `patch` into `target` (objects recursively, anything else replaced, null removes), the
/// way a merge patch works; good enough for apply patches from a single field manager.
fn merge(target: &mut Value, patch: &Value) {
    match (target.as_object_mut(), patch.as_object()) {
        (Some(t), Some(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        _ => *target = patch.clone(),
    }
}

/// Whether `obj`'s labels match an equality-only selector (`k=v,k2=v2`).
fn selected(obj: &Value, selector: Option<&str>) -> bool {
    selector.is_none_or(|sel| {
        sel.split(',').filter(|t| !t.is_empty()).all(|term| {
            let (k, v) = term.split_once('=').unwrap_or((term, ""));
            obj["metadata"]["labels"][k].as_str() == Some(v)
        })
    })
}

fn decode(s: &str) -> String {
    s.replace("%2F", "/")
        .replace("%3D", "=")
        .replace("%2C", ",")
}

/// A small in-memory API server: list (with label selectors), get, create (409 when present),
/// patch (merge; the status subresource replaces `status`), delete; watches stay open without
/// events, so the operator sees exactly the initial lists.
async fn fake_api(
    State(objects): State<Objects>,
    RawQuery(query): RawQuery,
    request: Request,
) -> Response {
    let path = request.uri().path().to_owned();
    let query: BTreeMap<String, String> = query
        .unwrap_or_default()
        .split('&')
        .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_owned(), decode(v))))
        .collect();
    if query.get("watch").is_some_and(|v| v == "true" || v == "1") {
        let body = Body::from_stream(futures::stream::pending::<Result<String, std::io::Error>>());
        return (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response();
    }
    let method = request.method().clone();
    let bytes = axum::body::to_bytes(request.into_body(), 1 << 22)
        .await
        .unwrap_or_default();
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let Some(ns_at) = segments.iter().position(|s| *s == "namespaces") else {
        return json_response(StatusCode::NOT_FOUND, &status(404, "NotFound"));
    };
    let depth = segments.len() - ns_at;
    let mut objects = objects.lock().expect("objects");
    // A seeded `forbid:<fragment>` entry refuses every write to a path holding the fragment
    // the way RBAC does (403 with the API server's message).
    if method != "GET"
        && let Some(rule) = objects
            .keys()
            .find(|k| k.strip_prefix("forbid:").is_some_and(|f| path.contains(f)))
    {
        let message = format!(
            "{path} is forbidden: User \"system:serviceaccount:kvpool-system:kvpool-operator\" cannot {method} it ({rule})"
        );
        return json_response(
            StatusCode::FORBIDDEN,
            &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "Forbidden", "code": 403, "message": message}),
        );
    }
    match (method.as_str(), depth) {
        ("GET", 3) => {
            let prefix = format!("{path}/");
            let items: Vec<Value> = objects
                .iter()
                .filter(|(k, _)| k.starts_with(&prefix) && !k[prefix.len()..].contains('/'))
                .map(|(_, v)| v.clone())
                .filter(|v| selected(v, query.get("labelSelector").map(String::as_str)))
                .collect();
            json_response(
                StatusCode::OK,
                &json!({"apiVersion": api_version(&path), "kind": "List",
                    "metadata": {"resourceVersion": "1"}, "items": items}),
            )
        }
        ("POST", 3) => {
            let name = body["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let key = format!("{path}/{name}");
            if objects.contains_key(&key) {
                return json_response(StatusCode::CONFLICT, &status(409, "AlreadyExists"));
            }
            let mut obj = body;
            obj["metadata"]["resourceVersion"] = json!("1");
            objects.insert(key, obj.clone());
            json_response(StatusCode::CREATED, &obj)
        }
        ("GET", 4) => match objects.get(&path) {
            Some(obj) => json_response(StatusCode::OK, obj),
            None => json_response(StatusCode::NOT_FOUND, &status(404, "NotFound")),
        },
        ("PATCH", 4) => {
            let obj = objects.entry(path).or_insert_with(|| json!({}));
            merge(obj, &body);
            json_response(StatusCode::OK, obj)
        }
        ("PATCH", 5) if segments.last() == Some(&"status") => {
            let key = format!("/{}", segments[..segments.len() - 1].join("/"));
            match objects.get_mut(&key) {
                Some(obj) => {
                    obj["status"] = body["status"].clone();
                    json_response(StatusCode::OK, obj)
                }
                None => json_response(StatusCode::NOT_FOUND, &status(404, "NotFound")),
            }
        }
        ("DELETE", 4) => match objects.remove(&path) {
            Some(obj) => json_response(StatusCode::OK, &obj),
            None => json_response(StatusCode::NOT_FOUND, &status(404, "NotFound")),
        },
        _ => json_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &status(405, "MethodNotAllowed"),
        ),
    }
}

/// The admin address the operator bound (it is started with port 0), from its log.
fn admin_addr(log: &str) -> Option<SocketAddr> {
    let line = log.lines().find(|l| l.contains("admin server listening"))?;
    let rest = &line[line.find("addr=")? + "addr=".len()..];
    let addr: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
        .collect();
    addr.parse().ok()
}

/// Start the fake API server holding `seed` (path, object); returns its address and objects.
async fn start_fake_api(seed: Vec<(String, Value)>) -> (SocketAddr, Objects) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let api_addr = listener.local_addr().expect("addr");
    let objects: Objects = Arc::new(Mutex::new(seed.into_iter().collect()));
    let state = objects.clone();
    tokio::spawn(async move {
        let app = Router::new().fallback(fake_api).with_state(state);
        let _ = axum::serve(listener, app).await;
    });
    (api_addr, objects)
}

fn kubeconfig(dir: &std::path::Path, api_addr: SocketAddr) -> std::path::PathBuf {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{api_addr}\nusers:\n- name: u\n  user: {{}}\ncontexts:\n- name: c\n  context:\n    cluster: fake\n    user: u\n    namespace: default\ncurrent-context: c\n"
        ),
    )
    .expect("kubeconfig");
    path
}

/// `kvpool operator run` against the API server at `api_addr` with `extra_args`, its log in
/// `dir` (`OP_LOG` sets its log filter, info by default).
fn spawn_operator(
    dir: &std::path::Path,
    api_addr: SocketAddr,
    extra_args: &[&str],
) -> kvpool_harness::ChildProcess {
    let kubeconfig = kubeconfig(dir, api_addr);
    Launcher::new(dir)
        .spawn(
            "operator",
            operator_command()
                .args([
                    "run",
                    "--admin-listen",
                    "127.0.0.1:0",
                    "--namespace",
                    "default",
                ])
                .args(extra_args)
                .env("KUBECONFIG", &kubeconfig)
                .env_remove("KUBERNETES_SERVICE_HOST")
                .env_remove("KUBERNETES_SERVICE_PORT")
                .env(
                    "RUST_LOG",
                    std::env::var("OP_LOG").unwrap_or_else(|_| "info".into()),
                )
                .env("NO_COLOR", "1"),
        )
        .expect("start kvpool operator run")
}

/// SIGTERMs the operator and waits up to `limit` for it to exit 0; returns its log. It may still
/// call the fake API (on this runtime) while it stops, so the wait runs off the runtime's thread.
async fn sigterm_and_wait(mut child: ChildProcess, limit: Duration) -> String {
    child.signal(Signal::SIGTERM).expect("SIGTERM");
    let (child, status) = tokio::task::spawn_blocking(move || {
        let status = child.wait_timeout(limit);
        (child, status)
    })
    .await
    .expect("join");
    let log = child.log_text();
    let status = status.unwrap_or_else(|e| panic!("no exit after SIGTERM: {e}\n{log}"));
    assert!(status.success(), "exit {status}: {log}");
    log
}

/// Run the operator against the fake until `path` on the admin server answers with a body that
/// contains `want`, then SIGTERM it; returns its log after it exited 0.
async fn run_until(extra_args: &[&str], path: &str, want: &str) -> String {
    let (api_addr, _) = start_fake_api(Vec::new()).await;
    run_against(api_addr, extra_args, path, want, || true).await
}

/// Like [`run_until`] against a given fake, also waiting for `until()` to hold.
async fn run_against(
    api_addr: SocketAddr,
    extra_args: &[&str],
    path: &str,
    want: &str,
    until: impl Fn() -> bool,
) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = spawn_operator(dir.path(), api_addr, extra_args);

    // Wait (bounded, generously for a loaded machine) for the admin server to say `want`.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    let mut admin = None;
    loop {
        admin = admin.or_else(|| admin_addr(&child.log_text()));
        let response = match admin {
            Some(addr) => http::get_async(addr, path).await,
            None => None,
        };
        if let Some(r) = response {
            if r.status == 200 && r.body.contains(want) && until() {
                break;
            }
            last = format!("{} {}", r.status, r.body);
        }
        if let Ok(Some(status)) = child.try_status() {
            panic!("operator exited early with {status}: {}", child.log_text());
        }
        assert!(
            Instant::now() < deadline,
            "{path} never showed {want:?}; last: {last}\noperator log:\n{}",
            child.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let admin = admin.expect("admin address known once it answered");
    let livez = http::get_async(admin, "/livez").await.expect("livez");
    assert_eq!(livez.status, 200, "{}", livez.body);

    let log = sigterm_and_wait(child, Duration::from_secs(60)).await;
    assert!(log.contains("SIGTERM received"), "{log}");
    assert!(log.contains("kvpool-operator stopped"), "{log}");
    log
}

#[tokio::test]
async fn run_becomes_ready_after_the_initial_sync_and_stops_cleanly_on_sigterm() {
    let log = run_until(&[], "/readyz", "ready").await;
    assert!(log.contains("initial sync done, ready"), "{log}");
    assert!(log.contains("kvpool-operator stopped"), "{log}");
}

#[tokio::test]
async fn leader_election_takes_the_lease_and_releases_it_on_sigterm() {
    let (api_addr, objects) = start_fake_api(Vec::new()).await;
    let log = run_against(
        api_addr,
        &[
            "--leader-elect",
            "--identity",
            "replica-a",
            "--leader-election-namespace",
            "kvpool-system",
        ],
        "/metrics",
        "\nkvpool_operator_leader 1",
        || true,
    )
    .await;
    assert!(log.contains("acquired the leader lease"), "{log}");
    assert!(log.contains("released the leader lease"), "{log}");
    let lease = objects
        .lock()
        .expect("lock")
        .get(LEASE)
        .cloned()
        .expect("lease created");
    assert!(
        lease["spec"].get("holderIdentity").is_none(),
        "released lease has no holder: {lease}"
    );
    assert!(
        lease["spec"]["leaseTransitions"].as_i64().unwrap_or(0) >= 1,
        "lease was taken: {lease}"
    );
}

fn fixture_json<T: serde::de::DeserializeOwned + serde::Serialize>(name: &str) -> Value {
    let path = format!(
        "{}/operator/tests/fixtures/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(path).expect("fixture");
    let typed: T = serde_saphyr::from_str(&text).expect("parse fixture");
    serde_json::to_value(typed).expect("json")
}

/// Where the fake API server keeps the objects of namespace `default` of the kvpool API group.
const G: &str = "/apis/kvpool.dev/v1alpha1/namespaces/default";

/// The seed entry of the KVCachePool `tcp` of operator/tests/fixtures/kvcachepool-tcp.yaml.
fn tcp_pool() -> (String, Value) {
    (
        format!("{G}/kvcachepools/tcp"),
        fixture_json::<kvpool_crd::KVCachePool>("kvcachepool-tcp.yaml"),
    )
}

/// The whole binary over HTTP: the initial lists hand a KVCachePool and a PrefillPool to the
/// controllers, which create every child with server-side apply and write both statuses.
#[tokio::test]
async fn run_reconciles_listed_objects_into_children_and_status() {
    let seed = vec![
        tcp_pool(),
        (
            format!("{G}/prefillpools/synthetic"),
            fixture_json::<kvpool_crd::PrefillPool>("prefillpool-custom.yaml"),
        ),
    ];
    let (api_addr, objects) = start_fake_api(seed).await;
    let watched = objects.clone();
    let has_status = move |key: &str| {
        watched
            .lock()
            .expect("lock")
            .get(key)
            .is_some_and(|o| o["status"]["conditions"].is_array())
    };
    let pool_key = format!("{G}/kvcachepools/tcp");
    let engine_key = format!("{G}/prefillpools/synthetic");
    run_against(api_addr, &[], "/readyz", "ready", || {
        has_status(&pool_key) && has_status(&engine_key)
    })
    .await;

    let objects = objects.lock().expect("lock");
    for key in [
        "/apis/apps/v1/namespaces/default/daemonsets/tcp-agent",
        "/apis/apps/v1/namespaces/default/deployments/tcp-master",
        "/api/v1/namespaces/default/services/tcp-master",
        "/api/v1/namespaces/default/configmaps/tcp-config",
        "/api/v1/namespaces/default/secrets/tcp-auth",
        "/apis/apps/v1/namespaces/default/deployments/synthetic-prefill",
        "/api/v1/namespaces/default/services/synthetic-prefill",
    ] {
        let obj = objects
            .get(key)
            .unwrap_or_else(|| panic!("{key} was not created"));
        assert_eq!(
            obj["metadata"]["labels"]["app.kubernetes.io/managed-by"], "kvpool-operator",
            "{key}"
        );
    }
    assert!(
        !objects.contains_key("/apis/apps/v1/namespaces/default/deployments/tcp-conductor"),
        "conductor disabled in the fixture"
    );
    let pool = &objects[&format!("{G}/kvcachepools/tcp")];
    assert_eq!(
        pool["status"]["masterEndpoint"],
        "tcp-master.default.svc:50051"
    );
    let engine = &objects[&format!("{G}/prefillpools/synthetic")];
    assert_eq!(
        engine["status"]["endpoints"][0],
        "synthetic-prefill.default.svc:8000"
    );
}

#[tokio::test]
async fn sigterm_stops_the_operator_in_time_while_the_api_server_never_answers() {
    // An API server that accepts connections and never answers a byte: every request of the
    // operator (the lease, the initial lists) waits forever.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let api_addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn);
        }
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = spawn_operator(
        dir.path(),
        api_addr,
        &[
            "--leader-elect",
            "--identity",
            "replica-a",
            "--shutdown-timeout",
            "2s",
        ],
    );
    // The signal handlers are installed before the admin server listens.
    let deadline = Instant::now() + Duration::from_secs(60);
    while admin_addr(&child.log_text()).is_none() {
        assert!(Instant::now() < deadline, "{}", child.log_text());
        if let Ok(Some(status)) = child.try_status() {
            panic!("operator exited early with {status}: {}", child.log_text());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let signalled = Instant::now();
    let log = sigterm_and_wait(child, Duration::from_secs(30)).await;
    // It was stuck on the API server, and the timeout ended it.
    assert!(
        log.contains("did not stop within the shutdown timeout"),
        "{log}"
    );
    // 2 s of shutdown timeout; the rest is a loaded machine's scheduling.
    assert!(
        signalled.elapsed() < Duration::from_secs(15),
        "took {:?}: {log}",
        signalled.elapsed()
    );
}

/// A reconcile that fails on the API server's 403 says why in the one log line that reports it:
/// the operator's context, kube's error and the server's RBAC message together.
#[tokio::test]
async fn a_forbidden_write_is_logged_with_its_cause() {
    let seed = vec![tcp_pool(), ("forbid:/configmaps/".to_owned(), Value::Null)];
    let (api_addr, _) = start_fake_api(seed).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = spawn_operator(dir.path(), api_addr, &[]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let line = loop {
        let log = child.log_text();
        if let Some(line) = log.lines().find(|l| l.contains("reconcile failed")) {
            break line.to_owned();
        }
        assert!(Instant::now() < deadline, "no failed reconcile:\n{log}");
        if let Ok(Some(status)) = child.try_status() {
            panic!("operator exited early with {status}: {log}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for part in ["tcp-config", "is forbidden", "cannot PATCH", "403"] {
        assert!(line.contains(part), "{part:?} missing from: {line}");
    }
    sigterm_and_wait(child, Duration::from_secs(60)).await;
}

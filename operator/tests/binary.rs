//! The `kvpool-operator` binary as a real child process: `crd` writes the committed CRDs, a bad
//! flag or a missing cluster exits non-zero with the reason, and `run` against a local fake API
//! server (plain HTTP on 127.0.0.1 answering lists with empty lists, holding watches open and
//! keeping one Lease in memory) becomes ready after the initial sync, takes and releases the
//! leader Lease when asked to, serves metrics, and exits 0 on SIGTERM.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{RawQuery, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BIN: &str = env!("CARGO_BIN_EXE_kvpool-operator");

#[test]
fn crd_subcommand_writes_exactly_the_committed_crds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(BIN)
        .args(["crd", "--out-dir"])
        .arg(dir.path())
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let committed = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds");
    for name in [
        "kvcachepools.kvpool.dev.yaml",
        "prefillpools.kvpool.dev.yaml",
        "decodepools.kvpool.dev.yaml",
    ] {
        let fresh = std::fs::read_to_string(dir.path().join(name)).expect("written");
        let old = std::fs::read_to_string(committed.join(name)).expect("committed crds/ file");
        assert!(
            fresh == old,
            "crds/{name} is stale: run `cargo run -p kvpool-operator -- crd --out-dir crds/`"
        );
    }
}

#[test]
fn bad_flags_and_a_missing_cluster_exit_non_zero_with_the_reason() {
    let out = Command::new(BIN)
        .args(["run", "--concurrency", "0"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--concurrency"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let out = Command::new(BIN)
        .args(["run", "--admin-addr", "127.0.0.1:0"])
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

/// The one Lease the fake keeps (leader election), as JSON.
type LeaseStore = Arc<Mutex<Option<serde_json::Value>>>;

/// The Lease collection (POST) and the Lease itself (GET, PATCH).
const LEASES_PATH: &str = "/apis/coordination.k8s.io/v1/namespaces/kvpool-system/leases";

fn json_response(code: StatusCode, body: &serde_json::Value) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// GET, create and PATCH (apply or strategic merge: spec keys merged, nulls removed) of the Lease.
async fn fake_lease(lease: LeaseStore, request: Request) -> Response {
    let method = request.method().clone();
    let bytes = axum::body::to_bytes(request.into_body(), 1 << 20)
        .await
        .unwrap_or_default();
    let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or(json!({}));
    let mut stored = lease.lock().expect("lease lock");
    let not_found = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
        "reason": "NotFound", "code": 404, "message": "leases \"kvpool-operator\" not found"});
    match method.as_str() {
        "GET" => match stored.as_ref() {
            Some(obj) => json_response(StatusCode::OK, obj),
            None => json_response(StatusCode::NOT_FOUND, &not_found),
        },
        "POST" => {
            let mut obj = body;
            obj["metadata"]["resourceVersion"] = json!("1");
            obj["metadata"]["namespace"] = json!("kvpool-system");
            if obj.get("spec").is_none() {
                obj["spec"] = json!({});
            }
            *stored = Some(obj.clone());
            json_response(StatusCode::CREATED, &obj)
        }
        "PATCH" => {
            let obj = stored.get_or_insert_with(|| {
                json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": "kvpool-operator", "namespace": "kvpool-system"},
                    "spec": {}})
            });
            if let Some(spec) = body.get("spec").and_then(|s| s.as_object()) {
                for (k, v) in spec {
                    if v.is_null() {
                        if let Some(m) = obj["spec"].as_object_mut() {
                            m.remove(k);
                        }
                    } else {
                        obj["spec"][k] = v.clone();
                    }
                }
            }
            let version = obj["metadata"]["resourceVersion"]
                .as_str()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(1);
            obj["metadata"]["resourceVersion"] = json!((version + 1).to_string());
            json_response(StatusCode::OK, obj)
        }
        _ => json_response(StatusCode::METHOD_NOT_ALLOWED, &json!({})),
    }
}

async fn fake_api(
    State(lease): State<LeaseStore>,
    RawQuery(query): RawQuery,
    request: Request,
) -> Response {
    let path = request.uri().path().to_owned();
    if path == LEASES_PATH || path == format!("{LEASES_PATH}/kvpool-operator") {
        return fake_lease(lease, request).await;
    }
    let query = query.unwrap_or_default();
    if query
        .split('&')
        .any(|kv| kv == "watch=true" || kv == "watch=1")
    {
        // Hold the watch open with no events.
        let body = Body::from_stream(futures::stream::pending::<Result<String, std::io::Error>>());
        return (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response();
    }
    if request.method() != axum::http::Method::GET {
        return (StatusCode::METHOD_NOT_ALLOWED, "read-only fake").into_response();
    }
    let list = json!({
        "apiVersion": api_version(&path),
        "kind": "List",
        "metadata": {"resourceVersion": "1"},
        "items": [],
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        list.to_string(),
    )
        .into_response()
}

async fn http_get(addr: SocketAddr, path: &str) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    stream.write_all(req.as_bytes()).await.ok()?;
    let mut out = String::new();
    stream.read_to_string(&mut out).await.ok()?;
    Some(out)
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Start the fake API server; returns its address and the Lease it keeps.
async fn start_fake_api() -> (SocketAddr, LeaseStore) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let api_addr = listener.local_addr().expect("addr");
    let lease: LeaseStore = Arc::new(Mutex::new(None));
    let state = lease.clone();
    tokio::spawn(async move {
        let app = Router::new().fallback(fake_api).with_state(state);
        let _ = axum::serve(listener, app).await;
    });
    (api_addr, lease)
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

fn read_stderr(child: &mut Child) -> String {
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut stderr);
    }
    stderr
}

/// Run the operator against the fake until `path` on the admin server answers with a body that
/// contains `want`, then SIGTERM it; returns its log after it exited 0.
async fn run_until(extra_args: &[&str], path: &str, want: &str) -> String {
    let (api_addr, _lease) = start_fake_api().await;
    run_against(api_addr, extra_args, path, want).await
}

async fn run_against(api_addr: SocketAddr, extra_args: &[&str], path: &str, want: &str) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = kubeconfig(dir.path(), api_addr);
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let child = Command::new(BIN)
        .args([
            "run",
            "--admin-addr",
            &admin.to_string(),
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
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut child = KillOnDrop(child);

    // Wait (bounded, generously for a loaded machine) for the admin server to say `want`.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    loop {
        if let Some(resp) = http_get(admin, path).await {
            if resp.starts_with("HTTP/1.1 200") && resp.contains(want) {
                break;
            }
            last = resp;
        }
        if let Ok(Some(status)) = child.0.try_wait() {
            panic!(
                "operator exited early with {status}: {}",
                read_stderr(&mut child.0)
            );
        }
        if Instant::now() >= deadline {
            let _ = child.0.kill();
            panic!(
                "{path} never showed {want:?}; last: {last}\noperator log:\n{}",
                read_stderr(&mut child.0)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let livez = http_get(admin, "/livez").await.expect("livez");
    assert!(livez.starts_with("HTTP/1.1 200"), "{livez}");

    let pid = child.0.id().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    let (status, log) = tokio::task::spawn_blocking(move || {
        let status = child.0.wait().expect("wait");
        (status, read_stderr(&mut child.0))
    })
    .await
    .expect("join");
    assert!(status.success(), "exit {status}: {log}");
    assert!(log.contains("SIGTERM received"), "{log}");
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
    let (api_addr, lease) = start_fake_api().await;
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
    )
    .await;
    assert!(log.contains("acquired the leader lease"), "{log}");
    assert!(log.contains("released the leader lease"), "{log}");
    let lease = lease.lock().expect("lock").clone().expect("lease created");
    assert!(
        lease["spec"].get("holderIdentity").is_none(),
        "released lease has no holder: {lease}"
    );
    assert!(
        lease["spec"]["leaseTransitions"].as_i64().unwrap_or(0) >= 1,
        "lease was taken: {lease}"
    );
}

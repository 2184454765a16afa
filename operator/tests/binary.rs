//! The `kvpool-operator` binary as a real child process: `crd` writes the committed CRDs, a bad
//! flag or a missing cluster exits non-zero with the reason, and `run` against a local fake API
//! server (plain HTTP on 127.0.0.1 answering lists with empty lists and holding watches open)
//! becomes ready after the initial sync, serves metrics, and exits 0 on SIGTERM.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{RawQuery, Request};
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

async fn fake_api(RawQuery(query): RawQuery, request: Request) -> Response {
    let path = request.uri().path().to_owned();
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

#[tokio::test]
async fn run_becomes_ready_after_the_initial_sync_and_stops_cleanly_on_sigterm() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let api_addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let app = Router::new().fallback(fake_api);
        let _ = axum::serve(listener, app).await;
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{api_addr}\nusers:\n- name: u\n  user: {{}}\ncontexts:\n- name: c\n  context:\n    cluster: fake\n    user: u\n    namespace: default\ncurrent-context: c\n"
        ),
    )
    .expect("kubeconfig");

    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let child = Command::new(BIN)
        .args([
            "run",
            "--admin-addr",
            &admin.to_string(),
            "--namespace",
            "default",
        ])
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

    // Wait (bounded, generously for a loaded machine) for /readyz to turn 200.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    loop {
        if let Some(resp) = http_get(admin, "/readyz").await {
            if resp.starts_with("HTTP/1.1 200") {
                break;
            }
            last = resp;
        }
        if let Ok(Some(status)) = child.0.try_wait() {
            panic!("operator exited early with {status}");
        }
        if Instant::now() >= deadline {
            let _ = child.0.kill();
            let mut stderr = String::new();
            if let Some(mut e) = child.0.stderr.take() {
                use std::io::Read;
                let _ = e.read_to_string(&mut stderr);
            }
            panic!("never became ready; last /readyz: {last}\noperator log:\n{stderr}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let livez = http_get(admin, "/livez").await.expect("livez");
    assert!(livez.starts_with("HTTP/1.1 200"), "{livez}");
    let metrics = http_get(admin, "/metrics").await.expect("metrics");
    assert!(metrics.contains("kvpool_operator_leader 1"), "{metrics}");

    let pid = child.0.id().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    let status = tokio::task::spawn_blocking(move || {
        let status = child.0.wait().expect("wait");
        let mut stderr = String::new();
        if let Some(mut e) = child.0.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut stderr);
        }
        (status, stderr)
    })
    .await
    .expect("join");
    assert!(status.0.success(), "exit {}: {}", status.0, status.1);
    assert!(status.1.contains("SIGTERM received"), "{}", status.1);
    assert!(status.1.contains("kvpool-operator stopped"), "{}", status.1);
}

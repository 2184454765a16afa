//! Issue 15: TLS on the master's port over loopback. A TLS master serves gRPC and fast-lane
//! calls to clients that trust its CA; a client that does not is told TLS verification
//! failed; plaintext clients and (with mutual TLS) clients without a certificate are refused
//! and counted; slow TLS handshakes are closed at the handshake deadline while real clients
//! are served. A rotated certificate (files swapped as a Kubernetes Secret volume swaps them)
//! serves new connections after the reload while open ones go on; a broken one leaves the old
//! certificate serving and is counted. Certificates come from `kvpool up --tls`'s generator.

mod pool_support;

use std::path::Path;
use std::time::Duration;

use kvpool_client::master::{ClientConfig, ClientError, MasterClient, MasterTls};
use kvpool_core::master::PutOptions;
use kvpool_harness::scrape::metric_value;
use kvpool_harness::tls::{TlsFiles, write_throwaway};
use kvpool_proto::auth::AuthKey;
use pool_support::{
    InProcessMaster, assert_closed_within, assert_committed, current_thread_runtime, dram_segment,
    error_chain, eventually, http_get, in_process_master, put_allocated,
};

const KEY: &[u8] = b"kvpool-test-pool-key-0123456789";
const MIB: u64 = 1 << 20;

/// A new client trusting the CA of `trusted` is served; one trusting only the CA of `other` is
/// refused (`why` says why it must be). The served client.
async fn served_not_refused(
    f: &InProcessMaster,
    trusted: &TlsFiles,
    other: &TlsFiles,
    why: &str,
) -> MasterClient {
    let c = client(f, trusting(trusted));
    assert_eq!(c.exists(&[b"k"]).await.expect("trusted CA"), vec![false]);
    tls_refusal(f, trusting(other), why).await;
    c
}

/// A new client of `f` with `tls` fails its first call because it refuses the master's
/// certificate (`why` says why it must); the error's text with its sources.
async fn tls_refusal(f: &InProcessMaster, tls: MasterTls, why: &str) -> String {
    let e = first_call_error(f, tls, why).await;
    let text = error_chain(&e);
    assert!(matches!(e, ClientError::TlsVerify { .. }), "{text}");
    text
}

/// The text of `f`'s `/metrics` page.
async fn master_metrics(f: &InProcessMaster) -> String {
    let (_, text) = http_get(f.master.admin_addr, "/metrics")
        .await
        .expect("metrics");
    text
}

/// A master with TLS from `files` (mutual with `mutual`), handshake deadline `handshake`.
async fn tls_master(files: &TlsFiles, mutual: bool, handshake: Duration) -> InProcessMaster {
    in_process_master(KEY, |a| {
        a.tls_cert_file = Some(files.master_cert.clone());
        a.tls_key_file = Some(files.master_key.clone());
        a.tls_client_ca_file = mutual.then(|| files.ca.clone());
        a.handshake_timeout = handshake;
    })
    .await
}

/// A temporary directory holding the certificates of [`pki`], and a [`tls_master`] of them.
async fn pki_and_master(
    mutual: bool,
    handshake: Duration,
) -> (tempfile::TempDir, TlsFiles, InProcessMaster) {
    let dir = tempfile::tempdir().expect("tmp");
    let files = pki(dir.path());
    let f = tls_master(&files, mutual, handshake).await;
    (dir, files, f)
}

/// The error of a new client of `f` with `tls` on its first call, which must fail (`why`).
async fn first_call_error(f: &InProcessMaster, tls: MasterTls, why: &str) -> ClientError {
    client(f, tls).exists(&[b"k"]).await.expect_err(why)
}

fn pki(dir: &Path) -> TlsFiles {
    write_throwaway(dir, "kvpool test CA", &["127.0.0.1", "localhost"]).expect("certificates")
}

/// Certificates of another CA (another name too: a CA of the same name would be taken for the
/// issuer and fail on the signature instead).
fn stranger_pki(dir: &Path) -> TlsFiles {
    write_throwaway(dir, "some other CA", &["127.0.0.1", "localhost"]).expect("certificates")
}

/// A client of `f`'s master with `tls`; connection failures are not retried for long.
fn client(f: &InProcessMaster, tls: MasterTls) -> MasterClient {
    let config = ClientConfig {
        failover_budget: Duration::from_millis(300),
        tls,
        ..ClientConfig::default()
    };
    MasterClient::new(
        vec![f.master.grpc_addr.to_string()],
        AuthKey::from_bytes(KEY).expect("key"),
        config,
    )
    .expect("client")
}

fn trusting(files: &TlsFiles) -> MasterTls {
    MasterTls {
        ca_file: Some(files.ca.clone()),
        ..MasterTls::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_master_serves_grpc_and_fast_lane_calls_to_a_client_that_trusts_its_ca() {
    let (_dir, files, f) = pki_and_master(false, Duration::from_secs(10)).await;
    let c = client(&f, trusting(&files));
    c.mount_segment(&dram_segment("a", 64 * MIB))
        .await
        .expect("mount over TLS");
    let (put_id, _) = put_allocated(&c, b"tls/k", MIB, &PutOptions::default()).await;
    c.put_end(b"tls/k", put_id).await.expect("put_end");
    // A fork's calls go over the fast lane, inside TLS too.
    let fork = c.fork(tokio::runtime::Handle::current());
    let fork = tokio::task::spawn_blocking(move || {
        let rt = current_thread_runtime();
        rt.block_on(async {
            assert_committed(&fork, b"tls/k", b"tls/missing", MIB).await;
            assert_eq!(fork.longest_prefix(&[b"tls/k"]).await.expect("prefix"), 1);
        });
        fork
    })
    .await
    .expect("fork thread");
    let metrics = master_metrics(&f).await;
    for needle in [
        "kvpool_master_fast_lane_connections 1",
        "kvpool_master_requests_total{method=\"exists\",result=\"ok\"} 1",
        "kvpool_master_requests_total{method=\"get\",result=\"ok\"} 1",
        "kvpool_master_requests_total{method=\"put_start\",result=\"ok\"} 1",
    ] {
        assert!(metrics.contains(needle), "missing {needle} in\n{metrics}");
    }
    assert_eq!(f.master.core.metrics.conn_refusals("tls_handshake"), 0);
    drop(fork);
}

#[tokio::test]
async fn a_client_that_does_not_trust_the_master_fails_naming_tls_verification() {
    let (_dir, files, f) = pki_and_master(false, Duration::from_secs(10)).await;
    let other = tempfile::tempdir().expect("tmp");
    let stranger = stranger_pki(other.path());
    let text = tls_refusal(&f, trusting(&stranger), "an untrusted master").await;
    assert!(text.contains("TLS verification"), "{text}");
    assert!(text.contains("UnknownIssuer"), "{text}");
    // Trusted CA, but the certificate does not carry the name the client verifies.
    let misnamed = MasterTls {
        server_name: Some("master.elsewhere.example".into()),
        ..trusting(&files)
    };
    let text = tls_refusal(&f, misnamed, "a certificate for another name").await;
    assert!(text.contains("certificate not valid for name"), "{text}");
    assert!(text.contains("master.elsewhere.example"), "{text}");
    // The right CA and name: served.
    let ok = client(&f, trusting(&files)).exists(&[b"k"]).await;
    assert_eq!(ok.expect("trusted"), vec![false]);
}

#[tokio::test]
async fn plaintext_clients_of_a_tls_port_are_refused_and_counted() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_dir, _, f) = pki_and_master(false, Duration::from_secs(10)).await;
    let m = &f.master.core.metrics;
    let e = first_call_error(&f, MasterTls::default(), "plaintext gRPC to a TLS port").await;
    assert!(
        matches!(e, ClientError::Connect { .. } | ClientError::Rpc { .. }),
        "{}",
        error_chain(&e)
    );
    assert!(m.conn_refusals("tls_handshake") >= 1);
    // A plaintext fast-lane preface is closed without an answer.
    let before = m.conn_refusals("tls_handshake");
    let mut s = tokio::net::TcpStream::connect(f.master.grpc_addr)
        .await
        .expect("connect");
    s.write_all(&kvpool_proto::fast::PREFACE)
        .await
        .expect("write");
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the connection was not closed");
    assert!(buf.is_empty(), "answered in plaintext: {buf:?}");
    assert!(
        eventually(Duration::from_secs(5), || m.conn_refusals("tls_handshake")
            == before + 1)
        .await
    );
    let metrics = master_metrics(&f).await;
    let refused = metric_value(
        &metrics,
        "kvpool_master_connections_refused_total",
        &["reason=\"tls_handshake\""],
    );
    assert!(refused.is_some_and(|n| n >= 1.0), "{metrics}");
}

#[tokio::test]
async fn with_mutual_tls_a_client_without_a_certificate_is_refused() {
    let (_dir, files, f) = pki_and_master(true, Duration::from_secs(10)).await;
    let m = &f.master.core.metrics;
    let e = first_call_error(&f, trusting(&files), "no client certificate").await;
    assert!(m.conn_refusals("tls_handshake") >= 1, "{}", error_chain(&e));
    // A certificate of another CA is refused too.
    let other = tempfile::tempdir().expect("tmp");
    let stranger = stranger_pki(other.path());
    let before = m.conn_refusals("tls_handshake");
    let foreign = MasterTls {
        cert_file: Some(stranger.client_cert.clone()),
        key_file: Some(stranger.client_key.clone()),
        ..trusting(&files)
    };
    first_call_error(&f, foreign, "a client certificate of another CA").await;
    assert!(m.conn_refusals("tls_handshake") > before);
    // With the pool CA's client certificate: served, on both lanes.
    let mutual = MasterTls {
        cert_file: Some(files.client_cert.clone()),
        key_file: Some(files.client_key.clone()),
        ..trusting(&files)
    };
    let c = client(&f, mutual);
    assert_eq!(c.exists(&[b"k"]).await.expect("mutual TLS"), vec![false]);
    let fork = c.fork(tokio::runtime::Handle::current());
    let (found, fork) = tokio::task::spawn_blocking(move || {
        let rt = current_thread_runtime();
        (rt.block_on(fork.exists(&[b"k"])), fork)
    })
    .await
    .expect("fork thread");
    assert_eq!(found.expect("fast lane with mutual TLS"), vec![false]);
    let metrics = master_metrics(&f).await;
    assert_eq!(
        metric_value(&metrics, "kvpool_master_fast_lane_connections", &[]),
        Some(1.0),
        "{metrics}"
    );
    drop(fork);
}

/// Connections that stop half-way through the TLS handshake, and ones that never start it,
/// hold their slots no longer than the handshake deadline, and a real client is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_tls_handshakes_are_closed_at_the_deadline_while_real_clients_are_served() {
    use tokio::io::AsyncWriteExt;
    let (_dir, files, f) = pki_and_master(false, Duration::from_secs(1)).await;
    let m = &f.master.core.metrics;
    let mut held = Vec::new();
    for i in 0..12 {
        let mut s = tokio::net::TcpStream::connect(f.master.grpc_addr)
            .await
            .expect("connect");
        if i % 2 == 0 {
            // A TLS record header announcing a ClientHello whose body never comes.
            s.write_all(&[22, 3, 1, 0, 200, 1]).await.expect("write");
        }
        held.push(s);
    }
    let c = client(&f, trusting(&files));
    assert_eq!(c.exists(&[b"k"]).await.expect("served"), vec![false]);
    assert_closed_within(&mut held, Duration::from_secs(5)).await;
    assert!(
        eventually(Duration::from_secs(5), || m
            .conn_refusals("handshake_timeout")
            >= 12)
        .await,
        "cut at the deadline: {}",
        m.conn_refusals("handshake_timeout")
    );
    assert_eq!(m.conn_refusals("tls_handshake"), 0);
    // The real client's connection, past the deadline too, still serves.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(c.exists(&[b"k"]).await.expect("served"), vec![false]);
}

#[test]
fn throwaway_keys_are_private_and_the_master_accepts_its_certificate() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tmp");
    let files = pki(dir.path());
    for key in [&files.master_key, &files.client_key] {
        let mode = std::fs::metadata(key).expect("key").permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{}", key.display());
        let text = std::fs::read_to_string(key).expect("key");
        assert!(text.contains("PRIVATE KEY"), "{text}");
    }
    for cert in [&files.ca, &files.master_cert, &files.client_cert] {
        let text = std::fs::read_to_string(cert).expect("cert");
        assert!(text.starts_with("-----BEGIN CERTIFICATE-----"), "{text}");
    }
    kvpool_master::service::tls_acceptor(&files.master_cert, &files.master_key, Some(&files.ca))
        .expect("the master accepts its throw-away certificate");
    // A key that is not the certificate's is refused at start-up, naming the problem.
    let Err(e) = kvpool_master::service::tls_acceptor(&files.master_cert, &files.client_key, None)
    else {
        panic!("a key that is not the certificate's was accepted");
    };
    assert_eq!(e.category(), "config", "{e}");
    let Err(e) = kvpool_master::service::tls_acceptor(&files.master_key, &files.master_key, None)
    else {
        panic!("a key file was taken for a certificate");
    };
    assert!(e.to_string().contains("no PEM certificate"), "{e}");
}

/// A Kubernetes-style volume of the master's certificate and key: `data` is a symlink to a
/// versioned directory, and a rotation swaps it with one rename, so that a reader sees the old
/// pair or the new one, never half of each.
struct CertVolume {
    dir: std::path::PathBuf,
    version: u32,
}

impl CertVolume {
    fn new(dir: &Path, files: &TlsFiles) -> CertVolume {
        let mut v = CertVolume {
            dir: dir.to_owned(),
            version: 0,
        };
        v.rotate(&files.master_cert, &files.master_key);
        v
    }

    fn cert(&self) -> std::path::PathBuf {
        self.dir.join("data").join("tls.crt")
    }

    fn key(&self) -> std::path::PathBuf {
        self.dir.join("data").join("tls.key")
    }

    /// Publish `cert` and `key` (copied) as the volume's pair in one rename.
    fn rotate(&mut self, cert: &Path, key: &Path) {
        self.version += 1;
        let version = self.dir.join(format!("v{}", self.version));
        std::fs::create_dir(&version).expect("version dir");
        std::fs::copy(cert, version.join("tls.crt")).expect("cert");
        std::fs::copy(key, version.join("tls.key")).expect("key");
        let tmp = self.dir.join("data.tmp");
        std::os::unix::fs::symlink(&version, &tmp).expect("symlink");
        std::fs::rename(&tmp, self.dir.join("data")).expect("swap");
    }

    /// Replace the certificate of the current pair with `text` (one rename).
    fn replace_cert(&self, text: &[u8]) {
        let tmp = self.dir.join("cert.tmp");
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, self.cert()).expect("rename");
    }
}

/// A TLS master serving the certificate of `volume`, reading it again every 100 ms.
async fn reloading_master(volume: &CertVolume) -> InProcessMaster {
    in_process_master(KEY, |a| {
        a.tls_cert_file = Some(volume.cert());
        a.tls_key_file = Some(volume.key());
        a.tls_reload_interval = Duration::from_millis(100);
    })
    .await
}

/// `kvpool_master_tls_reloads_total{result}` as the admin endpoint serves it.
async fn reloads(f: &InProcessMaster, result: &str) -> u64 {
    let metrics = master_metrics(f).await;
    let series = format!("kvpool_master_tls_reloads_total{{result=\"{result}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// Wait (5 s at most) until the master counted `n` reloads with `result`.
async fn await_reloads(f: &InProcessMaster, result: &str, n: u64) {
    for _ in 0..500 {
        if reloads(f, result).await >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(reloads(f, result).await, n, "reloads with result {result}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_of_a_new_ca_serves_new_connections_after_the_reload() {
    let dir = tempfile::tempdir().expect("tmp");
    let (old_dir, new_dir) = (dir.path().join("old"), dir.path().join("new"));
    let volume_dir = dir.path().join("volume");
    for d in [&old_dir, &new_dir, &volume_dir] {
        std::fs::create_dir(d).expect("dir");
    }
    let old = pki(&old_dir);
    let new = stranger_pki(&new_dir);
    let mut volume = CertVolume::new(&volume_dir, &old);
    let f = reloading_master(&volume).await;
    // A client of the old CA, connected before the rotation.
    let why = "the new CA does not sign the served certificate yet";
    let before = served_not_refused(&f, &old, &new, why).await;

    volume.rotate(&new.master_cert, &new.master_key);
    await_reloads(&f, "ok", 1).await;
    // New connections get the new certificate: a client trusting only the new CA is served,
    // one trusting only the old CA is not.
    let why = "the old CA's client on a new connection";
    served_not_refused(&f, &new, &old, why).await;
    // The connection opened before the rotation is untouched.
    assert_eq!(
        before.exists(&[b"k"]).await.expect("open connection"),
        vec![false]
    );
    assert_eq!(reloads(&f, "error").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_certificate_file_keeps_the_old_certificate_serving_and_counts_an_error() {
    let dir = tempfile::tempdir().expect("tmp");
    let (pki_dir, volume_dir) = (dir.path().join("pki"), dir.path().join("volume"));
    for d in [&pki_dir, &volume_dir] {
        std::fs::create_dir(d).expect("dir");
    }
    let files = pki(&pki_dir);
    let volume = CertVolume::new(&volume_dir, &files);
    let f = reloading_master(&volume).await;
    volume.replace_cert(b"-----BEGIN CERTIFICATE-----\nnot base64 at all\n");
    await_reloads(&f, "error", 1).await;
    // Still served with the certificate loaded before, on a new connection.
    let c = client(&f, trusting(&files));
    assert_eq!(
        c.exists(&[b"k"]).await.expect("old certificate"),
        vec![false]
    );
    // The same broken content is not counted again at every pass.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(reloads(&f, "error").await, 1);
    assert_eq!(reloads(&f, "ok").await, 0);
    // Repaired (the same certificate as before): served and counted as a reload.
    volume.replace_cert(&std::fs::read(&files.master_cert).expect("cert"));
    await_reloads(&f, "ok", 1).await;
    let c = client(&f, trusting(&files));
    assert_eq!(c.exists(&[b"k"]).await.expect("served"), vec![false]);
}

/// `kvpool agent run --master-ca-file` reaches the agent's master client: against a TLS
/// master, the agent started without it is refused at the handshake and never mounts; the one
/// started with it mounts its segment (the harness clears the `KVPOOL_MASTER_*` variables, so
/// the flag is the only way TLS can be on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_started_with_master_ca_file_joins_a_tls_master() {
    let (dir, files, f) = pki_and_master(false, Duration::from_secs(10)).await;
    let key_file = pool_support::write_key(dir.path(), KEY);
    let grpc = f.master.grpc_addr;
    let (mut plain, _) = pool_support::start_agent(dir.path(), "plain", grpc, &key_file, "8MiB");
    let m = &f.master.core.metrics;
    assert!(
        eventually(Duration::from_secs(30), || m.conn_refusals("tls_handshake")
            >= 1)
        .await,
        "the agent without --master-ca-file was not refused at the TLS handshake"
    );
    let ca = vec![
        "--master-ca-file".to_owned(),
        files.ca.display().to_string(),
    ];
    let (mut agent, addrs) =
        pool_support::start_agent_args(dir.path(), "tls", grpc, &key_file, "8MiB", "", &ca);
    pool_support::wait_ready(&addrs, &mut agent);
    let c = client(&f, trusting(&files));
    let stats = pool_support::wait_stats(&c, "the TLS agent mounted", &mut [&mut agent], |s| {
        s.segments >= 1
    })
    .await;
    assert_eq!(
        stats.nodes_alive, 1,
        "only the agent with the flag joined: {stats:?}"
    );
    plain
        .assert_running()
        .expect("the plaintext agent keeps retrying");
}

//! End-to-end speed of the TCP lanes on loopback, plain against per-frame integrity
//! (`require`, encrypted records) against TLS (`require`), in one process and one run, so that
//! the ratios compare like with like (docs/benchmarks.md "TLS and per-frame integrity of the
//! TCP lanes"). A target and an initiator engine (2 lanes each, inline transfers off) move
//! batches of 8 MiB (128 x 64 KiB or 8 x 1 MiB) with WRITE and READ, one submitting thread.
//! Run: `cargo run --release -p kvpool-transfer --example lane_speed [seconds per cell]`;
//! prints GB/s per cell and each mode's share of plain. I/O boundary: loopback sockets, a
//! temporary directory for the throw-away certificates, stdout.

#![allow(clippy::unwrap_used, clippy::expect_used)] // an example: failing loudly is the point

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpool_transfer::*;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

const MIB: usize = 1024 * 1024;
const BATCH_BYTES: usize = 8 * MIB;

/// A CA and a certificate for 127.0.0.1 in `dir`; the TLS setting both engines use.
fn tls_files(dir: &Path) -> TransferTls {
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "lane_speed CA");
    let ca = CertifiedIssuer::self_signed(ca_params, ca_key).expect("CA");
    let key = KeyPair::generate().expect("key");
    let cert = CertificateParams::new(vec!["127.0.0.1".to_owned()])
        .expect("cert")
        .signed_by(&key, &ca)
        .expect("cert");
    let (ca_path, cert_path, key_path) = (
        dir.join("ca.pem"),
        dir.join("cert.pem"),
        dir.join("key.pem"),
    );
    std::fs::write(&ca_path, ca.pem()).expect("write");
    std::fs::write(&cert_path, cert.pem()).expect("write");
    std::fs::write(&key_path, key.serialize_pem()).expect("write");
    TransferTls {
        mode: TlsMode::Require,
        cert_file: Some(cert_path),
        key_file: Some(key_path),
        ca_file: Some(ca_path),
        server_name: None,
    }
}

fn engine(
    node: &str,
    integrity: Integrity,
    tls: &TransferTls,
    dir: Arc<StaticDirectory>,
) -> TransferEngine {
    TransferEngine::new(
        EngineConfig {
            node: node.into(),
            lanes: 2,
            inline_max_bytes: 0,
            integrity,
            tls: tls.clone(),
            ..EngineConfig::default()
        },
        AuthKey::new(*b"lane-speed-key-0123456789").expect("key"),
        dir,
        TransferMetrics::unregistered().expect("metrics"),
    )
    .expect("engine")
}

/// GB/s of `op` with `block`-byte requests for `secs` seconds.
fn cell(integrity: Integrity, tls: &TransferTls, op: TransferOp, block: usize, secs: f64) -> f64 {
    let dir = Arc::new(StaticDirectory::new());
    let target = engine("t", integrity, tls, dir.clone());
    let remote_mem = target
        .register(
            "t/seg",
            Arc::new(Segment::host(BATCH_BYTES, HostOptions::default()).expect("segment")),
        )
        .expect("register");
    let server = target
        .listen_tcp("127.0.0.1:0".parse().expect("addr"))
        .expect("listen");
    dir.insert(target.describe(&remote_mem, vec![Endpoint::Tcp(server.local_addr())]));
    let initiator = engine("i", integrity, tls, dir);
    let local = initiator
        .register(
            "i/buf",
            Arc::new(Segment::host(BATCH_BYTES, HostOptions::default()).expect("segment")),
        )
        .expect("register");
    local.segment().fill(0, BATCH_BYTES, 0x5a).expect("fill");
    let remote = initiator.open("t/seg").expect("open");
    let batch: Vec<TransferRequest> = (0..BATCH_BYTES / block)
        .map(|k| TransferRequest {
            op,
            local: local.clone(),
            local_offset: (k * block) as u64,
            remote: remote.clone(),
            remote_offset: (k * block) as u64,
            len: block as u64,
        })
        .collect();
    // One batch to warm up (lanes dialed, buffers grown).
    initiator.transfer(batch.clone()).expect("transfer");
    let start = Instant::now();
    let mut bytes = 0usize;
    while start.elapsed() < Duration::from_secs_f64(secs) {
        initiator.transfer(batch.clone()).expect("transfer");
        bytes += BATCH_BYTES;
    }
    bytes as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(3.0);
    let dir = tempfile::tempdir().expect("temp dir");
    let tls = tls_files(dir.path());
    let off = TransferTls::default();
    println!(
        "{secs} s per cell, batches of {} MiB, 2 lanes, one thread",
        BATCH_BYTES / MIB
    );
    println!("op     block     plain GB/s  integrity GB/s (share)  tls GB/s (share)");
    for block in [64 * 1024, MIB] {
        for (op, name) in [(TransferOp::Write, "write"), (TransferOp::Read, "read")] {
            let plain = cell(Integrity::Allow, &off, op, block, secs);
            let sealed = cell(Integrity::Require, &off, op, block, secs);
            let over_tls = cell(Integrity::Allow, &tls, op, block, secs);
            println!(
                "{name:<6} {:>5} KiB {plain:>10.3}  {sealed:>10.3} ({:>5.1}%)  {over_tls:>10.3} ({:>5.1}%)",
                block / 1024,
                100.0 * sealed / plain,
                100.0 * over_tls / plain,
            );
        }
    }
}

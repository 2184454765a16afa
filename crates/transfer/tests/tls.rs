//! TLS on the transfer engine's TCP connections over real loopback sockets and real rustls
//! handshakes: a round trip of WRITE and READ (the bytes checked, and a recording proxy shows
//! no plaintext on the wire); `require` refuses a plaintext initiator with the `tls` error;
//! `allow` serves TLS and plaintext initiators alike; an untrusted CA, a wrong server name and
//! a target with TLS off fail with errors naming the reason, each counted in
//! `kvpool_transfer_tls_handshake_failures_total`; a client trickling a TLS handshake is cut
//! at the handshake deadline while a real initiator is still served.

#![allow(clippy::unwrap_used)] // test crate: helpers outside #[test] fns unwrap too

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpool_transfer::*;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

mod support;

use support::MIB;

/// A CA and a target certificate for `names`, written into `dir`: (ca, cert, key).
fn certs(dir: &Path, tag: &str, names: &[&str]) -> (PathBuf, PathBuf, PathBuf) {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, format!("{tag} test CA"));
    let ca = CertifiedIssuer::self_signed(ca_params, ca_key).unwrap();
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
        .unwrap()
        .signed_by(&leaf_key, &ca)
        .unwrap();
    let paths = (
        dir.join(format!("{tag}-ca.pem")),
        dir.join(format!("{tag}-cert.pem")),
        dir.join(format!("{tag}-key.pem")),
    );
    std::fs::write(&paths.0, ca.pem()).unwrap();
    std::fs::write(&paths.1, leaf.pem()).unwrap();
    std::fs::write(&paths.2, leaf_key.serialize_pem()).unwrap();
    paths
}

struct Files {
    _dir: tempfile::TempDir,
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
    other_ca: PathBuf,
}

fn files() -> Files {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = certs(dir.path(), "pool", &["127.0.0.1", "target.kvpool"]);
    let (other_ca, _, _) = certs(dir.path(), "other", &["127.0.0.1"]);
    Files {
        _dir: dir,
        ca,
        cert,
        key,
        other_ca,
    }
}

fn target_tls(f: &Files, mode: TlsMode) -> TransferTls {
    TransferTls {
        mode,
        cert_file: Some(f.cert.clone()),
        key_file: Some(f.key.clone()),
        // Its own dialing (require) verifies other targets with the pool's CA.
        ca_file: Some(f.ca.clone()),
        ..TransferTls::default()
    }
}

fn initiator_tls(mode: TlsMode, ca: &Path, server_name: Option<&str>) -> TransferTls {
    TransferTls {
        mode,
        ca_file: Some(ca.to_owned()),
        server_name: server_name.map(str::to_owned),
        ..TransferTls::default()
    }
}

fn config(node: &str, tls: TransferTls) -> EngineConfig {
    EngineConfig {
        node: node.into(),
        lanes: 2,
        slice_size: MIB as u64,
        window: 4,
        inline_max_bytes: 0,
        tls,
        timeout: Duration::from_secs(5),
        handshake_timeout: Duration::from_secs(1),
        ..EngineConfig::default()
    }
}

/// A target engine serving one 4 MiB segment, and its server.
struct Target {
    engine: TransferEngine,
    server: TcpServer,
    mem: LocalSegment,
    dir: Arc<StaticDirectory>,
}

fn target(tls: TransferTls) -> Target {
    let dir = Arc::new(StaticDirectory::new());
    let (engine, server, mem) = support::listening_target(config("node-t", tls), &dir);
    dir.insert(engine.describe(&mem, vec![Endpoint::Tcp(server.local_addr())]));
    Target {
        engine,
        server,
        mem,
        dir,
    }
}

/// An initiator with a 4 MiB buffer that reaches segments through `t`'s directory.
fn initiator(t: &Target, tls: TransferTls) -> (TransferEngine, LocalSegment) {
    support::initiator(config("node-i", tls), &t.dir)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(37).wrapping_add(seed))
        .collect()
}

fn request(
    op: TransferOp,
    local: &LocalSegment,
    remote: &RemoteSegment,
    len: usize,
) -> TransferRequest {
    TransferRequest {
        op,
        local: local.clone(),
        local_offset: 0,
        remote: remote.clone(),
        remote_offset: 512,
        len: len as u64,
    }
}

/// Write `len` bytes to the target and read them back; both must match what was sent.
fn round_trip(i: &TransferEngine, local: &LocalSegment, t: &Target, len: usize, seed: u8) {
    let remote = i.open("t/dram0").unwrap();
    let data = pattern(len, seed);
    local.segment().write_at(0, &data).unwrap();
    i.transfer(vec![request(TransferOp::Write, local, &remote, len)])
        .unwrap();
    let mut got = vec![0u8; len];
    t.mem.segment().read_at(512, &mut got).unwrap();
    assert!(got == data, "the target holds what was written");
    local.segment().fill(0, len, 0).unwrap();
    i.transfer(vec![request(TransferOp::Read, local, &remote, len)])
        .unwrap();
    local.segment().read_at(0, &mut got).unwrap();
    assert!(got == data, "the initiator read back what it wrote");
}

fn tls_failures(e: &TransferEngine, side: &str, reason: &str) -> u64 {
    e.metrics()
        .tls_handshake_failures
        .with_label_values(&[side, reason])
        .get()
}

/// A proxy in front of `to` that keeps every byte it relays towards `to`.
fn recording_proxy(to: SocketAddr) -> (SocketAddr, Arc<Mutex<Vec<u8>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut from) = c else { return };
            let mut up = TcpStream::connect(to).unwrap();
            let (mut from2, mut up2) = (from.try_clone().unwrap(), up.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut up2, &mut from2);
                let _ = from2.shutdown(Shutdown::Both);
            });
            let record = record.clone();
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    match from.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            record.lock().unwrap().extend_from_slice(&buf[..n]);
                            if up.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    }
                }
                let _ = up.shutdown(Shutdown::Both);
            });
        }
    });
    (addr, seen)
}

#[test]
fn tls_round_trip_moves_the_bytes_and_shows_none_on_the_wire() {
    let f = files();
    let t = target(target_tls(&f, TlsMode::Require));
    let (proxy, seen) = recording_proxy(t.server.local_addr());
    t.dir
        .insert(t.engine.describe(&t.mem, vec![Endpoint::Tcp(proxy)]));
    let (i, local) = initiator(&t, initiator_tls(TlsMode::Require, &f.ca, None));
    // 3 MiB: several slices over both lanes; then a small one.
    round_trip(&i, &local, &t, 3 * MIB + 77, 5);
    round_trip(&i, &local, &t, 4096, 6);
    let wire = seen.lock().unwrap().clone();
    assert!(wire.len() > 3 * MIB, "the payload went through the proxy");
    let probe = &pattern(3 * MIB, 5)[1000..1064];
    assert!(
        !wire.windows(probe.len()).any(|w| w == probe),
        "no plaintext payload on the wire"
    );
    assert_eq!(wire[0], 0x16, "a TLS handshake record opens the connection");
}

#[test]
fn require_refuses_a_plaintext_initiator_with_the_tls_error() {
    let f = files();
    let t = target(target_tls(&f, TlsMode::Require));
    let (i, _) = initiator(&t, TransferTls::default());
    let e = i.open("t/dram0").unwrap_err();
    let chain = format!("{e} {e:?}");
    assert!(chain.contains("requires TLS"), "{chain}");
    assert!(chain.contains("tls"), "{chain}");
    assert!(tls_failures(&t.engine, "target", "plaintext_refused") >= 1);
}

#[test]
fn allow_serves_tls_and_plaintext_initiators() {
    let f = files();
    let t = target(target_tls(&f, TlsMode::Allow));
    let (tls_i, tls_mem) = initiator(&t, initiator_tls(TlsMode::Require, &f.ca, None));
    round_trip(&tls_i, &tls_mem, &t, MIB + 3, 1);
    let (plain_i, plain_mem) = initiator(&t, TransferTls::default());
    round_trip(&plain_i, &plain_mem, &t, MIB + 5, 2);
    // A named server name also verifies (the certificate carries it).
    let (named_i, named_mem) = initiator(
        &t,
        initiator_tls(TlsMode::Require, &f.ca, Some("target.kvpool")),
    );
    round_trip(&named_i, &named_mem, &t, 4096, 3);
}

#[test]
fn an_untrusted_ca_or_a_wrong_name_fails_naming_the_reason() {
    let f = files();
    let t = target(target_tls(&f, TlsMode::Require));
    let (i, _) = initiator(&t, initiator_tls(TlsMode::Require, &f.other_ca, None));
    let e = i.open("t/dram0").unwrap_err();
    let chain = format!("{e} {e:?}");
    assert!(chain.contains("unknown_issuer"), "{chain}");
    assert_eq!(tls_failures(&i, "initiator", "unknown_issuer"), 1);

    let (i, _) = initiator(
        &t,
        initiator_tls(TlsMode::Require, &f.ca, Some("someone-else.kvpool")),
    );
    let e = i.open("t/dram0").unwrap_err();
    let chain = format!("{e} {e:?}");
    assert!(chain.contains("wrong_name"), "{chain}");
    assert_eq!(tls_failures(&i, "initiator", "wrong_name"), 1);
    // The target saw the initiators reject its certificate.
    let deadline = Instant::now() + Duration::from_secs(5);
    while tls_failures(&t.engine, "target", "peer_alert") < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(tls_failures(&t.engine, "target", "peer_alert"), 2);
}

#[test]
fn a_target_with_tls_off_refuses_tls_and_settings_are_checked() {
    let f = files();
    let t = target(TransferTls::default());
    let (i, _) = initiator(&t, initiator_tls(TlsMode::Require, &f.ca, None));
    assert!(i.open("t/dram0").is_err());
    let deadline = Instant::now() + Duration::from_secs(5);
    while tls_failures(&t.engine, "target", "tls_off") < 1 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(tls_failures(&t.engine, "target", "tls_off"), 1);
    // require without a CA, a certificate without its key, serving without a certificate.
    let dir = Arc::new(StaticDirectory::new());
    let make = |tls: TransferTls| {
        TransferEngine::new(
            config("n", tls),
            support::key(),
            dir.clone(),
            TransferMetrics::unregistered().unwrap(),
        )
    };
    let e = make(TransferTls {
        mode: TlsMode::Require,
        ..TransferTls::default()
    })
    .unwrap_err();
    assert!(e.to_string().contains("CA file"), "{e}");
    let e = make(TransferTls {
        mode: TlsMode::Allow,
        cert_file: Some(f.cert.clone()),
        ..TransferTls::default()
    })
    .unwrap_err();
    assert!(e.to_string().contains("go together"), "{e}");
    let e = make(TransferTls {
        mode: TlsMode::Allow,
        ..TransferTls::default()
    })
    .unwrap()
    .listen_tcp("127.0.0.1:0".parse().unwrap())
    .unwrap_err();
    assert!(e.to_string().contains("certificate and a key"), "{e}");
}

#[test]
fn a_trickling_tls_client_is_cut_at_the_handshake_deadline() {
    let f = files();
    let t = target(target_tls(&f, TlsMode::Require));
    let addr = t.server.local_addr();
    // A TLS handshake record header, then one byte every 200 ms: never a whole ClientHello.
    let slow: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                let start = Instant::now();
                let mut s = TcpStream::connect(addr).unwrap();
                s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00]).unwrap();
                s.set_read_timeout(Some(Duration::from_millis(200)))
                    .unwrap();
                let mut b = [0u8; 64];
                loop {
                    if start.elapsed() > Duration::from_secs(10) {
                        return start.elapsed();
                    }
                    if s.write_all(&[0x01]).is_err() {
                        return start.elapsed();
                    }
                    match s.read(&mut b) {
                        Ok(0) => return start.elapsed(),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                        _ => return start.elapsed(),
                    }
                }
            })
        })
        .collect();
    // Meanwhile a real initiator is served.
    std::thread::sleep(Duration::from_millis(100));
    let (i, local) = initiator(&t, initiator_tls(TlsMode::Require, &f.ca, None));
    round_trip(&i, &local, &t, 64 * 1024, 9);
    for h in slow {
        let held = h.join().unwrap();
        assert!(
            held < Duration::from_secs(3),
            "a trickling client was held {held:?} (handshake deadline 1 s)"
        );
    }
    assert!(tls_failures(&t.engine, "target", "timeout") >= 4);
    assert!(
        t.engine
            .metrics()
            .target_closed
            .with_label_values(&["handshake_timeout"])
            .get()
            >= 4
    );
}

//! Per-frame integrity of the TCP lanes over real loopback sockets: round trips of READ,
//! WRITE, READV and WRITEV with it on; a man-in-the-middle proxy that flips a payload bit,
//! drops a record or replays one makes the transfer fail with the integrity error and leaves
//! no altered byte in the segment written; with integrity off the same flip goes through
//! (so the proxy really tampers); and the handshake's refusals name the setting at fault.

#![allow(clippy::unwrap_used)] // test crate: helpers outside #[test] fns unwrap too

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kvpool_transfer::*;

mod support;

use support::MIB;
/// Bytes of a record's length prefix and tag (see docs/transfer.md "Per-frame integrity").
const RECORD_LEN_BYTES: usize = 4;
const RECORD_TAG_BYTES: usize = 16;

fn config(node: &str, integrity: Integrity) -> EngineConfig {
    EngineConfig {
        node: node.into(),
        lanes: 1,
        slice_size: 1024 * 1024,
        window: 4,
        // Every transfer on the one lane, so the proxy sees it.
        inline_max_bytes: 0,
        integrity,
        timeout: Duration::from_secs(5),
        ..EngineConfig::default()
    }
}

/// What the proxy does to the bytes of one direction once armed.
#[derive(Clone, Copy, Debug)]
enum Tamper {
    /// Flip bit 0x04 of the `at`-th byte relayed after arming.
    Flip { at: usize },
    /// Leave out the `nth` sealed record after arming.
    Drop { nth: usize },
    /// Send the `nth` sealed record after arming twice.
    Replay { nth: usize },
}

/// Which direction the proxy tampers with.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    ToTarget,
    ToInitiator,
}

/// A TCP proxy in front of `target` that tampers with one direction once `armed`.
struct Proxy {
    addr: SocketAddr,
    armed: Arc<AtomicBool>,
}

fn proxy(target: SocketAddr, dir: Dir, tamper: Tamper) -> Proxy {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let armed = Arc::new(AtomicBool::new(false));
    let a = armed.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(client) = conn else { return };
            let Ok(server) = TcpStream::connect(target) else {
                return;
            };
            let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            let (up, down) = match dir {
                Dir::ToTarget => (Some(tamper), None),
                Dir::ToInitiator => (None, Some(tamper)),
            };
            let (a1, a2) = (a.clone(), a.clone());
            std::thread::spawn(move || relay(client, server, up, &a1));
            std::thread::spawn(move || relay(s2, c2, down, &a2));
        }
    });
    Proxy { addr, armed }
}

/// Copy `from` to `to`, tampering once (`tamper`) after `armed` is raised.
fn relay(mut from: TcpStream, mut to: TcpStream, tamper: Option<Tamper>, armed: &AtomicBool) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut seen = 0usize; // bytes relayed since armed
    let mut records = Vec::new(); // armed record tampering: bytes not yet split into records
    let mut record_no = 0usize;
    let mut done = false;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let chunk = &mut buf[..n];
        let active = !done && tamper.is_some() && armed.load(Ordering::SeqCst);
        let out: Vec<u8> = match (active, tamper) {
            (true, Some(Tamper::Flip { at })) => {
                if at >= seen && at < seen + n {
                    chunk[at - seen] ^= 0x04;
                    done = true;
                }
                seen += n;
                chunk.to_vec()
            }
            (true, Some(Tamper::Drop { nth } | Tamper::Replay { nth })) => {
                records.extend_from_slice(chunk);
                let mut out = Vec::new();
                // Split off whole records: [len u32 LE][bytes][tag].
                while !done && records.len() >= RECORD_LEN_BYTES {
                    let len = u32::from_le_bytes(records[..RECORD_LEN_BYTES].try_into().unwrap())
                        as usize;
                    let total = RECORD_LEN_BYTES + len + RECORD_TAG_BYTES;
                    if records.len() < total {
                        break;
                    }
                    let record: Vec<u8> = records.drain(..total).collect();
                    if record_no == nth {
                        done = true;
                        if matches!(tamper, Some(Tamper::Replay { .. })) {
                            out.extend_from_slice(&record);
                            out.extend_from_slice(&record);
                        }
                    } else {
                        out.extend_from_slice(&record);
                    }
                    record_no += 1;
                }
                if done {
                    out.append(&mut records);
                }
                out
            }
            _ => chunk.to_vec(),
        };
        if to.write_all(&out).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

struct Pair {
    target: TransferEngine,
    initiator: TransferEngine,
    _server: TcpServer,
    remote_mem: LocalSegment,
    local_mem: LocalSegment,
    armed: Arc<AtomicBool>,
}

/// A target (integrity `target`) and an initiator (integrity `initiator`) whose every
/// connection goes through a proxy tampering with `dir` as `tamper` says once armed.
fn pair(target: Integrity, initiator: Integrity, dir: Dir, tamper: Tamper) -> Pair {
    let dir_ = Arc::new(StaticDirectory::new());
    let (t, server, remote_mem) = support::listening_target(config("node-t", target), &dir_);
    let p = proxy(server.local_addr(), dir, tamper);
    dir_.insert(t.describe(&remote_mem, vec![Endpoint::Tcp(p.addr)]));
    let (i, local_mem) = support::initiator(config("node-i", initiator), &dir_);
    Pair {
        target: t,
        initiator: i,
        _server: server,
        remote_mem,
        local_mem,
        armed: p.armed,
    }
}

/// Bytes whose every value differs from its XOR with 0x04 and from 0.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u8).wrapping_mul(31).wrapping_add(seed) & 0xf0) | 0x01)
        .collect()
}

fn req(
    p: &Pair,
    remote: &RemoteSegment,
    op: TransferOp,
    lo: u64,
    ro: u64,
    len: u64,
) -> TransferRequest {
    TransferRequest {
        op,
        local: p.local_mem.clone(),
        local_offset: lo,
        remote: remote.clone(),
        remote_offset: ro,
        len,
    }
}

fn read_seg(seg: &LocalSegment, offset: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    seg.segment().read_at(offset, &mut out).unwrap();
    out
}

/// Integrity failures `engine` detected as `side` ("target" or "initiator").
fn integrity_failures(engine: &TransferEngine, side: &str) -> u64 {
    engine
        .metrics()
        .integrity_failures
        .with_label_values(&[side])
        .get()
}

/// Every byte of `got` is either what was there before (0) or what was sent: no altered byte.
fn assert_only_authentic(got: &[u8], sent: &[u8]) {
    for (i, (g, s)) in got.iter().zip(sent).enumerate() {
        assert!(*g == 0 || g == s, "byte {i} is {g:#04x}, sent {s:#04x}");
    }
}

/// One large `op` of `len` bytes between local offset 0 and remote offset 100, then eight of
/// 1000 bytes (local `small_local + k * 1000`, remote `3_500_000 + k * 2000`) small enough to
/// share one vectored frame.
fn large_and_small(
    p: &Pair,
    remote: &RemoteSegment,
    op: TransferOp,
    len: usize,
    small_local: u64,
) -> Vec<TransferRequest> {
    std::iter::once(req(p, remote, op, 0, 100, len as u64))
        .chain((0..8u64).map(|k| {
            req(
                p,
                remote,
                op,
                small_local + k * 1000,
                3_500_000 + k * 2000,
                1000,
            )
        }))
        .collect()
}

#[test]
fn integrity_round_trips_read_write_readv_and_writev() {
    let p = pair(
        Integrity::Allow,
        Integrity::Require,
        Dir::ToTarget,
        Tamper::Flip { at: usize::MAX },
    );
    let remote = p.initiator.open("t/dram0").unwrap();
    let data = pattern(3 * MIB + 4321, 9);
    p.local_mem.segment().write_at(0, &data).unwrap();
    // One large WRITE (several records) and small ones that travel as one WRITEV.
    let reqs = large_and_small(&p, &remote, TransferOp::Write, data.len(), 0);
    p.initiator.transfer(reqs).unwrap();
    assert_eq!(read_seg(&p.remote_mem, 100, data.len()), data);
    assert_eq!(
        read_seg(&p.remote_mem, 3_500_000 + 2000, 1000),
        data[1000..2000]
    );
    // Read back: one large READ and small ones as one READV.
    p.local_mem.segment().fill(0, 4 * MIB, 0).unwrap();
    let reqs = large_and_small(&p, &remote, TransferOp::Read, data.len(), 3_600_000);
    p.initiator.transfer(reqs).unwrap();
    assert_eq!(read_seg(&p.local_mem, 0, data.len()), data);
    assert_eq!(
        read_seg(&p.local_mem, 3_600_000 + 7000, 1000),
        data[7000..8000]
    );
    assert!(
        p.initiator.metrics().vectored_frames.get() >= 2,
        "small requests went as READV/WRITEV"
    );
    assert_eq!(integrity_failures(&p.initiator, "initiator"), 0);
}

/// Write `len` bytes through an armed proxy; the transfer's result and what the target holds.
fn tampered_write(p: &Pair, len: usize) -> (Result<(), BatchFailed>, Vec<u8>, Vec<u8>) {
    let remote = p.initiator.open("t/dram0").unwrap();
    let data = pattern(len, 3);
    p.local_mem.segment().write_at(0, &data).unwrap();
    p.armed.store(true, Ordering::SeqCst);
    let r = p.initiator.transfer(vec![req(
        p,
        &remote,
        TransferOp::Write,
        0,
        4096,
        len as u64,
    )]);
    let got = read_seg(&p.remote_mem, 4096, len);
    (r, got, data)
}

#[test]
fn without_integrity_a_flipped_payload_bit_lands_in_the_target() {
    let p = pair(
        Integrity::Allow,
        Integrity::Allow,
        Dir::ToTarget,
        Tamper::Flip { at: 1000 },
    );
    let (r, got, data) = tampered_write(&p, MIB);
    r.unwrap();
    let diff: Vec<usize> = (0..data.len()).filter(|&i| got[i] != data[i]).collect();
    // Byte 1000 of the frame is payload byte 960 (after the 40-byte header).
    assert_eq!(
        diff,
        vec![960],
        "the proxy altered exactly one payload byte"
    );
    assert_eq!(got[960], data[960] ^ 0x04);
}

#[test]
fn with_integrity_a_flipped_write_bit_fails_and_never_lands() {
    let p = pair(
        Integrity::Allow,
        Integrity::Require,
        Dir::ToTarget,
        Tamper::Flip { at: 1000 },
    );
    let (r, got, data) = tampered_write(&p, MIB);
    let e = r.expect_err("an altered frame must fail the transfer");
    assert_eq!(e.failure.category, "integrity", "{e}");
    assert_only_authentic(&got, &data);
    assert_ne!(got[956], data[956] ^ 0x04);
    assert_eq!(integrity_failures(&p.target, "target"), 1);
    // Counted where it was detected: the initiator was told, it did not detect it.
    assert_eq!(integrity_failures(&p.initiator, "initiator"), 0);
}

#[test]
fn with_integrity_a_dropped_or_replayed_record_fails_the_write() {
    for tamper in [Tamper::Drop { nth: 1 }, Tamper::Replay { nth: 1 }] {
        let p = pair(
            Integrity::Require,
            Integrity::Require,
            Dir::ToTarget,
            tamper,
        );
        let (r, got, data) = tampered_write(&p, 2 * MIB);
        let e = r.expect_err("a dropped or replayed record must fail the transfer");
        assert_eq!(e.failure.category, "integrity", "{tamper:?}: {e}");
        assert_only_authentic(&got, &data);
        // The record after the one tampered with carried bytes that never landed.
        assert_ne!(got, data, "{tamper:?}");
    }
}

#[test]
fn with_integrity_a_flipped_read_reply_fails_and_never_lands() {
    let p = pair(
        Integrity::Allow,
        Integrity::Require,
        Dir::ToInitiator,
        Tamper::Flip { at: 5000 },
    );
    let remote = p.initiator.open("t/dram0").unwrap();
    let data = pattern(MIB, 5);
    p.remote_mem.segment().write_at(0, &data).unwrap();
    p.armed.store(true, Ordering::SeqCst);
    let e = p
        .initiator
        .transfer(vec![req(&p, &remote, TransferOp::Read, 0, 0, MIB as u64)])
        .expect_err("an altered reply must fail the read");
    assert_eq!(e.failure.category, "integrity", "{e}");
    assert_only_authentic(&read_seg(&p.local_mem, 0, MIB), &data);
    assert_eq!(integrity_failures(&p.initiator, "initiator"), 1);
    let m = p.initiator.metrics();
    assert_eq!(m.failures.with_label_values(&["tcp", "integrity"]).get(), 1);
}

#[test]
fn a_target_that_does_not_allow_integrity_refuses_clearly_and_vice_versa() {
    let no_tamper = Tamper::Flip { at: usize::MAX };
    let p = pair(Integrity::Off, Integrity::Require, Dir::ToTarget, no_tamper);
    let e = p.initiator.open("t/dram0").unwrap_err().to_string();
    let chain = format!("{e} {:?}", p.initiator.open("t/dram0").unwrap_err());
    assert!(
        chain.contains("does not allow per-frame integrity"),
        "{chain}"
    );
    let p = pair(
        Integrity::Require,
        Integrity::Allow,
        Dir::ToTarget,
        no_tamper,
    );
    let e = p.initiator.open("t/dram0").unwrap_err();
    let chain = format!("{e} {e:?}");
    assert!(chain.contains("requires per-frame integrity"), "{chain}");
    // Both sides allowing it: plain frames, and transfers work.
    let p = pair(Integrity::Allow, Integrity::Allow, Dir::ToTarget, no_tamper);
    let remote = p.initiator.open("t/dram0").unwrap();
    p.initiator
        .transfer(vec![req(&p, &remote, TransferOp::Write, 0, 0, 4096)])
        .unwrap();
}

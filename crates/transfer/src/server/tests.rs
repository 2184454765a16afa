//! Tests of the target side's session against in-memory streams: hostile request streams
//! (property tests), bad offsets and handles, RDMA_CONNECT without RDMA, and the handshake.

use super::memory_target::MemStream;
use super::*;
use crate::frame::{HEADER_LEN, MAX_CONTROL_PAYLOAD};
use crate::memory::HostOptions;
use proptest::prelude::*;
use std::io::Cursor;

const SEG: u64 = 64 * 1024;
const MAX: u64 = 1024 * 1024;

fn ctx() -> (ServerCtx, u32) {
    let registry = Arc::new(Registry::default());
    let seg = Arc::new(Segment::host(SEG as usize, HostOptions::default()).unwrap());
    let handle = registry.insert("seg", seg).unwrap();
    let ctx = ServerCtx {
        registry,
        key: AuthKey::new(*b"0123456789abcdef").unwrap(),
        max_slice: MAX,
        timeout: Duration::from_secs(1),
        handshake_timeout: Duration::from_secs(1),
        limits: AdmissionLimits {
            max_connections: 4,
            max_per_source: 4,
            max_handshakes: 4,
        },
        notifications: Arc::new(NotificationQueue::new(4)),
        metrics: TransferMetrics::unregistered().unwrap(),
        rdma: None,
        integrity: crate::Integrity::Allow,
        tls: crate::TlsMode::Off,
        tls_server: None,
        features: crate::frame::FEATURES,
    };
    (ctx, handle)
}

/// One chunk of hostile input.
#[derive(Debug, Clone)]
enum Chunk {
    Frame {
        opcode: u8,
        valid_handle: bool,
        handle: u32,
        offset: u64,
        length: u64,
        payload: Vec<u8>,
    },
    Garbage(Vec<u8>),
    Truncated(usize),
}

fn chunk() -> impl Strategy<Value = Chunk> {
    let length = prop_oneof![
        0u64..64,
        Just(SEG),
        SEG - 8..SEG + 8,
        MAX - 1..MAX + 2,
        Just(MAX_CONTROL_PAYLOAD + 1),
        any::<u64>(),
    ];
    let offset = prop_oneof![0u64..SEG, SEG - 16..SEG + 16, any::<u64>()];
    prop_oneof![
        6 => (0u8..=17, any::<bool>(), any::<u32>(), offset, length,
              proptest::collection::vec(any::<u8>(), 0..96))
            .prop_map(|(opcode, valid_handle, handle, offset, length, payload)| Chunk::Frame {
                opcode, valid_handle, handle, offset, length, payload
            }),
        1 => proptest::collection::vec(any::<u8>(), 1..80).prop_map(Chunk::Garbage),
        1 => (1usize..HEADER_LEN).prop_map(Chunk::Truncated),
    ]
}

fn encode(chunks: &[Chunk], real_handle: u32) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, c) in chunks.iter().enumerate() {
        match c {
            Chunk::Frame {
                opcode,
                valid_handle,
                handle,
                offset,
                length,
                payload,
            } => {
                let mut h = Header::new(Opcode::Read, i as u64 + 1);
                h.handle = if *valid_handle { real_handle } else { *handle };
                h.offset = *offset;
                h.length = *length;
                let mut b = h.encode();
                b[5] = *opcode;
                out.extend_from_slice(&b);
                out.extend_from_slice(payload);
            }
            Chunk::Garbage(g) => out.extend_from_slice(g),
            Chunk::Truncated(n) => {
                out.extend_from_slice(&Header::new(Opcode::Write, 9).encode()[..*n])
            }
        }
    }
    out
}

/// Parse what the server wrote: it must be a sequence of well-formed replies.
fn replies(mut out: &[u8]) -> Vec<Header> {
    let mut v = Vec::new();
    while !out.is_empty() {
        let h = Header::decode(out, MAX).expect("server wrote a malformed header");
        let payload = match h.opcode {
            Opcode::ReadData | Opcode::Error => h.length as usize,
            _ => 0,
        };
        assert!(h.opcode.is_plain_reply(), "server sent a {:?}", h.opcode);
        assert!(out.len() >= HEADER_LEN + payload, "reply payload cut short");
        out = &out[HEADER_LEN + payload..];
        v.push(h);
    }
    v
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn hostile_request_streams_get_error_replies_or_a_close_never_a_panic(
        chunks in proptest::collection::vec(chunk(), 1..12)
    ) {
        let (ctx, handle) = ctx();
        let mut s = MemStream { input: Cursor::new(encode(&chunks, handle)), output: Vec::new() };
        let _ = serve_requests(&mut s, &ctx, "test", &mut |_| {
            Err(io::Error::other("no idle waits in memory"))
        });
        for h in replies(&s.output) {
            if h.opcode == Opcode::ReadData {
                // Data is only ever served from inside the segment.
                prop_assert!(h.length <= SEG);
            }
        }
    }

    #[test]
    fn arbitrary_bytes_never_pass_the_handshake(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let (ctx, _) = ctx();
        let mut s = MemStream { input: Cursor::new(bytes), output: Vec::new() };
        prop_assert!(wire::server_handshake(&mut s, &ctx.key).is_err());
        for h in replies(&s.output) {
            prop_assert!(matches!(h.opcode, Opcode::Challenge | Opcode::Error));
        }
    }
}

/// A request frame: its header (`length` as given, whatever the payload) and its payload.
fn request(op: Opcode, id: u64, handle: u32, offset: u64, length: u64, payload: &[u8]) -> Vec<u8> {
    let mut h = Header::new(op, id);
    h.handle = handle;
    h.offset = offset;
    h.length = length;
    [&h.encode()[..], payload].concat()
}

/// Serve `input` (requests of an authenticated connection) to its end; what the server wrote.
fn serve(ctx: &ServerCtx, input: Vec<u8>) -> Vec<u8> {
    let mut s = MemStream {
        input: Cursor::new(input),
        output: Vec::new(),
    };
    serve_requests(&mut s, ctx, "test", &mut |_| {
        Err(io::Error::other("no idle waits in memory"))
    })
    .unwrap();
    s.output
}

/// Request id, opcode and status of every reply in `output`.
fn reply_kinds(output: &[u8]) -> Vec<(u64, Opcode, u32)> {
    replies(output)
        .iter()
        .map(|h| (h.request_id, h.opcode, h.status))
        .collect()
}

#[test]
fn out_of_bounds_and_unknown_handles_get_errors_and_the_connection_goes_on() {
    let (ctx, handle) = ctx();
    let input = [
        request(Opcode::Write, 1, handle, SEG - 2, 4, b"abcd"), // crosses the end
        request(Opcode::Read, 2, handle + 1, 0, 4, b""),        // unknown handle
        request(Opcode::Read, 3, handle, u64::MAX - 1, 4, b""), // offset overflow
        request(Opcode::Write, 4, handle, 10, 4, b"wxyz"),      // fine
        request(Opcode::Read, 5, handle, 10, 4, b""),           // fine
    ];
    let output = serve(&ctx, input.concat());
    assert_eq!(
        reply_kinds(&output),
        vec![
            (1, Opcode::Error, ErrorCode::OutOfBounds as u32),
            (2, Opcode::Error, ErrorCode::UnknownSegment as u32),
            (3, Opcode::Error, ErrorCode::OutOfBounds as u32),
            (4, Opcode::WriteAck, 0),
            (5, Opcode::ReadData, 0),
        ]
    );
    assert!(output.ends_with(b"wxyz"));
    let seg = ctx.registry.get(handle).unwrap();
    let mut tail = [0u8; 2];
    seg.read_at(SEG - 2, &mut tail).unwrap();
    assert_eq!(tail, [0, 0], "rejected write left no bytes behind");
}

#[test]
fn vectored_reads_and_writes_move_every_range_in_table_order() {
    let (ctx, handle) = ctx();
    let table = crate::frame::encode_ranges([(100, 3), (10, 2), (4000, 4)]);
    let data = b"abcdefghi";
    let mut write = Header::new(Opcode::WriteV, 1);
    write.handle = handle;
    write.offset = 3;
    write.length = (table.len() + data.len()) as u64;
    // Read back in another order than written, over a range the write did not touch.
    let rtable = crate::frame::encode_ranges([(4000, 4), (100, 3), (10, 2), (20, 1)]);
    let mut read = Header::new(Opcode::ReadV, 2);
    read.handle = handle;
    read.offset = 4;
    read.length = rtable.len() as u64;
    let input = [
        &write.encode()[..],
        &table,
        data,
        &read.encode()[..],
        &rtable,
    ]
    .concat();
    let output = serve(&ctx, input);
    assert_eq!(
        reply_kinds(&output),
        vec![(1, Opcode::WriteAck, 0), (2, Opcode::ReadData, 0)]
    );
    assert!(output.ends_with(b"fghiabcde\0"), "{output:?}");
    let seg = ctx.registry.get(handle).unwrap();
    let mut got = [0u8; 3];
    seg.read_at(100, &mut got).unwrap();
    assert_eq!(&got, b"abc");
    assert_eq!(
        ctx.metrics.served_bytes.with_label_values(&["write"]).get(),
        9
    );
}

#[test]
fn bad_vectored_requests_get_errors_and_the_connection_goes_on() {
    let (ctx, handle) = ctx();
    let vreq = |op: Opcode, id: u64, count: u64, table: &[u8], data: &[u8]| {
        let mut h = Header::new(op, id);
        h.handle = handle;
        h.offset = count;
        h.length = (table.len() + data.len()) as u64;
        [&h.encode()[..], table, data].concat()
    };
    let t = |r: &[(u64, u64)]| crate::frame::encode_ranges(r.iter().copied());
    let input = [
        // A range past the segment's end: refused whole, nothing written.
        vreq(Opcode::WriteV, 1, 2, &t(&[(0, 2), (SEG - 1, 2)]), b"xxyy"),
        // The table announces 3 ranges but holds 2.
        vreq(Opcode::ReadV, 2, 3, &t(&[(0, 1), (1, 1)]), b""),
        // No ranges at all.
        vreq(Opcode::ReadV, 3, 0, b"", b""),
        // More data than the ranges add up to.
        vreq(Opcode::WriteV, 4, 1, &t(&[(0, 2)]), b"abc"),
        // A count whose table cannot fit the payload.
        vreq(Opcode::WriteV, 5, 9, &t(&[(0, 1)]), b"z"),
        // Ranges adding up past the slice limit.
        vreq(Opcode::ReadV, 6, 2, &t(&[(0, MAX), (0, 1)]), b""),
        // An unknown handle.
        {
            let mut f = vreq(Opcode::ReadV, 7, 1, &t(&[(0, 1)]), b"");
            f[16..20].copy_from_slice(&(handle + 9).to_le_bytes());
            f
        },
        vreq(Opcode::ReadV, 8, 1, &t(&[(0, 2)]), b""),
    ];
    let output = serve(&ctx, input.concat());
    assert_eq!(
        reply_kinds(&output),
        vec![
            (1, Opcode::Error, ErrorCode::OutOfBounds as u32),
            (2, Opcode::Error, ErrorCode::Malformed as u32),
            (3, Opcode::Error, ErrorCode::Malformed as u32),
            (4, Opcode::Error, ErrorCode::Malformed as u32),
            (5, Opcode::Error, ErrorCode::Malformed as u32),
            (6, Opcode::Error, ErrorCode::TooLarge as u32),
            (7, Opcode::Error, ErrorCode::UnknownSegment as u32),
            (8, Opcode::ReadData, 0),
        ]
    );
    assert!(
        output.ends_with(&[0, 0]),
        "no rejected write left bytes behind"
    );
}

#[test]
fn a_target_that_does_not_announce_vectored_frames_refuses_them() {
    let (mut ctx, handle) = ctx();
    ctx.features = 0;
    let mut open = Header::new(Opcode::Open, 1);
    open.length = 3;
    let table = crate::frame::encode_ranges([(0, 1), (1, 1)]);
    let mut read = Header::new(Opcode::ReadV, 2);
    read.handle = handle;
    read.offset = 2;
    read.length = table.len() as u64;
    let input = [&open.encode()[..], b"seg", &read.encode()[..], &table].concat();
    let mut s = MemStream {
        input: Cursor::new(input),
        output: Vec::new(),
    };
    let served = serve_requests(&mut s, &ctx, "test", &mut |_| {
        Err(io::Error::other("no idle waits in memory"))
    });
    assert!(served.is_err(), "the connection ends");
    let got = replies(&s.output);
    assert_eq!(got[0].opcode, Opcode::OpenOk);
    assert_eq!(got[0].offset, 0, "no feature bits announced");
    assert_eq!(
        (got[1].opcode, got[1].status),
        (Opcode::Error, ErrorCode::Unsupported as u32)
    );
}

#[test]
fn open_ok_announces_vectored_frames() {
    let (ctx, _) = ctx();
    let mut open = Header::new(Opcode::Open, 1);
    open.length = 3;
    let got = replies(&serve(&ctx, [&open.encode()[..], b"seg"].concat()));
    assert_eq!(got[0].offset & crate::frame::FEATURE_VECTORED, 1);
}

#[test]
fn rdma_connect_gets_unsupported_or_malformed_and_the_connection_goes_on() {
    use crate::rdma::handshake::{ConnectRequest, MTU_1024, QpInfo};
    let (ctx, handle) = ctx();
    let good = ConnectRequest {
        segment: "seg".into(),
        qps: vec![QpInfo {
            device: "mlx5_0".into(),
            qp_num: 9,
            psn: 1,
            lid: 0,
            gid: [0; 16],
            mtu: MTU_1024,
        }],
    }
    .encode()
    .unwrap();
    let garbage = b"\x07garbage";
    let input = [
        // No RDMA provider here.
        request(Opcode::RdmaConnect, 1, handle, 0, good.len() as u64, &good),
        // A bad handshake version.
        request(
            Opcode::RdmaConnect,
            2,
            handle,
            0,
            garbage.len() as u64,
            garbage,
        ),
        request(Opcode::Read, 3, handle, 0, 4, b""),
    ];
    assert_eq!(
        reply_kinds(&serve(&ctx, input.concat())),
        vec![
            (1, Opcode::Error, ErrorCode::Unsupported as u32),
            (2, Opcode::Error, ErrorCode::Malformed as u32),
            (3, Opcode::ReadData, 0),
        ]
    );
}

#[test]
fn wrong_key_fails_both_sides_of_the_handshake() {
    use std::os::unix::net::UnixStream;
    let (mut a, mut b) = UnixStream::pair().unwrap();
    let t = std::thread::spawn(move || {
        let key = AuthKey::new(*b"0123456789abcdef").unwrap();
        wire::server_handshake(&mut b, &key)
    });
    let wrong = AuthKey::new(*b"fedcba9876543210").unwrap();
    let client = wire::client_handshake(&mut a, &wrong);
    assert!(matches!(client, Err(WireError::Auth(_))), "{client:?}");
    drop(a);
    assert!(t.join().unwrap().is_err());
}

/// What a target's handshake ends with: the session keys when integrity was granted.
type HandshakeOutcome = Result<Option<crate::seal::SessionKeys>, WireError>;

/// A target that allows integrity running its handshake on one end of a socket pair: the
/// pool key, the initiator's end, and the target's outcome.
fn handshaking_target() -> (
    AuthKey,
    std::os::unix::net::UnixStream,
    std::thread::JoinHandle<HandshakeOutcome>,
) {
    let key = AuthKey::new(*b"0123456789abcdef").unwrap();
    let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
    let k = key.clone();
    let t = std::thread::spawn(move || {
        wire::server_handshake_opts(&mut b, &k, crate::Integrity::Allow)
    });
    (key, a, t)
}

#[test]
fn an_initiator_from_before_encrypted_records_is_granted_mac_only_ones() {
    use crate::auth::NONCE_LEN;
    use crate::seal::{OPT_ENCRYPTED, OPT_INTEGRITY, RecordFormat};
    let (key, mut a, t) = handshaking_target();
    // What an initiator that knows only MAC-only records sends: OPT_INTEGRITY alone.
    let nonce = [9u8; NONCE_LEN];
    let mut hello = Header::new(Opcode::Hello, 0);
    hello.status = OPT_INTEGRITY;
    wire::write_frame(&mut a, &hello, &nonce).unwrap();
    let challenge = wire::read_header(&mut a, 0, &mut wire::fail_on_timeout).unwrap();
    assert_eq!(challenge.opcode, Opcode::Challenge);
    assert_eq!(challenge.status & OPT_ENCRYPTED, 0, "not granted unasked");
    assert_eq!(challenge.status & OPT_INTEGRITY, OPT_INTEGRITY);
    let payload = wire::read_control_payload(&mut a, &challenge).unwrap();
    let proof = key.prove(b"client/integrity", &nonce, &payload[..NONCE_LEN]);
    wire::write_frame(&mut a, &Header::new(Opcode::Auth, 0), &proof).unwrap();
    let ok = wire::read_header(&mut a, 0, &mut wire::fail_on_timeout).unwrap();
    assert_eq!(ok.opcode, Opcode::AuthOk);
    let keys = t.join().unwrap().unwrap().expect("integrity granted");
    assert_eq!(keys.format(), RecordFormat::MacOnly);
}

#[test]
fn a_current_initiator_and_target_agree_on_encrypted_records() {
    use crate::seal::RecordFormat;
    let (key, mut a, t) = handshaking_target();
    let client = wire::client_handshake_opts(&mut a, &key, true)
        .unwrap()
        .expect("granted");
    let server = t.join().unwrap().unwrap().expect("granted");
    assert_eq!(client.format(), RecordFormat::Encrypted);
    assert_eq!(server.format(), RecordFormat::Encrypted);
}

//! The seed corpora of the fuzz targets (`fuzz/corpus/<target>/`), made here from the
//! production encoders and real files rather than by hand, and checked against what is
//! committed: a format change that leaves the seeds stale fails this test. Each seed is also
//! fed to its decoder here, so a seed is always a valid example the fuzzer starts from.
//! Regenerate with `KVPOOL_UPDATE_SEEDS=1 cargo nextest run -p kvpool --test fuzz_seeds`.
//! The record framing some targets read (`tag u8 | length u16 LE | bytes`) is the fuzz
//! crate's `kvpool_fuzz::Records`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The method the `master_auth` fuzz target checks credentials for (the target's own constant).
const MASTER_AUTH_METHOD: &str = "Get";

use kvpool_agent::ssd::{AlignedBuf, DirectIo, SsdConfig, SsdTier, log};
use kvpool_core::master::{JournalOp, ObjectKey, ObjectRecord, SegmentSpec, Tier};
use kvpool_proto::fast::{self, Method};
use kvpool_proto::kv_events::{self, Encoding, EventBatch, KvEvent, WireHash};
use kvpool_proto::master as mproto;
use kvpool_transfer::frame::{Header, Opcode, encode_ranges};
use kvpool_transfer::rdma::handshake::{ConnectReply, ConnectRequest, QpInfo, RegionInfo};
use prost::Message;

/// The fuzz targets' key (`kvpool_fuzz::KEY`).
const KEY: &[u8] = b"kvpool-fuzz-key-0123456789abcdef";

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus")
}

fn record(out: &mut Vec<u8>, tag: u8, body: &[u8]) {
    let len = u16::try_from(body.len()).expect("record under 64 KiB");
    out.push(tag);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(body);
}

fn frame(op: Opcode, id: u64, handle: u32, offset: u64, length: u64, payload: &[u8]) -> Vec<u8> {
    let mut h = Header::new(op, id);
    h.handle = handle;
    h.offset = offset;
    h.length = length;
    let mut v = h.encode().to_vec();
    v.extend_from_slice(payload);
    v
}

/// Seeds by target, then by file name.
type Seeds = BTreeMap<&'static str, BTreeMap<&'static str, Vec<u8>>>;

fn transfer_seeds(s: &mut Seeds) {
    let frames = s.entry("frame_decoder").or_default();
    for (name, op) in [
        ("hello", Opcode::Hello),
        ("read", Opcode::Read),
        ("open_ok", Opcode::OpenOk),
        ("error", Opcode::Error),
    ] {
        frames.insert(name, frame(op, 7, 1, 4096, 32, &[]));
    }
    let table = encode_ranges([(0, 512), (4096, 1024)]);
    frames.insert(
        "readv",
        frame(Opcode::ReadV, 9, 1, 2, table.len() as u64, &table),
    );

    // One authenticated connection: OPEN, WRITE, READ, NOTIFY, READV, WRITEV, then a frame
    // with reserved flags (the target closes).
    let mut conn = frame(Opcode::Open, 1, 0, 0, 3, b"seg");
    conn.extend(frame(Opcode::Write, 2, 1, 128, 16, &[0xab; 16]));
    conn.extend(frame(Opcode::Read, 3, 1, 128, 16, &[]));
    conn.extend(frame(Opcode::Notify, 4, 0, 0, 5, b"hello"));
    conn.extend(frame(Opcode::ReadV, 5, 1, 2, table.len() as u64, &table));
    let wtable = encode_ranges([(0, 8), (64, 8)]);
    let mut wpayload = wtable.clone();
    wpayload.extend_from_slice(&[1; 16]);
    conn.extend(frame(
        Opcode::WriteV,
        6,
        1,
        2,
        wpayload.len() as u64,
        &wpayload,
    ));
    let mut bad = frame(Opcode::Read, 7, 1, 0, 8, &[]);
    bad[6] = 1;
    conn.extend(bad);
    s.entry("transfer_server")
        .or_default()
        .insert("conversation", conn);

    let hs = s.entry("transfer_handshake").or_default();
    let mut target_side = vec![0];
    target_side.extend(frame(Opcode::Hello, 0, 0, 0, 32, &[3; 32]));
    target_side.extend(frame(Opcode::Auth, 0, 0, 0, 32, &[4; 32]));
    hs.insert("target_side", target_side);
    let mut initiator_side = vec![1];
    initiator_side.extend(frame(Opcode::Challenge, 0, 0, 0, 64, &[5; 64]));
    initiator_side.extend(frame(Opcode::AuthOk, 0, 0, 0, 0, &[]));
    hs.insert("initiator_side", initiator_side);
    let qp = QpInfo {
        device: "mlx5_0".into(),
        qp_num: 0x11,
        psn: 0x22,
        lid: 3,
        gid: [0xfe; 16],
        mtu: 3,
    };
    let req = ConnectRequest {
        segment: "seg".into(),
        qps: vec![qp.clone()],
    };
    let mut rdma_req = vec![2];
    rdma_req.extend(req.encode().expect("encodes"));
    hs.insert("rdma_connect", rdma_req);
    let reply = ConnectReply {
        paths: vec![(
            qp,
            RegionInfo {
                addr: 0x7f00_0000_0000,
                rkey: 9,
                len: 1 << 20,
            },
        )],
    };
    let mut rdma_reply = vec![3];
    rdma_reply.extend(reply.encode().expect("encodes"));
    hs.insert("rdma_connect_ok", rdma_reply);

    // Three requests in flight (a WRITE, a READ of 2 x 16 bytes, a READ of 16), answered by
    // WRITE_ACK, READ_DATA with 32 bytes, and an ERROR.
    let mut client = vec![2, 0b001];
    client.extend([0, 16, 0, 1, 16, 0, 0, 16, 0]);
    client.extend(frame(Opcode::WriteAck, 1, 0, 0, 0, &[]));
    client.extend(frame(Opcode::ReadData, 2, 0, 0, 32, &[7; 32]));
    let mut err = Header::new(Opcode::Error, 3);
    err.status = 4;
    err.length = 6;
    client.extend(err.encode());
    client.extend(b"bounds");
    s.entry("transfer_client")
        .or_default()
        .insert("replies", client);
}

fn fast_frame(method: Method, releases: &[u64], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    fast::encode_request(&mut out, method, "v1.0.cred.00", releases, body);
    out.split_off(4)
}

fn master_seeds(s: &mut Seeds) {
    let keys = mproto::KeysRequest {
        keys: vec![b"block-1".to_vec(), b"block-2".to_vec()],
    }
    .encode_to_vec();
    let put = mproto::PutStartRequest {
        items: vec![mproto::PutItem {
            key: b"block-1".to_vec(),
            size: 8192,
        }],
        replicas: 2,
        writer_node: "a".into(),
        ..Default::default()
    }
    .encode_to_vec();
    let end = mproto::PutEndRequest {
        items: vec![mproto::PutEndItem {
            key: b"block-1".to_vec(),
            put_id: 1,
            unsent: false,
        }],
    }
    .encode_to_vec();
    let mut calls = Vec::new();
    record(&mut calls, 0, &fast_frame(Method::PutStart, &[], &put));
    record(&mut calls, 0, &fast_frame(Method::PutEnd, &[], &end));
    record(&mut calls, 0, &fast_frame(Method::Get, &[], &keys));
    record(&mut calls, 0, &fast_frame(Method::Exists, &[1], &keys));
    record(
        &mut calls,
        0,
        &fast_frame(Method::LongestPrefix, &[], &keys),
    );
    record(&mut calls, 0, &fast_frame(Method::Remove, &[], &keys));
    let heartbeat = mproto::HeartbeatRequest {
        node: "a".into(),
        ..Default::default()
    };
    record(&mut calls, 3, &heartbeat.encode_to_vec());
    let pin = mproto::PinRequest {
        keys: vec![b"block-1".to_vec()],
        hard: false,
        ttl_ms: 1000,
    };
    record(&mut calls, 6, &pin.encode_to_vec());
    record(&mut calls, 9, &[]);
    s.entry("master_request")
        .or_default()
        .insert("calls", calls);

    let key = kvpool_proto::auth::AuthKey::from_bytes(KEY).expect("key");
    let cred = key.sign(MASTER_AUTH_METHOD);
    let ts: u64 = cred
        .split('.')
        .nth(2)
        .and_then(|t| t.parse().ok())
        .expect("ts");
    let mut valid = ts.to_le_bytes().to_vec();
    valid.extend_from_slice(cred.as_bytes());
    let auth = s.entry("master_auth").or_default();
    auth.insert("valid", valid);
    let mut malformed = 1_700_000_000_000u64.to_le_bytes().to_vec();
    malformed.extend_from_slice(b"v2.engine.1.0123456789abcdef0123456789abcdef..zz");
    auth.insert("malformed", malformed);

    let spec = SegmentSpec {
        node: "a".into(),
        name: "dram-0".into(),
        tier: Tier::Dram,
        capacity_bytes: 1 << 30,
        numa_node: 0,
        failure_domain: "rack-1".into(),
        endpoints: vec!["tcp://10.0.0.1:15500".into()],
        persistent: false,
    };
    let object = ObjectRecord {
        key: ObjectKey::from_bytes(b"block-1"),
        size: 8192,
        desired: 2,
        hard_pinned: false,
        spread_failure_domain: false,
        replicas: vec![(1, 0)],
        event_name: None,
    };
    let mut etcd = Vec::new();
    for op in [
        JournalOp::PutSegment(1, spec),
        JournalOp::PutObject(object),
        JournalOp::Reserve {
            seg: 1,
            offset: 1 << 20,
            length: 4096,
        },
        JournalOp::SegmentIdsUsed(2),
    ] {
        let (k, v) = kvpool_master::ha::journal_write("/kvpool/fuzz", &op);
        let mut body = k
            .strip_prefix("/kvpool/fuzz")
            .expect("prefixed")
            .as_bytes()
            .to_vec();
        body.push(0);
        body.extend(v.expect("a put"));
        record(&mut etcd, 0, &body);
    }
    s.entry("etcd_records")
        .or_default()
        .insert("leader_load", etcd);
}

fn engine_seeds(s: &mut Seeds) {
    use kvpool_agent::proto as e;
    let mut calls = Vec::new();
    let put = e::PutRequest {
        session_id: 1,
        items: vec![e::PutItem {
            key: b"k1".to_vec(),
            offset: 0,
            length: 4096,
        }],
        numa_hint: None,
    };
    record(&mut calls, 2, &put.encode_to_vec());
    let get = e::GetRequest {
        session_id: 1,
        items: vec![e::GetItem {
            key: b"k1".to_vec(),
            offset: 8192,
            capacity: 4096,
        }],
    };
    record(&mut calls, 3, &get.encode_to_vec());
    let keys = vec![b"k1".to_vec(), b"k2".to_vec()];
    record(
        &mut calls,
        4,
        &e::ExistsRequest { keys: keys.clone() }.encode_to_vec(),
    );
    record(&mut calls, 5, &e::RemoveRequest { keys }.encode_to_vec());
    let open = e::OpenSessionRequest {
        staging_bytes: 4096,
        client_name: "seed".into(),
        ..Default::default()
    };
    record(&mut calls, 0, &open.encode_to_vec());
    record(
        &mut calls,
        1,
        &e::CloseSessionRequest { session_id: 2 }.encode_to_vec(),
    );
    s.entry("engine_api").or_default().insert("calls", calls);
}

fn http_seeds(s: &mut Seeds) {
    let o = s.entry("openai_request").or_default();
    let completion =
        br#"{"model":"m","prompt":[[1,2,3],[4,5]],"max_tokens":8,"n":2,"stream":true}"#;
    o.insert("completions", [&[0u8][..], completion].concat());
    let chat = br#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"hi"}],"max_tokens":4,"stream":true}"#;
    o.insert("chat", [&[1u8][..], chat].concat());
    let prefetch = kvpool_proto::prefetch::prefetch_body(&[1, 0xdead_beef]).to_string();
    o.insert("prefetch", [&[4u8][..], prefetch.as_bytes()].concat());

    let sse = s.entry("sse_stream").or_default();
    let stream = "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n: keep-alive\ndata: {\"choices\":[],\"usage\":{\"completion_tokens\":2}}\n\ndata: [DONE]\n\n";
    sse.insert("stream", [&[0u8, 40, 0][..], stream.as_bytes()].concat());
    let json = br#"{"choices":[{"text":"a b"}],"usage":{"prompt_tokens":3,"completion_tokens":7}}"#;
    sse.insert("json", [&[1u8, 20, 0][..], json].concat());

    let batch = EventBatch {
        ts: 1_700_000_000.5,
        events: vec![
            KvEvent::BlockStored {
                block_hashes: vec![WireHash::Int(11), WireHash::Bytes(vec![1; 32])],
                parent: Some(WireHash::Int(7)),
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                lora_id: None,
                lora_name: None,
                medium: Some("GPU".into()),
                group_idx: None,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![WireHash::Int(11)],
                medium: None,
                group_idx: Some(0),
            },
            KvEvent::AllBlocksCleared,
        ],
        data_parallel_rank: Some(1),
    };
    let ev = s.entry("kv_events").or_default();
    ev.insert(
        "batch_array",
        kv_events::encode_batch(&batch, Encoding::Array),
    );
    ev.insert("batch_map", kv_events::encode_batch(&batch, Encoding::Map));
    ev.insert("sequence", 42u64.to_be_bytes().to_vec());

    let trace = concat!(
        "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 6, \"hash_ids\": [0, 1]}\n",
        "\n",
        "{\"timestamp\": 12, \"input_length\": 513, \"output_length\": 2, \"hash_ids\": [0, 2]}\n",
        "{\"timestamp\": 5, \"input_length\": 1, \"output_length\": 0, \"hash_ids\": [3]}\n",
    );
    s.entry("trace")
        .or_default()
        .insert("mooncake", [&[3u8][..], trace.as_bytes()].concat());
}

fn agent_seeds(s: &mut Seeds) {
    // A real index.log, written by the SSD tier itself: three puts and a removal.
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = SsdConfig {
        dir: dir.path().to_owned(),
        capacity: 16 << 20,
        direct_io: DirectIo::Off,
    };
    let (mut tier, _) = SsdTier::open(&cfg).expect("open tier");
    let mut buf = AlignedBuf::new(8192);
    buf.fill(0x5a);
    for (key, len) in [(&b"a"[..], 100), (b"b", 4096), (b"c", 5000)] {
        tier.put(key, &buf, len).expect("put");
    }
    tier.remove(b"b").expect("remove");
    let index = std::fs::read(dir.path().join("index.log")).expect("index.log");
    drop(tier);
    let ssd = s.entry("ssd_index").or_default();
    // First byte 6: the tier, with a data file of 1 MiB.
    ssd.insert("tier_index_log", [&[6u8][..], &index].concat());
    // The pool segment's records: two puts and a drop (`pool-ssd.idx` after its header).
    let mut pool = vec![1u8];
    let put = |key: &[u8], offset: u64, length: u64| {
        let k = ObjectKey::from_bytes(key);
        let mut p = vec![1u8];
        p.extend(k.hi.to_le_bytes());
        p.extend(k.lo.to_le_bytes());
        p.extend(offset.to_le_bytes());
        p.extend(length.to_le_bytes());
        p.extend(0x1234_5678u32.to_le_bytes());
        log::record(&p)
    };
    pool.extend(put(b"x", 0, 4096));
    pool.extend(put(b"y", 4096, 8192));
    let y = ObjectKey::from_bytes(b"y");
    let mut drop_y = vec![2u8];
    drop_y.extend(y.hi.to_le_bytes());
    drop_y.extend(y.lo.to_le_bytes());
    drop_y.extend(4096u64.to_le_bytes());
    pool.extend(log::record(&drop_y));
    ssd.insert("pool_records", pool);

    let cfg = s.entry("agent_config").or_default();
    cfg.insert(
        "file",
        b"node_name: gpu-node-7\ndiscovery:\n  sysfs_root: /host/sys\ndram:\n  capacity: 64GiB\n  numa_policy:\n    nodes: [0, 1]\n  hugepages: 2MiB\n  lock: false\nssd:\n  path: /var/lib/kvpool/ssd\n  capacity: 1.5 TiB\n  direct_io: off\n  sync_interval: 250ms\nengine_api:\n  socket_dir: /run/kvpool\n  max_staging_bytes: 256MiB\nadmin:\n  listen: 127.0.0.1:9000\n".to_vec(),
    );
    let doc = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("agent/tests/fixtures/operator/deploy_examples_tcp_kvcachepool.yaml");
    cfg.insert(
        "pool_document",
        std::fs::read(&doc).expect("pool document fixture"),
    );
}

fn all_seeds() -> Seeds {
    let mut s = Seeds::new();
    transfer_seeds(&mut s);
    master_seeds(&mut s);
    engine_seeds(&mut s);
    http_seeds(&mut s);
    agent_seeds(&mut s);
    s
}

/// Each seed is accepted by the decoder its target starts with.
fn check_decodes(target: &str, name: &str, seed: &[u8]) {
    let ok = match target {
        "frame_decoder" => Header::decode(seed, 1 << 20).is_ok(),
        "transfer_handshake" if name.starts_with("rdma_connect_ok") => {
            ConnectReply::decode(&seed[1..]).is_ok()
        }
        "transfer_handshake" if name.starts_with("rdma") => {
            ConnectRequest::decode(&seed[1..]).is_ok()
        }
        "master_auth" => {
            let (ts, cred) = seed.split_at(8);
            let ts = u64::from_le_bytes(ts.try_into().expect("8 bytes"));
            let cred = std::str::from_utf8(cred).expect("text");
            let key = kvpool_proto::auth::AuthKey::from_bytes(KEY).expect("key");
            let verified = kvpool_proto::auth::Verifier::new(&key)
                .expect("verifier")
                .verify_at(Some(cred), MASTER_AUTH_METHOD, ts);
            verified.is_ok() == (name == "valid")
        }
        "kv_events" if name == "sequence" => kv_events::decode_sequence(seed).is_ok(),
        "kv_events" => kv_events::decode_batch(seed).is_ok(),
        "trace" => kvpool_core::sim::trace::parse(&seed[1..], 512).is_ok(),
        "ssd_index" if name == "tier_index_log" => {
            let (recovery, _) =
                SsdTier::recover_index(&seed[1..], 16 << 20, 1 << 20).expect("recovers");
            recovery.blocks == 2 && recovery.warnings.is_empty()
        }
        "ssd_index" => {
            let r = kvpool_agent::ssd::pool::replay(&seed[1..]);
            r.damaged_at.is_none() && r.blocks.len() == 1
        }
        "openai_request" if name == "prefetch" => {
            kvpool_proto::prefetch::parse_prefetch(&seed[1..]).is_ok()
        }
        "openai_request" => {
            let endpoint = if seed[0] & 1 == 0 {
                kvpool_proto::openai::Endpoint::Completions
            } else {
                kvpool_proto::openai::Endpoint::ChatCompletions
            };
            kvpool_proto::openai::parse_request(endpoint, &seed[1..], &|m| m == "m").is_ok()
        }
        "agent_config" if name == "file" => {
            let text = std::str::from_utf8(seed).expect("text");
            kvpool_agent::config::parse(text, Path::new("seed"))
                .ok()
                .is_some_and(|f| kvpool_agent::config::validate(&f).is_ok())
        }
        "agent_config" => {
            let text = std::str::from_utf8(seed).expect("text");
            kvpool_agent::config::parse_pool_document(text, Path::new("seed")).is_ok()
        }
        "etcd_records" | "master_request" | "engine_api" | "transfer_server"
        | "transfer_client" | "transfer_handshake" | "sse_stream" => true,
        other => panic!("no decoder check for target {other}"),
    };
    assert!(ok, "seed {target}/{name} is not accepted by its decoder");
}

#[test]
fn seed_corpora_are_valid_and_current() {
    let update = std::env::var_os("KVPOOL_UPDATE_SEEDS").is_some();
    let mut stale = Vec::new();
    for (target, seeds) in all_seeds() {
        let dir = corpus().join(target);
        if update {
            std::fs::create_dir_all(&dir).expect("corpus dir");
        }
        for (name, seed) in seeds {
            check_decodes(target, name, &seed);
            let path = dir.join(name);
            if update {
                std::fs::write(&path, &seed).expect("write seed");
            } else if target == "master_auth" && name == "valid" {
                // Signed with the wall clock: the committed one is checked, not compared.
                let committed = std::fs::read(&path).expect("committed seed");
                check_decodes(target, name, &committed);
            } else if std::fs::read(&path).ok().as_deref() != Some(&seed[..]) {
                stale.push(path.display().to_string());
            }
        }
    }
    assert!(
        stale.is_empty(),
        "seed files differ from what the encoders make (KVPOOL_UPDATE_SEEDS=1 rewrites them): {stale:?}"
    );
}

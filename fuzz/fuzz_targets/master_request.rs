//! The master's requests, as a conversation against a fresh metadata core with two mounted
//! segments (DRAM and SSD) and a fake clock. The input is records (`kvpool_fuzz::Records`):
//! - tag 0: a fast-lane request frame (after its length; `kvpool_proto::fast`), decoded,
//!   checked to round-trip, its piggybacked lease releases applied, then run by the fast
//!   lane's own dispatch to the tonic handlers (the credential is `master_auth`'s target);
//! - tag 1..=9 (mod 10): the protobuf body of a gRPC-only call (mount, unmount, heartbeat,
//!   complete task, adopt replicas, pin, unpin, remove all, stats), run by its tonic handler
//!   as the caller `tag / 10` picks (the pool key, the agent of node `a` or `b`, the shared
//!   agent credential, on a master that does or does not allow shared ones), whose checked
//!   credential the node calls' authorization reads.
//!
//! Every call answers a reply or a gRPC status; a fast-lane reply decodes as its method's
//! response message; and the core's space accounting stays within its capacity.
#![no_main]

use std::sync::{Arc, OnceLock};

use kvpool_core::master::{FakeClock, MasterConfig, MasterState, SegmentSpec, Tier};
use kvpool_fuzz::Records;
use kvpool_master::metrics::MasterMetrics;
use kvpool_master::service::{Core, MasterSvc, dispatch_fast_call};
use kvpool_proto::auth::{AuthKey, Role, Verified, Verifier};
use kvpool_proto::fast::{self, Method};
use kvpool_proto::master::{self as proto, master_server::Master};
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tonic::Request;

struct Fixture {
    rt: tokio::runtime::Runtime,
    metrics: MasterMetrics,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| Fixture {
        rt: tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime"),
        metrics: MasterMetrics::new(&prometheus::Registry::new(), "lru").expect("metrics"),
    })
}

fn spec(node: &str, tier: Tier, capacity_bytes: u64) -> SegmentSpec {
    SegmentSpec {
        node: node.into(),
        name: format!("{node}-{tier:?}"),
        tier,
        capacity_bytes,
        numa_node: 0,
        failure_domain: String::new(),
        endpoints: vec!["tcp://127.0.0.1:1".into()],
        persistent: false,
    }
}

/// Whether `reply` decodes as the response message of `method`.
fn decodes(method: Method, reply: &[u8]) -> bool {
    match method {
        Method::Get => proto::GetResponse::decode(reply).is_ok(),
        Method::Exists => proto::ExistsResponse::decode(reply).is_ok(),
        Method::PutStart => proto::PutStartResponse::decode(reply).is_ok(),
        Method::LongestPrefix => proto::LongestPrefixResponse::decode(reply).is_ok(),
        Method::PutEnd | Method::PutRevoke | Method::ReleaseLeases | Method::Remove => {
            proto::ItemResults::decode(reply).is_ok()
        }
    }
}

/// The checked credential of the caller `who` picks for a call of `method`, as the master's
/// interceptor leaves it in the request.
fn caller(who: u8, method: &str) -> Verified {
    static POOL: OnceLock<AuthKey> = OnceLock::new();
    let pool = POOL.get_or_init(|| AuthKey::from_bytes(b"fuzz-pool-key-0123456789").expect("key"));
    let key = match who % 4 {
        0 => Some(pool.clone()),
        1 => pool.derive_node("a"),
        2 => pool.derive_node("b"),
        _ => pool.derive(Role::Agent),
    }
    .expect("derived key");
    let verifier = Verifier::new(pool)
        .expect("pool key")
        .allow_shared_agents(who & 4 != 0);
    verifier
        .verify(Some(&key.sign(method)), method)
        .expect("a fresh credential of a role that may call it")
}

async fn grpc_only(svc: &MasterSvc, tag: u8, body: &[u8]) {
    let who = tag / 10;
    macro_rules! call {
        ($method:ident, $name:literal, $msg:ty) => {
            if let Ok(m) = <$msg>::decode(body) {
                let mut req = Request::new(m);
                // The agent role may not call RemoveAll: that one is always the pool key's.
                let who = if $name == "RemoveAll" { 0 } else { who };
                req.extensions_mut().insert(caller(who, $name));
                let _ = svc.$method(req).await;
            }
        };
    }
    match tag % 10 {
        1 => call!(mount_segment, "MountSegment", proto::MountSegmentRequest),
        2 => call!(unmount_segment, "UnmountSegment", proto::UnmountSegmentRequest),
        3 => call!(heartbeat, "Heartbeat", proto::HeartbeatRequest),
        4 => call!(complete_task, "CompleteTask", proto::CompleteTaskRequest),
        5 => call!(adopt_replicas, "AdoptReplicas", proto::AdoptReplicasRequest),
        6 => call!(pin, "Pin", proto::PinRequest),
        7 => call!(unpin, "Unpin", proto::KeysRequest),
        8 => call!(remove_all, "RemoveAll", proto::Empty),
        _ => call!(stats, "Stats", proto::Empty),
    }
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    let mut state = MasterState::new(MasterConfig::default(), Arc::new(FakeClock::new(1 << 40)));
    state
        .mount(spec("a", Tier::Dram, 64 << 20))
        .expect("mount DRAM");
    state
        .mount(spec("b", Tier::Ssd, 256 << 20))
        .expect("mount SSD");
    let core = Core::standalone(state, f.metrics.clone());
    let svc = MasterSvc::new(core.clone());
    f.rt.block_on(async {
        for (tag, body) in Records(data) {
            if tag % 10 != 0 {
                grpc_only(&svc, tag, body).await;
                continue;
            }
            let Ok(req) = fast::decode_request(body) else {
                continue;
            };
            let mut again = Vec::new();
            fast::encode_request(
                &mut again,
                req.method,
                req.credential,
                &req.releases,
                req.body,
            );
            let reparsed = fast::decode_request(&again[4..]).expect("a re-encoded frame decodes");
            assert_eq!(reparsed, req);
            if !req.releases.is_empty() {
                let release = proto::ReleaseLeasesRequest {
                    lease_ids: req.releases.clone(),
                };
                let _ = svc.release_leases(Request::new(release)).await;
            }
            if let Ok(reply) = dispatch_fast_call(&svc, req.method, req.body).await {
                assert!(
                    decodes(req.method, &reply),
                    "{:?} reply does not decode",
                    req.method
                );
            }
        }
    });
    let stats = core.state.lock().stats();
    for t in 0..2 {
        assert!(
            stats.used_bytes[t] <= stats.capacity_bytes[t],
            "tier {t}: {stats:?}"
        );
    }
});

//! The node agent's engine API (gRPC over its Unix socket): each record of the input
//! (`kvpool_fuzz::Records`) is the protobuf body of one call, its tag the method (open session,
//! close session, put, get, exists, remove), decoded as tonic decodes it and run by the
//! production service against a local-only tiered store (4 MiB of DRAM) with session 1's
//! 1 MiB staging area open. Every batch answers one status per item, in order; a block
//! read back is never longer than the room the engine gave. Sessions the input opened and
//! blocks it stored are dropped after each input.
#![no_main]

use std::sync::{Arc, OnceLock};

use kvpool_agent::api::BlockStore;
use kvpool_agent::api::server::{ApiLimits, EngineService};
use kvpool_agent::dram::DramTier;
use kvpool_agent::metrics::AgentMetrics;
use kvpool_agent::placement::SegmentPlan;
use kvpool_agent::proto::engine_api_server::EngineApi;
use kvpool_agent::proto::{
    CloseSessionRequest, ExistsRequest, GetRequest, OpenSessionRequest, PutRequest, RemoveRequest,
    Status,
};
use kvpool_agent::store::TieredStore;
use kvpool_fuzz::Records;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tonic::Request;

const STAGING: u64 = 1 << 20;

struct Fixture {
    rt: tokio::runtime::Runtime,
    service: EngineService,
    _dir: tempfile::TempDir,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let shm = std::path::Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            tempfile::tempdir_in(shm)
        } else {
            tempfile::tempdir()
        }
        .expect("staging directory");
        let plans = [SegmentPlan {
            numa_node: None,
            bytes: 4 << 20,
            hugepage_size: None,
        }];
        let (dram, _) = DramTier::new(&plans, false).expect("DRAM tier");
        let metrics = Arc::new(AgentMetrics::new(&prometheus::Registry::new()).expect("metrics"));
        let store = Arc::new(TieredStore::new(dram, None, Arc::clone(&metrics)));
        let service = EngineService::new(
            store as Arc<dyn BlockStore>,
            metrics,
            dir.path().to_owned(),
            ApiLimits {
                max_sessions: 4,
                max_staging_bytes: STAGING,
            },
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let open = OpenSessionRequest {
            staging_bytes: STAGING,
            client_name: "fuzz".into(),
            ..Default::default()
        };
        let first = rt
            .block_on(service.open_session(Request::new(open)))
            .expect("session 1");
        assert_eq!(first.into_inner().session_id, 1);
        Fixture {
            rt,
            service,
            _dir: dir,
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    let svc = &f.service;
    let mut opened = Vec::new();
    let mut stored = Vec::new();
    f.rt.block_on(async {
        for (tag, body) in Records(data) {
            match tag % 6 {
                0 => {
                    let Ok(req) = OpenSessionRequest::decode(body) else {
                        continue;
                    };
                    if let Ok(r) = svc.open_session(Request::new(req)).await {
                        opened.push(r.into_inner().session_id);
                    }
                }
                1 => {
                    let Ok(req) = CloseSessionRequest::decode(body) else {
                        continue;
                    };
                    // Session 1 stays: the input may not close the fixture's own.
                    if req.session_id != 1 {
                        let _ = svc.close_session(Request::new(req)).await;
                    }
                }
                2 => {
                    let Ok(req) = PutRequest::decode(body) else {
                        continue;
                    };
                    let keys: Vec<Vec<u8>> = req.items.iter().map(|i| i.key.clone()).collect();
                    if let Ok(r) = svc.put(Request::new(req)).await {
                        let statuses = r.into_inner().statuses;
                        assert_eq!(statuses.len(), keys.len(), "one status per put item");
                        for (key, s) in keys.into_iter().zip(statuses) {
                            if s == Status::Ok as i32 {
                                stored.push(key);
                            }
                        }
                    }
                }
                3 => {
                    let Ok(req) = GetRequest::decode(body) else {
                        continue;
                    };
                    let rooms: Vec<u64> = req.items.iter().map(|i| i.capacity).collect();
                    if let Ok(r) = svc.get(Request::new(req)).await {
                        let results = r.into_inner().results;
                        assert_eq!(results.len(), rooms.len(), "one result per get item");
                        for (room, res) in rooms.into_iter().zip(results) {
                            if res.status == Status::Ok as i32 {
                                assert!(res.length <= room, "{} bytes into {room}", res.length);
                            }
                        }
                    }
                }
                4 => {
                    let Ok(req) = ExistsRequest::decode(body) else {
                        continue;
                    };
                    let n = req.keys.len();
                    if let Ok(r) = svc.exists(Request::new(req)).await {
                        assert_eq!(r.into_inner().present.len(), n, "one answer per key");
                    }
                }
                _ => {
                    let Ok(req) = RemoveRequest::decode(body) else {
                        continue;
                    };
                    let n = req.keys.len();
                    if let Ok(r) = svc.remove(Request::new(req)).await {
                        assert_eq!(r.into_inner().removed.len(), n, "one answer per key");
                    }
                }
            }
        }
        for session_id in opened {
            let _ = svc
                .close_session(Request::new(CloseSessionRequest { session_id }))
                .await;
        }
        if !stored.is_empty() {
            let _ = svc
                .remove(Request::new(RemoveRequest { keys: stored }))
                .await;
        }
    });
});

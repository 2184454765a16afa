//! The engine API through a real Unix socket: an in-process server on a socket in a temp
//! directory, the crate's client, shared-memory staging files.

use std::path::Path;
use std::sync::Arc;

use kvpool_agent::api::BlockStore;
use kvpool_agent::api::client::{EngineClient, GetOutcome, connect_channel};
use kvpool_agent::api::server::{self, ApiLimits, EngineService};
use kvpool_agent::dram::DramTier;
use kvpool_agent::metrics::AgentMetrics;
use kvpool_agent::placement::SegmentPlan;
use kvpool_agent::proto::engine_api_client::EngineApiClient;
use kvpool_agent::proto::{CloseSessionRequest, PutItem, PutRequest, Status};
use kvpool_agent::ssd::{DirectIo, SsdConfig, SsdTier};
use kvpool_agent::store::TieredStore;
use tokio_util::sync::CancellationToken;

struct Agent {
    _dir: tempfile::TempDir,
    service: EngineService,
    socket: std::path::PathBuf,
    shm_dir: std::path::PathBuf,
    store: Arc<TieredStore>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), server::ServerError>>,
}

async fn start(dram_bytes: u64, ssd: bool) -> Agent {
    let dir = tempfile::tempdir().expect("tempdir");
    let plans = [SegmentPlan {
        numa_node: Some(0),
        bytes: dram_bytes,
        hugepage_size: None,
    }];
    let (dram, _) = DramTier::new(&plans, false).expect("dram");
    let ssd = ssd.then(|| {
        SsdTier::open(&SsdConfig {
            dir: dir.path().join("ssd"),
            capacity: 16 << 20,
            direct_io: DirectIo::Auto,
        })
        .expect("ssd")
        .0
    });
    let metrics = Arc::new(AgentMetrics::new(&prometheus::Registry::new()).expect("metrics"));
    let store = Arc::new(TieredStore::new(dram, ssd, Arc::clone(&metrics)));
    let shm_dir = dir.path().join("shm");
    std::fs::create_dir_all(&shm_dir).expect("shm dir");
    let service = EngineService::new(
        Arc::clone(&store) as Arc<dyn BlockStore>,
        metrics,
        shm_dir.clone(),
        ApiLimits {
            max_sessions: 2,
            max_staging_bytes: 4 << 20,
        },
    );
    let (listener, socket) = server::bind(&dir.path().join("run")).expect("bind");
    let stop = CancellationToken::new();
    let task = tokio::spawn(server::serve(listener, service.clone(), stop.clone()));
    Agent {
        _dir: dir,
        service,
        socket,
        shm_dir,
        store,
        stop,
        task,
    }
}

impl Agent {
    /// A client with 1 MiB of staging.
    async fn client(&self) -> EngineClient {
        EngineClient::connect(&self.socket, 1 << 20, "test")
            .await
            .expect("connect")
    }

    async fn stop(self) {
        self.stop.cancel();
        self.task.await.expect("join").expect("serve");
    }
}

fn staging_files(dir: &Path) -> usize {
    std::fs::read_dir(dir).expect("read_dir").count()
}

#[tokio::test]
async fn put_get_exists_remove_single_and_batched() {
    let agent = start(1 << 20, false).await;
    let mut c = agent.client().await;
    assert_eq!(staging_files(&agent.shm_dir), 1);

    assert_eq!(c.put(b"k1", b"hello world").await.expect("put"), Status::Ok);
    assert_eq!(
        c.get(b"k1").await.expect("get").as_deref(),
        Some(&b"hello world"[..])
    );
    assert_eq!(c.get(b"nope").await.expect("get"), None);

    // A batch: three blocks written side by side in the staging area.
    let blocks: Vec<Vec<u8>> = (0..3u8)
        .map(|i| vec![i + 1; 10_000 + usize::from(i)])
        .collect();
    let mut items = Vec::new();
    let mut offset = 0u64;
    for (i, b) in blocks.iter().enumerate() {
        c.staging().write_from(offset, b).expect("stage");
        items.push((format!("b{i}").into_bytes(), offset, b.len() as u64));
        offset += b.len() as u64;
    }
    let refs: Vec<(&[u8], u64, u64)> = items
        .iter()
        .map(|(k, o, l)| (k.as_slice(), *o, *l))
        .collect();
    let statuses = c.put_batch(&refs, Some(0)).await.expect("put batch");
    assert_eq!(statuses, vec![Status::Ok; 3]);

    // Read them back in reverse order into different places.
    let gets: Vec<(&[u8], u64, u64)> = vec![
        (b"b2", 500_000, 20_000),
        (b"b1", 400_000, 20_000),
        (b"missing", 0, 100),
        (b"b0", 300_000, 100),
    ];
    let out = c.get_batch(&gets).await.expect("get batch");
    assert_eq!(
        out,
        vec![
            GetOutcome {
                status: Status::Ok,
                length: 10_002
            },
            GetOutcome {
                status: Status::Ok,
                length: 10_001
            },
            GetOutcome {
                status: Status::NotFound,
                length: 0
            },
            GetOutcome {
                status: Status::BufferTooSmall,
                length: 10_000
            },
        ]
    );
    let mut back = vec![0u8; 10_002];
    c.staging().read_into(500_000, &mut back).expect("read");
    assert_eq!(back, blocks[2]);

    assert_eq!(
        c.exists(&[b"b0", b"zz", b"k1"]).await.expect("exists"),
        vec![true, false, true]
    );
    assert_eq!(
        c.remove(&[b"b0", b"b0", b"zz"]).await.expect("remove"),
        vec![true, false, false]
    );
    assert_eq!(c.exists(&[b"b0"]).await.expect("exists"), vec![false]);

    let m = agent.store.metrics();
    // The too-small get found its block: a hit.
    assert_eq!(m.hits.with_label_values(&["dram"]).get(), 4);
    assert_eq!(m.misses.get(), 2);
    assert_eq!(m.sessions.get(), 1);
    assert!(m.op_seconds.with_label_values(&["get"]).get_sample_count() >= 2);

    c.close().await.expect("close");
    assert_eq!(staging_files(&agent.shm_dir), 0, "staging file removed");
    agent.stop().await;
}

#[tokio::test]
async fn bad_requests_get_clear_answers() {
    let agent = start(64 << 10, false).await;
    let mut c = agent.client().await;
    // Ranges outside the staging area, empty keys, blocks larger than DRAM.
    let statuses = c
        .put_batch(
            &[
                (b"a", (1 << 20) - 10, 20),
                (b"b", u64::MAX, 2),
                (b"", 0, 10),
                (b"big", 0, 128 << 10),
            ],
            None,
        )
        .await
        .expect("put");
    assert_eq!(
        statuses,
        vec![
            Status::Invalid,
            Status::Invalid,
            Status::Invalid,
            Status::Invalid
        ]
    );
    let out = c.get_batch(&[(b"a", 1 << 20, 1)]).await.expect("get");
    assert_eq!(out[0].status, Status::Invalid);

    // Staging larger than allowed, and too many sessions.
    let err = EngineClient::connect(&agent.socket, 8 << 20, "greedy")
        .await
        .expect_err("too big");
    assert!(err.to_string().contains("open_session"), "{err}");
    let _second = EngineClient::connect(&agent.socket, 4096, "two")
        .await
        .expect("second");
    let err = EngineClient::connect(&agent.socket, 4096, "three")
        .await
        .expect_err("third session");
    let text = format!("{err:?}");
    assert!(text.contains("ResourceExhausted"), "{text}");
    agent.stop().await;
}

#[tokio::test]
async fn blocks_demote_to_ssd_and_come_back() {
    // 64 KiB of DRAM, 40 KiB blocks: every put evicts the previous block to SSD.
    let agent = start(64 << 10, true).await;
    let mut c = agent.client().await;
    for i in 0..4u8 {
        let data = vec![i; 40 << 10];
        assert_eq!(c.put(&[b'k', i], &data).await.expect("put"), Status::Ok);
    }
    let m = agent.store.metrics();
    assert_eq!(m.demotions.get(), 3);
    for i in 0..4u8 {
        let got = c.get(&[b'k', i]).await.expect("get").expect("present");
        assert_eq!(got, vec![i; 40 << 10]);
    }
    // Each get promotes and so evicts the block promoted before it; k3 was still in DRAM at
    // first, is evicted by k0's promotion and then read from SSD too.
    assert_eq!(m.hits.with_label_values(&["ssd"]).get(), 4);
    assert_eq!(m.promotions.get(), 4);
    // Evicting a promoted block needs no second write: only k3 was demoted once more.
    assert_eq!(m.demotions.get(), 4);
    agent.stop().await;
}

#[tokio::test]
async fn unknown_or_closed_session_is_rejected() {
    let agent = start(64 << 10, false).await;
    let c = EngineClient::connect(&agent.socket, 4096, "test")
        .await
        .expect("connect");
    c.close().await.expect("close");
    let channel = connect_channel(&agent.socket).await.expect("channel");
    let mut raw = EngineApiClient::new(channel);
    for session_id in [1, 999] {
        let err = raw
            .put(PutRequest {
                session_id,
                items: vec![PutItem {
                    key: b"k".to_vec(),
                    offset: 0,
                    length: 1,
                }],
                numa_hint: None,
            })
            .await
            .expect_err("no such session");
        assert_eq!(err.code(), tonic::Code::NotFound, "{err}");
        let err = raw
            .close_session(CloseSessionRequest { session_id })
            .await
            .expect_err("no such session");
        assert_eq!(err.code(), tonic::Code::NotFound, "{err}");
    }
    assert_eq!(staging_files(&agent.shm_dir), 0);
    agent.stop().await;
}

#[tokio::test]
async fn idle_sessions_are_reaped() {
    let agent = start(64 << 10, false).await;
    let mut c = EngineClient::connect(&agent.socket, 4096, "forgetful")
        .await
        .expect("connect");
    assert_eq!(c.put(b"k", b"v").await.expect("put"), Status::Ok);
    assert_eq!(
        agent
            .service
            .reap_idle(std::time::Duration::from_secs(3600)),
        0
    );
    assert_eq!(staging_files(&agent.shm_dir), 1);
    assert_eq!(agent.service.reap_idle(std::time::Duration::ZERO), 1);
    assert_eq!(staging_files(&agent.shm_dir), 0, "staging file removed");
    let err = c.put(b"k", b"v").await.expect_err("session gone");
    assert!(format!("{err:?}").contains("NotFound"), "{err:?}");
    assert_eq!(agent.store.metrics().sessions.get(), 0);
    agent.stop().await;
}

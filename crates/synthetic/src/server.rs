//! HTTP server of the synthetic engine (axum): `/v1/completions`, `/v1/chat/completions`
//! (JSON or server-sent events), `/v1/models`. I/O boundary: the TCP listener, the timers
//! that stand in for GPU work, and (through `agent`) the node agent that holds the KV blocks.

use kvpool_proto::openai::{KV_LOAD_BLOCKS_HEADER, KV_LOAD_SECONDS_HEADER};
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry,
};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::agent::AgentKv;
use super::{EngineConfig, EngineCore, SglangRole};
use kvpool_core::sched::{BlockKey, block_keys, text_tokens};
use kvpool_proto::openai::{
    self as api, ApiError, Endpoint, GenerateRequest, KvRole, ResponseMeta,
};

/// Errors of the engine server.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum ServerError {
    #[error("cannot register engine metrics")]
    Metrics(#[source] prometheus::Error),
    #[error("engine server failed")]
    Serve(#[source] std::io::Error),
}

impl ServerError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

#[derive(Clone)]
struct Metrics {
    requests: IntCounterVec,
    prompt_tokens: IntCounter,
    cached_tokens: IntCounter,
    generated_tokens: IntCounter,
    kv_read_bytes: IntCounter,
    kv_written_bytes: IntCounter,
    kv_block_hits: IntCounter,
    kv_block_misses: IntCounter,
    kv_blocks_written: IntCounter,
    kv_verify_failures: IntCounter,
    kv_errors: IntCounterVec,
    prefetches: IntCounterVec,
    kv_seconds: HistogramVec,
    lane_wait_seconds: Histogram,
    handoffs: IntCounterVec,
}

/// Buckets of the engine's latency histograms, seconds (100 µs to 10 s).
const LATENCY_BUCKETS: &[f64] = &[
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

impl Metrics {
    fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let m = Self {
            requests: IntCounterVec::new(
                Opts::new(
                    "kvpool_engine_requests_total",
                    "Requests by outcome (ok or the error category)",
                ),
                &["outcome"],
            )?,
            prompt_tokens: IntCounter::new(
                "kvpool_engine_prompt_tokens_total",
                "Prompt tokens received",
            )?,
            cached_tokens: IntCounter::new(
                "kvpool_engine_cached_prompt_tokens_total",
                "Prompt tokens found in the prefix cache",
            )?,
            generated_tokens: IntCounter::new(
                "kvpool_engine_generated_tokens_total",
                "Tokens generated",
            )?,
            kv_read_bytes: IntCounter::new(
                "kvpool_engine_kv_read_bytes_total",
                "KV bytes read from the node agent",
            )?,
            kv_written_bytes: IntCounter::new(
                "kvpool_engine_kv_written_bytes_total",
                "KV bytes written to the node agent",
            )?,
            kv_block_hits: IntCounter::new(
                "kvpool_engine_kv_block_hits_total",
                "KV blocks read from the pool and verified",
            )?,
            kv_block_misses: IntCounter::new(
                "kvpool_engine_kv_block_misses_total",
                "Full prompt blocks in neither the local cache nor the pool (computed here)",
            )?,
            kv_blocks_written: IntCounter::new(
                "kvpool_engine_kv_blocks_written_total",
                "KV blocks written to the pool",
            )?,
            kv_verify_failures: IntCounter::new(
                "kvpool_engine_kv_verify_failures_total",
                "KV blocks read back with wrong length or bytes",
            )?,
            kv_errors: IntCounterVec::new(
                Opts::new(
                    "kvpool_engine_kv_errors_total",
                    "Failed calls to the node agent by operation (the request goes on without the pool)",
                ),
                &["op"],
            )?,
            prefetches: IntCounterVec::new(
                Opts::new(
                    "kvpool_engine_prefetch_requests_total",
                    "Prefetch requests by outcome (ok, unsupported without an agent, invalid, error)",
                ),
                &["outcome"],
            )?,
            kv_seconds: HistogramVec::new(
                HistogramOpts::new(
                    "kvpool_engine_kv_seconds",
                    "Wall time of the engine's KV work with the node agent, by operation (exists, \
                     read, write, and handoff_wait: an SGLang decode waiting for its room)",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
                &["op"],
            )?,
            lane_wait_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "kvpool_engine_prefill_queue_seconds",
                    "Wall time requests wait for the engine's (serialised) prefill compute",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
            )?,
            handoffs: IntCounterVec::new(
                Opts::new(
                    "kvpool_engine_kv_handoffs_total",
                    "SGLang-mode decode requests by hand-off outcome (ok, timeout, agent)",
                ),
                &["outcome"],
            )?,
        };
        registry.register(Box::new(m.kv_seconds.clone()))?;
        registry.register(Box::new(m.lane_wait_seconds.clone()))?;
        registry.register(Box::new(m.handoffs.clone()))?;
        registry.register(Box::new(m.prefetches.clone()))?;
        registry.register(Box::new(m.requests.clone()))?;
        registry.register(Box::new(m.prompt_tokens.clone()))?;
        registry.register(Box::new(m.cached_tokens.clone()))?;
        registry.register(Box::new(m.generated_tokens.clone()))?;
        for c in [
            &m.kv_read_bytes,
            &m.kv_written_bytes,
            &m.kv_block_hits,
            &m.kv_block_misses,
            &m.kv_blocks_written,
            &m.kv_verify_failures,
        ] {
            registry.register(Box::new(c.clone()))?;
        }
        registry.register(Box::new(m.kv_errors.clone()))?;
        Ok(m)
    }
}

struct Shared {
    config: EngineConfig,
    kv: Option<AgentKv>,
    core: parking_lot::Mutex<EngineCore>,
    /// Prefills run one at a time, in arrival order (tokio's mutex is fair).
    prefill_lane: tokio::sync::Mutex<()>,
    decoding: AtomicU64,
    decode_tokens: AtomicU64,
    next_id: AtomicU64,
    metrics: Metrics,
}

/// Membership in the decode batch; leaves it when dropped (also when the client goes away).
struct DecodeSeat<'a> {
    shared: &'a Shared,
    tokens: u64,
}

impl<'a> DecodeSeat<'a> {
    fn join(shared: &'a Shared, tokens: u64) -> Self {
        shared.decoding.fetch_add(1, Ordering::SeqCst);
        shared.decode_tokens.fetch_add(tokens, Ordering::SeqCst);
        Self { shared, tokens }
    }
    fn grow(&mut self) {
        self.tokens += 1;
        self.shared.decode_tokens.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for DecodeSeat<'_> {
    fn drop(&mut self) {
        self.shared.decoding.fetch_sub(1, Ordering::SeqCst);
        self.shared
            .decode_tokens
            .fetch_sub(self.tokens, Ordering::SeqCst);
    }
}

fn scaled(shared: &Shared, seconds: f64) -> Duration {
    Duration::from_secs_f64((seconds * shared.config.time_scale).clamp(0.0, 3600.0))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Loads what the pool has of the prompt's full blocks beyond the local cache; returns how many
/// leading blocks are now available (0 when the local cache covers more) and the blocks to write
/// after prefill (absent from the pool; none for a decode engine).
async fn load_from_pool(
    shared: &Shared,
    kv: &AgentKv,
    role: KvRole,
    keys: &[BlockKey],
) -> (usize, Vec<BlockKey>) {
    let m = &shared.metrics;
    let local = shared.core.lock().local_prefix(keys);
    let (pool_prefix, to_write) = if role == KvRole::Decode {
        // The prefill engine wrote them: read without asking first.
        (keys.len(), Vec::new())
    } else {
        let timer = m.kv_seconds.with_label_values(&["exists"]).start_timer();
        let present = kv.present(keys).await;
        timer.observe_duration();
        match present {
            Ok(present) => {
                let prefix = present.iter().take_while(|&&p| p).count();
                let absent = keys
                    .iter()
                    .zip(&present)
                    .filter(|(_, p)| !**p)
                    .map(|(&k, _)| k)
                    .collect();
                (prefix, absent)
            }
            Err(e) => {
                m.kv_errors.with_label_values(&[e.category()]).inc();
                tracing::warn!(error = %e, "cannot ask the agent which blocks it has");
                (0, Vec::new())
            }
        }
    };
    let mut loaded = 0;
    if pool_prefix > local {
        let timer = m.kv_seconds.with_label_values(&["read"]).start_timer();
        let read = kv.read_prefix(&keys[local..pool_prefix]).await;
        timer.observe_duration();
        match read {
            Ok(read) => {
                m.kv_read_bytes.inc_by(read.bytes);
                m.kv_block_hits.inc_by(read.verified as u64);
                m.kv_verify_failures.inc_by(read.corrupt as u64);
                if read.corrupt > 0 {
                    tracing::warn!(
                        block = local + read.verified,
                        "KV block read back from the agent does not match its key"
                    );
                }
                if read.verified > 0 {
                    loaded = local + read.verified;
                }
            }
            Err(e) => {
                m.kv_errors.with_label_values(&[e.category()]).inc();
                tracing::warn!(error = %e, "cannot read KV blocks from the agent");
            }
        }
    }
    let have = local.max(loaded);
    m.kv_block_misses.inc_by((keys.len() - have) as u64);
    (loaded, to_write)
}

/// `POST /kvpool/v1/prefetch`: reads the named blocks beyond the local cache from the pool,
/// verifying every byte, and caches the leading ones that arrived whole. Without an agent there
/// is no pool to read: 404, which tells the conductor to stop asking.
async fn prefetch(shared: Arc<Shared>, body: Bytes) -> Response {
    let m = &shared.metrics;
    let Some(kv) = &shared.kv else {
        m.prefetches.with_label_values(&["unsupported"]).inc();
        return (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({"error": {
                "message": "this engine has no node agent: prefetch is not supported",
                "type": "not_found", "param": null, "code": "prefetch_unsupported"}})),
        )
            .into_response();
    };
    let keys = match api::parse_prefetch(&body) {
        Ok(k) => k,
        Err(e) => {
            m.prefetches.with_label_values(&["invalid"]).inc();
            return error_response(&shared, &e);
        }
    };
    let local = shared.core.lock().local_prefix(&keys);
    let mut held = local;
    if let Some(rest) = keys.get(local..).filter(|r| !r.is_empty()) {
        match kv.read_prefix(rest).await {
            Ok(read) => {
                m.kv_read_bytes.inc_by(read.bytes);
                m.kv_block_hits.inc_by(read.verified as u64);
                m.kv_verify_failures.inc_by(read.corrupt as u64);
                held += read.verified;
            }
            Err(e) => {
                m.kv_errors.with_label_values(&[e.category()]).inc();
                m.prefetches.with_label_values(&["error"]).inc();
                tracing::warn!(error = %e, "prefetch: cannot read KV blocks from the agent");
                return (
                    StatusCode::BAD_GATEWAY,
                    Json(serde_json::json!({"error": {
                        "message": format!("cannot read from the node agent: {e}"),
                        "type": "upstream_error", "param": null, "code": "agent"}})),
                )
                    .into_response();
            }
        }
    }
    let loaded = keys.get(..held).unwrap_or(&keys);
    shared.core.lock().adopt(loaded);
    m.prefetches.with_label_values(&["ok"]).inc();
    Json(serde_json::json!({"loaded": held})).into_response()
}

async fn store_in_pool(shared: &Shared, kv: &AgentKv, keys: &[BlockKey]) {
    if keys.is_empty() {
        return;
    }
    let timer = shared
        .metrics
        .kv_seconds
        .with_label_values(&["write"])
        .start_timer();
    let written = kv.write(keys).await;
    timer.observe_duration();
    match written {
        Ok(w) => {
            shared.metrics.kv_written_bytes.inc_by(w.bytes);
            shared.metrics.kv_blocks_written.inc_by(w.written as u64);
            if w.refused > 0 {
                shared
                    .metrics
                    .kv_errors
                    .with_label_values(&["refused"])
                    .inc_by(w.refused as u64);
            }
        }
        Err(e) => {
            shared
                .metrics
                .kv_errors
                .with_label_values(&[e.category()])
                .inc();
            tracing::warn!(error = %e, "cannot write KV blocks to the agent");
        }
    }
}

/// What the engine tells the client once the prompt's KV is in place (before the first token):
/// the leading blocks it loaded from the pool, and the wall time the pool read took (headers
/// [`KV_LOAD_BLOCKS_HEADER`] and [`KV_LOAD_SECONDS_HEADER`], which the conductor turns into its
/// measured pool bandwidth).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct PrefillReport {
    prompt_tokens: u64,
    loaded_blocks: usize,
    load_seconds: f64,
}

/// Why a request could not get its KV cache.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum HandoffError {
    #[error(
        "the KV cache of bootstrap_room {room} did not arrive from the prefill engine within \
         {waited_s:.1} s"
    )]
    Timeout { room: u64, waited_s: f64 },
    #[error("cannot look for the KV cache of bootstrap_room {room} in the node agent")]
    Agent {
        room: u64,
        #[source]
        source: super::agent::AgentKvError,
    },
}

impl HandoffError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }

    fn response(&self) -> Response {
        let (status, code) = match self {
            HandoffError::Timeout { .. } => (StatusCode::GATEWAY_TIMEOUT, "kv_handoff_timeout"),
            HandoffError::Agent { .. } => (StatusCode::BAD_GATEWAY, "kv_handoff_agent"),
        };
        let mut message = self.to_string();
        if let Some(source) = std::error::Error::source(self) {
            message = format!("{message}: {source}");
        }
        (
            status,
            Json(serde_json::json!({"error": {
                "message": message, "type": "upstream_error", "param": "bootstrap_room",
                "code": code}})),
        )
            .into_response()
    }
}

/// Waits (polling the agent, bounded by `timeout`) until the prefill engine of `room` has
/// marked its KV hand-off done, then removes the marker.
async fn wait_for_room(kv: &AgentKv, room: u64, timeout: Duration) -> Result<(), HandoffError> {
    let marker = [super::kv::room_key(room)];
    let started = std::time::Instant::now();
    let mut pause = Duration::from_millis(1);
    loop {
        let present = kv
            .present(&marker)
            .await
            .map_err(|source| HandoffError::Agent { room, source })?;
        if present.first().copied().unwrap_or(false) {
            // Best effort: a marker left behind is evicted like any other object.
            if let Err(e) = kv.remove(&marker).await {
                tracing::debug!(error = %e, room, "cannot remove the hand-off marker");
            }
            return Ok(());
        }
        let waited = started.elapsed();
        if waited >= timeout {
            return Err(HandoffError::Timeout {
                room,
                waited_s: waited.as_secs_f64(),
            });
        }
        tokio::time::sleep(pause.min(timeout - waited)).await;
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// The request's role in disaggregated serving: the engine's own in SGLang mode, the one its
/// `kv_transfer_params` name in vLLM mode.
fn effective_role(config: &EngineConfig, req: &GenerateRequest) -> KvRole {
    match config.sglang.map(|m| m.role) {
        Some(SglangRole::Prefill) => KvRole::Prefill,
        Some(SglangRole::Decode) => KvRole::Decode,
        None => req.kv_role,
    }
}

/// Runs one request: KV in (the decode side first waits for its SGLang room), queued prefill
/// compute, KV out, then decode steps. The pool reads and writes happen outside the compute lane,
/// as a real engine overlaps KV transfers with other requests' compute; only the modelled
/// compute is serialised. Sends the [`PrefillReport`] (or the hand-off error) on `ready` once the
/// prompt's KV is in place, then each generated piece to `out` (waiting when the client lags:
/// the channel is bounded). Returns `None` when the receiver is gone (the client disconnected).
async fn generate(
    shared: Arc<Shared>,
    req: GenerateRequest,
    ready: oneshot::Sender<Result<PrefillReport, HandoffError>>,
    out: mpsc::Sender<String>,
) -> Option<()> {
    let m = &shared.metrics;
    let role = effective_role(&shared.config, &req);
    let tokens = text_tokens(&req.prompt, shared.config.chunk_bytes);
    let mut keys = block_keys(&tokens, shared.config.block_size);
    // Only full blocks go to the pool, as real engines do.
    keys.truncate(tokens.len() / shared.config.block_size.get() as usize);
    let room = req.bootstrap.as_ref().map(|b| b.room);
    let mut report = PrefillReport::default();
    let mut to_write = Vec::new();
    let mut loaded = 0;
    if let Some(kv) = &shared.kv {
        if let (Some(mode), KvRole::Decode, Some(room)) = (shared.config.sglang, role, room) {
            let timer = m
                .kv_seconds
                .with_label_values(&["handoff_wait"])
                .start_timer();
            let waited = wait_for_room(kv, room, mode.bootstrap_timeout).await;
            timer.observe_duration();
            if let Err(e) = waited {
                m.handoffs.with_label_values(&[e.category()]).inc();
                tracing::warn!(error = %e, "KV hand-off failed");
                let _ = ready.send(Err(e));
                return None;
            }
            m.handoffs.with_label_values(&["ok"]).inc();
        }
        let started = std::time::Instant::now();
        let local = shared.core.lock().local_prefix(&keys);
        (loaded, to_write) = load_from_pool(&shared, kv, role, &keys).await;
        report.loaded_blocks = loaded.saturating_sub(local);
        report.load_seconds = started.elapsed().as_secs_f64();
    }
    let plan = {
        let timer = m.lane_wait_seconds.start_timer();
        let _lane = shared.prefill_lane.lock().await;
        timer.observe_duration();
        let plan = shared.core.lock().prefill_with(&tokens, loaded);
        tokio::time::sleep(scaled(&shared, plan.seconds)).await;
        plan
    };
    if let Some(kv) = &shared.kv {
        store_in_pool(&shared, kv, &to_write).await;
        if let (Some(_), KvRole::Prefill, Some(room)) = (shared.config.sglang, role, room) {
            // The room's blocks are all in the pool: tell its decode engine.
            store_in_pool(&shared, kv, &[super::kv::room_key(room)]).await;
        }
    }
    m.prompt_tokens.inc_by(plan.prompt_tokens);
    m.cached_tokens.inc_by(plan.cached_tokens);
    report.prompt_tokens = plan.prompt_tokens;
    if ready.send(Ok(report)).is_err() {
        return None;
    }
    // An SGLang prefill engine stops after the first token: its decode engine generates.
    let max_tokens = match (shared.config.sglang, role) {
        (Some(_), KvRole::Prefill) => 1,
        _ => req.max_tokens,
    };
    let mut seat = DecodeSeat::join(&shared, plan.prompt_tokens);
    for i in 0..max_tokens {
        let batch = shared.decoding.load(Ordering::SeqCst);
        let ctx = shared.decode_tokens.load(Ordering::SeqCst);
        let step = shared.config.decode_cost.step_seconds(batch, ctx);
        tokio::time::sleep(scaled(&shared, step)).await;
        seat.grow();
        m.generated_tokens.inc();
        if out.send(format!("tok{i} ")).await.is_err() {
            return None;
        }
    }
    Some(())
}

fn error_response(shared: &Shared, err: &ApiError) -> Response {
    shared
        .metrics
        .requests
        .with_label_values(&[err.category()])
        .inc();
    let status = StatusCode::from_u16(err.status()).unwrap_or(StatusCode::BAD_REQUEST);
    (status, Json(err.body())).into_response()
}

fn with_report_headers(mut resp: Response, report: &PrefillReport) -> Response {
    let mut values = vec![(KV_LOAD_BLOCKS_HEADER, report.loaded_blocks.to_string())];
    if report.loaded_blocks > 0 {
        values.push((
            KV_LOAD_SECONDS_HEADER,
            format!("{:.6}", report.load_seconds),
        ));
    }
    for (name, value) in values {
        if let Ok(v) = axum::http::HeaderValue::from_str(&value) {
            resp.headers_mut().insert(name, v);
        }
    }
    resp
}

async fn handle(shared: Arc<Shared>, endpoint: Endpoint, body: Bytes) -> Response {
    let req = match api::parse_request(endpoint, &body, &shared.config.model) {
        Ok(r) => r,
        Err(e) => return error_response(&shared, &e),
    };
    if let (Some(mode), None) = (shared.config.sglang, &req.bootstrap) {
        let e = ApiError::Invalid {
            field: "bootstrap_room",
            problem: format!(
                "is required: this engine serves the {} half of SGLang disaggregation",
                match mode.role {
                    SglangRole::Prefill => "prefill",
                    SglangRole::Decode => "decode",
                }
            ),
        };
        return error_response(&shared, &e);
    }
    let prefix = match endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::ChatCompletions => "chatcmpl",
    };
    let meta = ResponseMeta {
        id: format!("{prefix}-{}", shared.next_id.fetch_add(1, Ordering::SeqCst)),
        created: unix_now(),
        model: req.model.clone(),
        endpoint,
    };
    let stream = req.stream;
    let role = effective_role(&shared.config, &req);
    let max_tokens = match (shared.config.sglang, role) {
        (Some(_), KvRole::Prefill) => 1,
        _ => req.max_tokens,
    };
    let block_size = u64::from(shared.config.block_size.get());
    let (tx, mut rx) = mpsc::channel::<String>(64);
    let (ready_tx, ready_rx) = oneshot::channel();
    let task = tokio::spawn(generate(shared.clone(), req, ready_tx, tx));
    // Headers go out once the prompt's KV is in place, so that a failed hand-off is a clean
    // HTTP error and the time to the headers is the time to the first token's readiness.
    let report = match ready_rx.await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            shared
                .metrics
                .requests
                .with_label_values(&["kv_handoff"])
                .inc();
            return e.response();
        }
        Err(_) => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    };
    shared.metrics.requests.with_label_values(&["ok"]).inc();
    let prompt = report.prompt_tokens;
    if !stream {
        let mut text = String::new();
        while let Some(piece) = rx.recv().await {
            text.push_str(&piece);
        }
        return match task.await {
            Ok(Some(())) => {
                let mut body = api::response_body(&meta, &text, prompt, u64::from(max_tokens));
                if let (KvRole::Prefill, None, Some(obj)) =
                    (role, shared.config.sglang, body.as_object_mut())
                {
                    obj.insert(
                        "kv_transfer_params".into(),
                        api::prefill_kv_params(prompt / block_size),
                    );
                }
                with_report_headers(Json(body).into_response(), &report)
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        };
    }
    let pieces = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
    let events = pieces
        .enumerate()
        .map(move |(i, piece)| {
            let chunk = api::chunk_body(&meta, &piece, i == 0, i + 1 == max_tokens as usize);
            Ok::<_, Infallible>(Event::default().data(chunk.to_string()))
        })
        .chain(futures::stream::once(async {
            Ok(Event::default().data("[DONE]"))
        }));
    with_report_headers(Sse::new(events).into_response(), &report)
}

/// Router of the engine API (no node agent: the prefix cache is the only KV store).
pub fn router(config: EngineConfig, registry: &Registry) -> Result<Router, ServerError> {
    router_with_agent(config, None, registry)
}

/// Router of the engine API; with `kv`, KV blocks are read from and written to the node agent.
pub fn router_with_agent(
    config: EngineConfig,
    kv: Option<AgentKv>,
    registry: &Registry,
) -> Result<Router, ServerError> {
    let metrics = Metrics::register(registry).map_err(ServerError::Metrics)?;
    let shared = Arc::new(Shared {
        kv,
        core: parking_lot::Mutex::new(EngineCore::new(config.clone())),
        config,
        prefill_lane: tokio::sync::Mutex::new(()),
        decoding: AtomicU64::new(0),
        decode_tokens: AtomicU64::new(0),
        next_id: AtomicU64::new(1),
        metrics,
    });
    let created = unix_now();
    Ok(Router::new()
        .route(
            "/v1/completions",
            post(|State(s): State<Arc<Shared>>, body: Bytes| async move {
                handle(s, Endpoint::Completions, body).await
            }),
        )
        .route(
            "/v1/chat/completions",
            post(|State(s): State<Arc<Shared>>, body: Bytes| async move {
                handle(s, Endpoint::ChatCompletions, body).await
            }),
        )
        .route(
            "/v1/models",
            get(move |State(s): State<Arc<Shared>>| async move {
                Json(api::models_body(&s.config.model, created))
            }),
        )
        .route(
            api::PREFETCH_PATH,
            post(
                |State(s): State<Arc<Shared>>, body: Bytes| async move { prefetch(s, body).await },
            ),
        )
        .with_state(shared))
}

/// Serves `router` on `listener` until `shutdown` is cancelled.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
) -> Result<(), ServerError> {
    axum::serve(listener, router)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
        .map_err(ServerError::Serve)
}

//! HTTP server of the synthetic engine (axum): `/v1/completions`, `/v1/chat/completions`
//! (JSON or server-sent events), `/v1/models`. I/O boundary: the TCP listener, the timers
//! that stand in for GPU work, and (through `agent`) the node agent that holds the KV blocks.

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
use prometheus::{IntCounter, IntCounterVec, Opts, Registry};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::agent::AgentKv;
use super::api::{self, ApiError, Endpoint, GenerateRequest, KvRole, ResponseMeta};
use super::{EngineConfig, EngineCore};
use crate::sched::{BlockKey, block_keys, text_tokens};

/// Errors of the engine server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot register engine metrics")]
    Metrics(#[source] prometheus::Error),
    #[error("engine server failed")]
    Serve(#[source] std::io::Error),
}

impl ServerError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        match self {
            ServerError::Metrics(_) => "metrics",
            ServerError::Serve(_) => "serve",
        }
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
}

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
        };
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

/// Runs one request: queued prefill, then decode steps, sending each generated piece to `out`
/// (waiting when the client lags: the channel is bounded). Returns the prompt's token count, or
/// `None` when the receiver is gone (the client disconnected).
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
        match kv.present(keys).await {
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
        match kv.read_prefix(&keys[local..pool_prefix]).await {
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
    match kv.write(keys).await {
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

/// Runs one request: queued prefill (with the pool's blocks when an agent is configured), then
/// decode steps, sending each generated piece to `out` (waiting when the client lags: the
/// channel is bounded). Returns the prompt's token count, or `None` when the receiver is gone
/// (the client disconnected).
async fn generate(
    shared: Arc<Shared>,
    req: GenerateRequest,
    out: mpsc::Sender<String>,
) -> Option<u64> {
    let tokens = text_tokens(&req.prompt, shared.config.chunk_bytes);
    let plan = {
        let _lane = shared.prefill_lane.lock().await;
        let mut to_write = Vec::new();
        let mut loaded = 0;
        if let Some(kv) = &shared.kv {
            let mut keys = block_keys(&tokens, shared.config.block_size);
            // Only full blocks go to the pool, as real engines do.
            keys.truncate(tokens.len() / shared.config.block_size.get() as usize);
            (loaded, to_write) = load_from_pool(&shared, kv, req.kv_role, &keys).await;
        }
        let plan = shared.core.lock().prefill_with(&tokens, loaded);
        tokio::time::sleep(scaled(&shared, plan.seconds)).await;
        if let Some(kv) = &shared.kv {
            store_in_pool(&shared, kv, &to_write).await;
        }
        plan
    };
    shared.metrics.prompt_tokens.inc_by(plan.prompt_tokens);
    shared.metrics.cached_tokens.inc_by(plan.cached_tokens);
    let mut seat = DecodeSeat::join(&shared, plan.prompt_tokens);
    for i in 0..req.max_tokens {
        let batch = shared.decoding.load(Ordering::SeqCst);
        let ctx = shared.decode_tokens.load(Ordering::SeqCst);
        let step = shared.config.decode_cost.step_seconds(batch, ctx);
        tokio::time::sleep(scaled(&shared, step)).await;
        seat.grow();
        shared.metrics.generated_tokens.inc();
        if out.send(format!("tok{i} ")).await.is_err() {
            return None;
        }
    }
    Some(plan.prompt_tokens)
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

async fn handle(shared: Arc<Shared>, endpoint: Endpoint, body: Bytes) -> Response {
    let req = match api::parse_request(endpoint, &body, &shared.config.model) {
        Ok(r) => r,
        Err(e) => return error_response(&shared, &e),
    };
    shared.metrics.requests.with_label_values(&["ok"]).inc();
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
    let max_tokens = req.max_tokens;
    let stream = req.stream;
    let kv_role = req.kv_role;
    let block_size = u64::from(shared.config.block_size.get());
    let (tx, mut rx) = mpsc::channel::<String>(64);
    let task = tokio::spawn(generate(shared, req, tx));
    if !stream {
        let mut text = String::new();
        while let Some(piece) = rx.recv().await {
            text.push_str(&piece);
        }
        return match task.await {
            Ok(Some(prompt)) => {
                let mut body = api::response_body(&meta, &text, prompt, u64::from(max_tokens));
                if let (KvRole::Prefill, Some(obj)) = (kv_role, body.as_object_mut()) {
                    obj.insert(
                        "kv_transfer_params".into(),
                        api::prefill_kv_params(prompt / block_size),
                    );
                }
                Json(body).into_response()
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
    Sse::new(events).into_response()
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

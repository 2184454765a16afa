//! HTTP server of the synthetic engine (axum): `/v1/completions`, `/v1/chat/completions`
//! (JSON or server-sent events), `/v1/models`. I/O boundary: the TCP listener and the timers
//! that stand in for GPU work.

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

use super::api::{self, ApiError, Endpoint, GenerateRequest, ResponseMeta};
use super::{EngineConfig, EngineCore};
use crate::sched::text_tokens;

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
        };
        registry.register(Box::new(m.requests.clone()))?;
        registry.register(Box::new(m.prompt_tokens.clone()))?;
        registry.register(Box::new(m.cached_tokens.clone()))?;
        registry.register(Box::new(m.generated_tokens.clone()))?;
        Ok(m)
    }
}

struct Shared {
    config: EngineConfig,
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
async fn generate(
    shared: Arc<Shared>,
    req: GenerateRequest,
    out: mpsc::Sender<String>,
) -> Option<u64> {
    let tokens = text_tokens(&req.prompt, shared.config.chunk_bytes);
    let plan = {
        let _lane = shared.prefill_lane.lock().await;
        let plan = shared.core.lock().prefill(&tokens);
        tokio::time::sleep(scaled(&shared, plan.seconds)).await;
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
    let (tx, mut rx) = mpsc::channel::<String>(64);
    let task = tokio::spawn(generate(shared, req, tx));
    if !stream {
        let mut text = String::new();
        while let Some(piece) = rx.recv().await {
            text.push_str(&piece);
        }
        return match task.await {
            Ok(Some(prompt)) => Json(api::response_body(
                &meta,
                &text,
                prompt,
                u64::from(max_tokens),
            ))
            .into_response(),
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

/// Router of the engine API.
pub fn router(config: EngineConfig, registry: &Registry) -> Result<Router, ServerError> {
    let metrics = Metrics::register(registry).map_err(ServerError::Metrics)?;
    let shared = Arc::new(Shared {
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

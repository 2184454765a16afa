//! The engine's HTTP endpoints: the router (`/v1/completions`, `/v1/chat/completions`,
//! `/v1/models`, the prefetch endpoint, and SGLang's `/health` and information endpoints from
//! `info`), the completion endpoint that answers JSON or
//! server-sent events once the prompt's KV is in place. I/O boundary: the spawned request
//! tasks (the router is served by `kvpool_runtime::http::serve`, re-exported as
//! `server::serve`).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{Method, StatusCode, Uri};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use prometheus::Registry;
use tokio::sync::{mpsc, oneshot};

use super::error_bodies::{api_error, handoff_failed, method_not_allowed, route_not_found};
use super::generate::generate;
use super::info;
use super::metrics::Metrics;
use super::prefetch::prefetch;
use super::report::with_report_headers;
use super::sglang::{effective_role, missing_bootstrap, output_tokens};
use super::shared::Shared;
use crate::agent::AgentKv;
use crate::{EngineConfig, EngineCore};
use kvpool_proto::openai::{self as api, Endpoint, KvRole};
use kvpool_proto::openai_bodies::{self as bodies, ResponseMeta};

/// Errors of the engine server.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum ServerError {
    #[error("cannot register engine metrics")]
    Metrics(#[source] prometheus::Error),
    #[error("engine server failed")]
    Serve(#[source] std::io::Error),
    #[error("KV event publisher")]
    KvEvents(#[source] kvpool_runtime::kv_events::KvEventsError),
}

kvpool_runtime::error_category!(ServerError);

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn handle(shared: Arc<Shared>, endpoint: Endpoint, body: Bytes) -> Response {
    let req = match api::parse_request(endpoint, &body, &|m| m == shared.config.model) {
        Ok(r) => r,
        Err(e) => return api_error(&shared, &e),
    };
    if let Some(e) = missing_bootstrap(&shared.config, &req) {
        return api_error(&shared, &e);
    }
    let meta = ResponseMeta {
        id: bodies::response_id(endpoint),
        created: unix_now(),
        model: req.model.clone(),
        endpoint,
    };
    let stream = req.stream;
    let include_usage = req.include_usage;
    let choices = req.choices();
    let role = effective_role(&shared.config, &req);
    let max_tokens = output_tokens(&shared.config, role, &req);
    let block_size = u64::from(shared.config.block_size.get());
    let (tx, mut rx) = mpsc::channel::<String>(64);
    let (ready_tx, ready_rx) = oneshot::channel();
    let task = tokio::spawn(generate(shared.clone(), req, ready_tx, tx));
    // Headers go out once the prompt's KV is in place, so that a failed hand-off is a clean
    // HTTP error and the time to the headers is the time to the first token's readiness.
    let report = match ready_rx.await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            shared.metrics.request("kv_handoff");
            return handoff_failed(&e);
        }
        Err(_) => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    };
    shared.metrics.request("ok");
    let prompt = report.prompt_tokens;
    if !stream {
        let mut text = String::new();
        while let Some(piece) = rx.recv().await {
            text.push_str(&piece);
        }
        return match task.await {
            Ok(Some(())) => {
                let completion = choices * u64::from(max_tokens);
                let mut body = bodies::response_body(&meta, &text, choices, prompt, completion);
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
    // Each piece goes out once per choice (index 0 to choices - 1); with `include_usage`
    // every chunk has `"usage": null` and a last chunk without choices carries the usage.
    let pieces = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
    let usage_meta = meta.clone();
    let events = pieces
        .enumerate()
        .flat_map(move |(i, piece)| {
            let (first, last) = (i == 0, i + 1 == max_tokens as usize);
            let chunks: Vec<_> = (0..choices)
                .map(|c| {
                    let mut chunk = bodies::chunk_body(&meta, c, &piece, first, last);
                    if let (true, Some(obj)) = (include_usage, chunk.as_object_mut()) {
                        obj.insert("usage".into(), serde_json::Value::Null);
                    }
                    Ok::<_, Infallible>(Event::default().data(chunk.to_string()))
                })
                .collect();
            futures::stream::iter(chunks)
        })
        .chain(futures::stream::iter(include_usage.then(|| {
            let completion = choices * u64::from(max_tokens);
            let chunk = bodies::usage_chunk(&usage_meta, prompt, completion);
            Ok(Event::default().data(chunk.to_string()))
        })))
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
    Ok(engine(config, kv, registry)?.0)
}

/// The engine API's router and the state its handlers share.
pub(super) fn engine(
    config: EngineConfig,
    kv: Option<AgentKv>,
    registry: &Registry,
) -> Result<(Router, Arc<Shared>), ServerError> {
    let metrics = Metrics::register(registry).map_err(ServerError::Metrics)?;
    let shared = Arc::new(Shared {
        kv,
        core: parking_lot::Mutex::new(EngineCore::new(config.clone())),
        config,
        prefill_lane: tokio::sync::Mutex::new(()),
        decoding: AtomicU64::new(0),
        decode_tokens: AtomicU64::new(0),
        metrics,
    });
    let created = unix_now();
    let router = Router::new()
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
                Json(bodies::models_body(
                    std::slice::from_ref(&s.config.model),
                    created,
                ))
            }),
        )
        .route(
            kvpool_proto::prefetch::PREFETCH_PATH,
            post(
                |State(s): State<Arc<Shared>>, body: Bytes| async move { prefetch(s, body).await },
            ),
        );
    let router = info::routes(router)
        .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
            method_not_allowed(&method, &uri)
        })
        .fallback(|method: Method, uri: Uri| async move { route_not_found(&method, &uri) });
    Ok((router.with_state(shared.clone()), shared))
}

//! The conductor's HTTP front, the OpenAI-facing layer: the router with `/v1/completions`,
//! `/v1/chat/completions`, `/v1/models` and `/v1/models/{id}` (and kvpool's own
//! `/v1/kvpool/status` and `/v1/kvpool/load`, and `/health`), the API-key check in front of them
//! (`access`), OpenAI-style JSON errors for any other route (404) or method (405),
//! and the assembly of one conductor ([`conductor`]:
//! its metrics, engine set and shared state). I/O boundary: none until the router is served
//! (`kvpool_runtime::http::serve`, re-exported as `server::serve`).

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Request, State as AxumState};
use axum::http::{Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Json};
use axum::routing::{MethodRouter, get, post};
use prometheus::Registry;

use super::access::{self, Forward};
use super::engine_load::EngineLoad;
use super::engine_set::EngineSet;
use super::error_bodies::{
    api_error, body_rejected, is_json, method_not_allowed, not_json, route_not_found,
};
use super::handle::handle;
use super::members::Members;
use super::metrics::Metrics;
use super::prefetch::MAX_PREFETCHES_IN_FLIGHT;
use super::shared::Shared;
use super::upstream::Upstream;
use crate::config::ConductorConfig;
use crate::fetch_estimate::FetchEstimate;
use crate::prefill_costs::PrefillCosts;
use crate::state::{State, StateError};
use kvpool_core::sched::FitConfig;
use kvpool_proto::openai::{ApiError, Endpoint};
use kvpool_proto::openai_bodies as bodies;

/// Errors of the conductor server.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum ServerError {
    #[error("cannot register conductor metrics")]
    Metrics(#[source] prometheus::Error),
    #[error("cannot build the conductor state")]
    State(#[source] StateError),
    #[error("conductor server failed")]
    Serve(#[source] std::io::Error),
}

kvpool_runtime::error_category!(ServerError);

/// A conductor ready to serve: its API router and the handle that changes its engines.
#[derive(Debug)]
pub struct Conductor {
    pub router: Router,
    pub engines: EngineSet,
}

/// `GET /v1/kvpool/status`: the engines served, each prefill engine's cost model in use
/// (docs/scheduling.md, "Fitted prefill cost") and each decode engine's booked requests and
/// the output tokens they still expect.
fn status(shared: &Shared) -> serde_json::Value {
    let m = shared.members.lock();
    let loads = m
        .state
        .as_ref()
        .map(crate::state::State::decode_remaining)
        .unwrap_or_default();
    let decode_load: Vec<serde_json::Value> = m
        .engines
        .decode
        .iter()
        .zip(loads)
        .map(|(e, (requests, remaining))| {
            serde_json::json!({"engine": e, "requests": requests, "remaining_tokens": remaining})
        })
        .collect();
    serde_json::json!({
        "engines": {"prefill": m.engines.prefill, "decode": m.engines.decode},
        "decode_load": decode_load,
        "kv_bytes_per_token": shared.config.scheduler.bytes_per_token,
        "engine_models": shared.models.by_engine(),
        "fit_prefill_cost": m.costs.fitting(),
        "prefill_costs": m.costs.status(&m.engines.prefill),
        "decode_cost": m.decode_fit.status(),
        "handoff_cost": m.handoff_fit.status(),
    })
}

/// Router of the conductor API, serving the engines of `config` for good.
pub fn router(config: ConductorConfig, registry: &Registry) -> Result<Router, ServerError> {
    Ok(conductor(config, registry)?.router)
}

/// The conductor API and its engine set, starting with the engines of `config` (possibly none).
pub fn conductor(config: ConductorConfig, registry: &Registry) -> Result<Conductor, ServerError> {
    let metrics = Metrics::register(&config, registry).map_err(ServerError::Metrics)?;
    let initial = config.engines();
    metrics.set_engines(&initial);
    let state = if initial.is_complete() {
        Some(State::new(&config).map_err(ServerError::State)?)
    } else {
        None
    };
    let config_models = config.models.clone();
    let costs = PrefillCosts::new(
        config
            .scheduler
            .prefill_costs
            .first()
            .copied()
            .unwrap_or_default(),
        config.fit_prefill_cost.then(FitConfig::default),
    );
    metrics.set_prefill_costs(&costs, &initial.prefill);
    let decode_fit = crate::decode_cost::DecodeFit::new(config.scheduler.decode_cost);
    metrics.set_decode_cost(&decode_fit);
    let handoff_fit = crate::handoff_fit::HandoffFit::new(config.scheduler.handoff);
    metrics.set_handoff_cost(&handoff_fit);
    let fetch = FetchEstimate::new(config.block_bytes(), config.scheduler.pool_bandwidth_bps);
    metrics
        .fetch_bandwidth
        .set(config.scheduler.pool_bandwidth_bps);
    let upstream = Upstream::new(config.upstream, config.access.engine_api_key.as_deref());
    // `created` of the models listed: when this conductor started serving them.
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let shared = Arc::new(Shared {
        fetch: parking_lot::Mutex::new(fetch),
        config,
        members: parking_lot::Mutex::new(Members {
            engines: initial,
            state,
            epoch: 0,
            holdings: Default::default(),
            costs,
            decode_fit,
            handoff_fit,
        }),
        upstream,
        started: Instant::now(),
        metrics,
        prefetch_slots: Arc::new(tokio::sync::Semaphore::new(MAX_PREFETCHES_IN_FLIGHT)),
        no_prefetch: Default::default(),
        pool_backoff_until: parking_lot::Mutex::new(None),
        feeds: Default::default(),
        models: super::models::ServedModels::new(config_models),
        load: Default::default(),
        bootstraps: Default::default(),
    });
    let load = EngineLoad::new(Arc::downgrade(&shared)).map_err(ServerError::Metrics)?;
    registry
        .register(Box::new(load))
        .map_err(ServerError::Metrics)?;
    let router = Router::new()
        .route(
            "/v1/completions",
            completion_route(Endpoint::Completions, "/v1/completions"),
        )
        .route(
            "/v1/chat/completions",
            completion_route(Endpoint::ChatCompletions, "/v1/chat/completions"),
        )
        .route(
            "/v1/models",
            get(move |AxumState(s): AxumState<Arc<Shared>>| async move {
                super::models::refresh(&s.models, &s.upstream, s.engine_urls()).await;
                Json(bodies::models_body(&s.models.names(), created))
            }),
        )
        // Model ids may hold slashes (`org/name`), as the OpenAI client sends them.
        .route(
            "/v1/models/{*id}",
            get(
                move |AxumState(s): AxumState<Arc<Shared>>, Path(id): Path<String>| async move {
                    super::models::refresh(&s.models, &s.upstream, s.engine_urls()).await;
                    if s.models.serves(&id) {
                        Json(bodies::model_body(&id, created)).into_response()
                    } else {
                        api_error(&s, &ApiError::UnknownModel(id))
                    }
                },
            ),
        )
        // Load balancers' check: 200 while the conductor can serve (it has a prefill and a
        // decode engine), 503 otherwise.
        .route(
            "/health",
            get(|AxumState(s): AxumState<Arc<Shared>>| async move {
                if s.members.lock().state.is_some() {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                }
            }),
        )
        .route(
            "/v1/kvpool/status",
            get(|AxumState(s): AxumState<Arc<Shared>>| async move { Json(status(&s)) }),
        )
        .route(
            "/v1/kvpool/load",
            get(|AxumState(s): AxumState<Arc<Shared>>| async move {
                Json(s.load_report())
            }),
        )
        .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
            method_not_allowed(&method, &uri)
        })
        .fallback(|method: Method, uri: Uri| async move { route_not_found(&method, &uri) })
        .layer(axum::middleware::from_fn_with_state(shared.clone(), require_key))
        .with_state(shared.clone());
    Ok(Conductor {
        router,
        engines: EngineSet(shared),
    })
}

/// Paths served without an API key: the health check, and the load the operator autoscales by.
const OPEN_PATHS: [&str; 2] = ["/health", "/v1/kvpool/load"];

/// With `--api-key-file`, every other path needs one of its keys (401 in OpenAI's shape).
async fn require_key(
    AxumState(s): AxumState<Arc<Shared>>,
    req: Request,
    next: Next,
) -> axum::response::Response {
    if let Some(keys) = &s.config.access.api_keys
        && !OPEN_PATHS.contains(&req.uri().path())
        && !keys.admits(req.headers())
    {
        s.metrics.request("unauthorized");
        return access::unauthorized(req.headers());
    }
    next.run(req).await
}

/// The POST route of a completion endpoint at `path`: the body goes to [`handle`], or an
/// unreadable one is answered with its rejection; the response carries the request id.
fn completion_route(endpoint: Endpoint, path: &'static str) -> MethodRouter<Arc<Shared>> {
    post(
        move |AxumState(s): AxumState<Arc<Shared>>,
              headers: axum::http::HeaderMap,
              body: Result<Bytes, BytesRejection>| async move {
            let forward = Forward::from_client(&headers, &s.config.access);
            if let Some(ct) = headers.get(axum::http::header::CONTENT_TYPE) {
                let ct = String::from_utf8_lossy(ct.as_bytes());
                if !is_json(&ct) {
                    return forward.tag(not_json(&s, &ct));
                }
            }
            let resp = match body {
                Ok(body) => handle(s, endpoint, path, body, &forward).await,
                Err(e) => body_rejected(&s, &e),
            };
            forward.tag(resp)
        },
    )
}

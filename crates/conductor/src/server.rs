//! HTTP side of the conductor: OpenAI-compatible endpoints, the placement decision, and the
//! two upstream calls. Prefill gets the request with `max_tokens: 1`, `stream: false` and
//! `kv_transfer_params: {"do_remote_decode": true}`; decode gets the original request plus the
//! `kv_transfer_params` that prefill returned (vLLM's disaggregated proxy convention), and its
//! response, streamed or not, goes back to the client unchanged. The engine set can change
//! while serving ([`EngineSet`]); without a prefill and a decode engine, completions answer 503.
//! I/O boundary: the listener, the HTTP client, the monotonic clock.

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State as AxumState;
use axum::http::{HeaderValue, Request, StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use prometheus::{
    Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::tokenize::TokenizeError;
use super::{
    ConductorConfig, Engines, FetchEstimate, PoolLookup, ReplicationTask, RoutingProtocol, State,
    StateError, Ticket,
};
use kvpool_core::sched::{BlockKey, RejectReason, block_keys, pool_key};
use kvpool_proto::openai::{self as api, ApiError, Endpoint};
use kvpool_proto::openai::{KV_LOAD_BLOCKS_HEADER, KV_LOAD_SECONDS_HEADER};
use kvpool_runtime::admin::Readiness;

/// Response header: prompt blocks the chosen prefill engine was expected to hold locally.
pub const LOCAL_BLOCKS_HEADER: &str = "x-kvpool-local-blocks";
/// Response header: prompt blocks it was expected to fetch from the pool.
pub const POOL_BLOCKS_HEADER: &str = "x-kvpool-pool-blocks";
/// Response header: the estimated time to first token of the placement, milliseconds.
pub const TTFT_HEADER: &str = "x-kvpool-ttft-estimate-ms";

/// Prefetch requests (hot-prefix copies) in flight at most; more tasks are dropped and counted.
pub const MAX_PREFETCHES_IN_FLIGHT: usize = 8;
/// After a pool lookup fails or times out, requests skip the lookup this long, so a master that
/// is down or hanging costs at most one timeout per interval rather than one per request.
pub const POOL_LOOKUP_BACKOFF: std::time::Duration = std::time::Duration::from_secs(2);
/// Longest wait for an engine to finish one prefetch.
const PREFETCH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Largest upstream prefill response read, bytes.
const MAX_PREFILL_RESPONSE: usize = 1 << 20;

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

impl ServerError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// A failed upstream call.
#[derive(Debug, thiserror::Error)]
enum UpstreamError {
    #[error("cannot build the request to {url}")]
    Build {
        url: String,
        #[source]
        source: axum::http::Error,
    },
    #[error("cannot reach {url}")]
    Connect {
        url: String,
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    #[error("cannot read the response of {url}")]
    Read {
        url: String,
        #[source]
        source: axum::Error,
    },
    #[error("{0}")]
    Mismatch(String),
}

/// The engines served now and the bookkeeping over them. `epoch` counts engine-set changes, so
/// a request placed before a change finds its instances again by URL.
struct Members {
    engines: Engines,
    /// `None` until there is at least one prefill and one decode engine.
    state: Option<State>,
    epoch: u64,
}

/// A request placed on instances, with what is needed to find them after an engine-set change.
#[derive(Clone, Debug)]
struct Placed {
    ticket: Ticket,
    epoch: u64,
    prefill_url: String,
    decode_url: String,
    /// How the pair is routed, or why it cannot be (engines of different conventions).
    protocol: Result<RoutingProtocol, String>,
}

impl Members {
    /// Run `f` on the state with `placed`'s ticket as the current engine set numbers it; an
    /// instance that left meanwhile gets an index nothing has (its part is skipped).
    fn with_ticket(&mut self, placed: &Placed, f: impl FnOnce(&mut State, &Ticket)) {
        let Some(state) = self.state.as_mut() else {
            return;
        };
        let ticket = if placed.epoch == self.epoch {
            placed.ticket
        } else {
            let find = |urls: &[String], url: &str| {
                urls.iter().position(|u| u == url).unwrap_or(usize::MAX)
            };
            Ticket {
                prefill: find(&self.engines.prefill, &placed.prefill_url),
                decode: find(&self.engines.decode, &placed.decode_url),
                ..placed.ticket
            }
        };
        f(state, &ticket);
    }
}

struct Shared {
    config: ConductorConfig,
    members: parking_lot::Mutex<Members>,
    client: Client<HttpConnector, Body>,
    started: Instant,
    requests: IntCounterVec,
    rejections: IntCounterVec,
    replication_tasks: IntCounter,
    replication_blocks: IntCounterVec,
    engines: IntGaugeVec,
    pool_lookups: IntCounterVec,
    prefetches: IntCounterVec,
    /// Bounds the prefetch requests in flight; a task finding none free is dropped.
    prefetch_slots: Arc<tokio::sync::Semaphore>,
    /// After a failed or slow pool lookup, no lookups until then (requests go local-only).
    pool_backoff_until: parking_lot::Mutex<Option<Instant>>,
    /// Prefill engines that answered a prefetch with 404: not asked again.
    no_prefetch: parking_lot::Mutex<std::collections::HashSet<String>>,
    /// The pool fetch term, learnt from the prefill engines' measured reads.
    fetch: parking_lot::Mutex<FetchEstimate>,
    fetch_bandwidth: Gauge,
    pool_lookup_seconds: Histogram,
}

impl Shared {
    /// Cost-model seconds since start: wall time divided by the engines' time scale.
    fn now_s(&self) -> f64 {
        self.started.elapsed().as_secs_f64() / self.config.time_scale
    }

    /// Bytes of one KV block as the scheduler counts them.
    fn block_bytes(&self) -> u64 {
        let s = &self.config.scheduler;
        s.bytes_per_token
            .saturating_mul(u64::from(s.block_size.get()))
    }

    async fn post(&self, url: String, body: &Value) -> Result<Response<Body>, UpstreamError> {
        let req = Request::post(&url)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string()))
            .map_err(|source| UpstreamError::Build {
                url: url.clone(),
                source,
            })?;
        let resp = self
            .client
            .request(req)
            .await
            .map_err(|source| UpstreamError::Connect { url, source })?;
        Ok(resp.map(Body::new))
    }
}

/// Leaves the decode bookkeeping when the response body is done or dropped.
struct Finish {
    shared: Arc<Shared>,
    placed: Placed,
}

impl Drop for Finish {
    fn drop(&mut self) {
        self.shared
            .members
            .lock()
            .with_ticket(&self.placed, |s, t| s.finished(t));
    }
}

/// The engine set of a running conductor: replace it at any time (engine discovery does).
#[derive(Clone)]
pub struct EngineSet(Arc<Shared>);

impl std::fmt::Debug for EngineSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("EngineSet").field(&self.current()).finish()
    }
}

impl EngineSet {
    /// The engines served now.
    pub fn current(&self) -> Engines {
        self.0.members.lock().engines.clone()
    }

    /// Serve `next` from now on. Engines that stay keep their cache mirror and load; new ones
    /// start empty; those that left drop out of the prefix index and the load tables. Returns
    /// whether the conductor can serve (at least one prefill and one decode engine). A set
    /// larger than the scheduler supports is refused (logged) and the previous one kept.
    pub fn set(&self, next: Engines) -> bool {
        let shared = &self.0;
        let mut m = shared.members.lock();
        let ordered = m.engines.stable_order(&next);
        if ordered == m.engines {
            return m.state.is_some();
        }
        let from = |old: &[String], new: &[String]| -> Vec<Option<usize>> {
            new.iter()
                .map(|u| old.iter().position(|o| o == u))
                .collect()
        };
        let state = if ordered.is_complete() {
            let config = shared.config.with_engines(&ordered);
            let built = match m.state.take() {
                Some(old) => old.regrouped(
                    &config,
                    &from(&m.engines.prefill, &ordered.prefill),
                    &from(&m.engines.decode, &ordered.decode),
                ),
                None => State::new(&config),
            };
            match built {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::error!(error = %e, source = ?std::error::Error::source(&e),
                        prefill = ordered.prefill.len(), decode = ordered.decode.len(),
                        "engine set refused; keeping the previous one");
                    // `take` emptied it; rebuild the previous set's state from scratch.
                    m.state = State::new(&shared.config.with_engines(&m.engines)).ok();
                    return m.state.is_some();
                }
            }
        } else {
            None
        };
        tracing::info!(prefill = ?ordered.prefill, decode = ?ordered.decode, "engine set changed");
        shared
            .engines
            .with_label_values(&["prefill"])
            .set(ordered.prefill.len() as i64);
        shared
            .engines
            .with_label_values(&["decode"])
            .set(ordered.decode.len() as i64);
        m.engines = ordered;
        m.state = state;
        m.epoch += 1;
        m.state.is_some()
    }

    /// Apply every engine set `updates` carries (the latest one wins) until its sender is
    /// dropped or `shutdown` fires; `readiness` follows whether the conductor can serve.
    pub async fn follow(
        self,
        mut updates: watch::Receiver<Engines>,
        readiness: Readiness,
        shutdown: CancellationToken,
    ) {
        loop {
            let next = updates.borrow_and_update().clone();
            readiness.set_ready(self.set(next));
            tokio::select! {
                changed = updates.changed() => if changed.is_err() { break },
                () = shutdown.cancelled() => break,
            }
        }
    }
}

fn error_body(message: String, kind: &str, code: &str) -> Value {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}

fn api_error(shared: &Shared, err: &ApiError) -> Response {
    shared.requests.with_label_values(&[err.category()]).inc();
    let status = StatusCode::from_u16(err.status()).unwrap_or(StatusCode::BAD_REQUEST);
    (status, Json(err.body())).into_response()
}

fn rejected(shared: &Shared, reason: RejectReason) -> Response {
    shared.requests.with_label_values(&["rejected"]).inc();
    shared
        .rejections
        .with_label_values(&[reason.category()])
        .inc();
    let slo = shared.config.scheduler.slo;
    let (message, retry_s) = match reason {
        RejectReason::Ttft { estimate_s } => (
            format!(
                "estimated time to first token {estimate_s:.1} s exceeds the {:.1} s objective",
                slo.ttft_s
            ),
            (estimate_s - slo.ttft_s).ceil().max(1.0),
        ),
        RejectReason::Tpot { estimate_s } => (
            format!(
                "estimated time per output token {estimate_s:.3} s exceeds the {:.3} s objective",
                slo.tpot_s
            ),
            1.0,
        ),
        RejectReason::DecodeMemory => ("decode instances have no KV memory left".into(), 1.0),
        RejectReason::NoInstance => ("no serving instance available".into(), 5.0),
    };
    let mut resp = (
        StatusCode::TOO_MANY_REQUESTS,
        Json(error_body(
            format!("request rejected: {message}"),
            "rate_limit_exceeded",
            reason.category(),
        )),
    )
        .into_response();
    if let Ok(v) = HeaderValue::from_str(&format!("{}", retry_s.min(3600.0) as u64)) {
        resp.headers_mut().insert(header::RETRY_AFTER, v);
    }
    resp
}

/// Answers 502; the caller drops its `Finish`, which releases the request's bookings.
fn upstream_failed(shared: &Shared, err: &UpstreamError) -> Response {
    shared.requests.with_label_values(&["upstream"]).inc();
    tracing::warn!(error = %err, source = ?std::error::Error::source(err), "upstream call failed");
    (
        StatusCode::BAD_GATEWAY,
        Json(error_body(err.to_string(), "upstream_error", "upstream")),
    )
        .into_response()
}

/// Counts, logs and executes a replication task: each target engine is asked to prefetch the
/// blocks from the pool ([`prefetch`]). `prefill` is the engine set the task's target indices
/// refer to.
fn replicate(shared: &Arc<Shared>, task: &ReplicationTask, prefill: &[String]) {
    shared.replication_tasks.inc();
    let targets: Vec<&String> = task
        .targets
        .iter()
        .filter_map(|&t| prefill.get(t))
        .collect();
    for url in &targets {
        shared
            .replication_blocks
            .with_label_values(&[url.as_str()])
            .inc_by(task.keys.len() as u64);
    }
    tracing::info!(
        blocks = task.keys.len(),
        first_key = task.keys.first().copied().unwrap_or(0),
        last_key = task.keys.last().copied().unwrap_or(0),
        ?targets,
        "hot prefix: asking engines to prefetch it from the pool"
    );
    for url in targets {
        prefetch(shared, url.clone(), task.keys.clone());
    }
}

/// Fire and forget: asks prefill engine `url` to load `keys` from the pool, within the bound on
/// prefetches in flight. When it reports N leading blocks loaded, the cache mirror of that
/// engine (found again by URL) gets them. A 404 means the engine cannot prefetch: it is not
/// asked again. Every attempt is counted by outcome.
fn prefetch(shared: &Arc<Shared>, url: String, keys: Vec<BlockKey>) {
    let count = |outcome: &str| shared.prefetches.with_label_values(&[outcome]).inc();
    if shared.no_prefetch.lock().contains(&url) {
        count("skipped_unsupported");
        return;
    }
    let Ok(permit) = shared.prefetch_slots.clone().try_acquire_owned() else {
        count("busy");
        return;
    };
    let shared = shared.clone();
    tokio::spawn(async move {
        let _permit = permit;
        let target = format!("{}{}", url.trim_end_matches('/'), api::PREFETCH_PATH);
        let body = api::prefetch_body(&keys);
        let outcome = match tokio::time::timeout(PREFETCH_TIMEOUT, async {
            let resp = shared.post(target.clone(), &body).await?;
            let status = resp.status();
            let bytes = axum::body::to_bytes(resp.into_body(), MAX_PREFILL_RESPONSE)
                .await
                .map_err(|source| UpstreamError::Read {
                    url: target.clone(),
                    source,
                })?;
            Ok::<_, UpstreamError>((status, bytes))
        })
        .await
        {
            Err(_) => {
                tracing::warn!(%url, "prefetch timed out");
                "timeout"
            }
            Ok(Err(e)) => {
                tracing::warn!(%url, error = %e, source = ?std::error::Error::source(&e),
                    "prefetch failed");
                "error"
            }
            Ok(Ok((StatusCode::NOT_FOUND, _))) => {
                tracing::info!(%url, "engine does not support prefetch; not asking it again");
                shared.no_prefetch.lock().insert(url.clone());
                "unsupported"
            }
            Ok(Ok((status, bytes))) if status.is_success() => {
                let loaded = serde_json::from_slice::<Value>(&bytes)
                    .ok()
                    .and_then(|v| v.get("loaded").and_then(Value::as_u64))
                    .map(|n| usize::try_from(n).unwrap_or(usize::MAX).min(keys.len()));
                match loaded {
                    Some(n) => {
                        let mut m = shared.members.lock();
                        let Members { engines, state, .. } = &mut *m;
                        if let (Some(i), Some(state)) = (
                            engines.prefill.iter().position(|u| *u == url),
                            state.as_mut(),
                        ) {
                            state.adopted(i, keys.get(..n).unwrap_or(&keys));
                        }
                        "ok"
                    }
                    None => {
                        tracing::warn!(%url, "prefetch answer lacks a numeric `loaded`");
                        "error"
                    }
                }
            }
            Ok(Ok((status, _))) => {
                tracing::warn!(%url, %status, "prefetch refused");
                "error"
            }
        };
        shared.prefetches.with_label_values(&[outcome]).inc();
    });
}

/// How many leading blocks of `keys` the pool holds, by one `longest_prefix` call to the
/// master under `pool.timeout`. A failed or slow call is counted and answers 0: the request is
/// then placed on the engines' local caches alone, and so are those of the next
/// [`POOL_LOOKUP_BACKOFF`] (counted as `backoff`).
async fn pool_prefix(shared: &Shared, pool: &PoolLookup, keys: &[BlockKey]) -> usize {
    if keys.is_empty() {
        return 0;
    }
    if shared
        .pool_backoff_until
        .lock()
        .is_some_and(|until| Instant::now() < until)
    {
        shared.pool_lookups.with_label_values(&["backoff"]).inc();
        return 0;
    }
    let names: Vec<Vec<u8>> = keys
        .iter()
        .map(|&k| pool_key(&shared.config.model, k))
        .collect();
    let refs: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
    let timer = shared.pool_lookup_seconds.start_timer();
    let answer = tokio::time::timeout(pool.timeout, pool.client.longest_prefix(&refs)).await;
    timer.observe_duration();
    let (outcome, blocks) = match answer {
        Ok(Ok(0)) => ("miss", 0),
        Ok(Ok(n)) => ("hit", n.min(keys.len())),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, source = ?std::error::Error::source(&e),
                    "pool lookup failed; placing on local caches only");
            ("error", 0)
        }
        Err(_) => {
            tracing::warn!(timeout = ?pool.timeout,
                    "pool lookup timed out; placing on local caches only");
            ("timeout", 0)
        }
    };
    if matches!(outcome, "error" | "timeout") {
        *shared.pool_backoff_until.lock() = Some(Instant::now() + POOL_LOOKUP_BACKOFF);
    }
    shared.pool_lookups.with_label_values(&[outcome]).inc();
    blocks
}

async fn handle(shared: Arc<Shared>, endpoint: Endpoint, path: &str, body: Bytes) -> Response {
    // Without engines nothing can be served, whatever the request says.
    if shared.members.lock().state.is_none() {
        return no_engines(&shared.requests);
    }
    let req = match api::parse_request(endpoint, &body, &shared.config.model) {
        Ok(r) => r,
        Err(e) => return api_error(&shared, &e),
    };
    // parse_request accepted it, so it is a JSON object.
    let original: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let tokens = match shared
        .config
        .tokenizer
        .tokens_off_runtime(req.prompt.clone())
        .await
    {
        Ok(t) => t,
        Err(e) => {
            shared.requests.with_label_values(&["tokenizer"]).inc();
            tracing::warn!(error = %e, source = ?std::error::Error::source(&e), "tokenising failed");
            // A prompt the tokenizer refuses is the client's; a failed task is ours.
            let (status, kind) = match e {
                TokenizeError::Task(_) => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
                _ => (StatusCode::BAD_REQUEST, "invalid_request_error"),
            };
            return (status, Json(error_body(format!("{e}"), kind, "prompt"))).into_response();
        }
    };
    let keys = block_keys(&tokens, shared.config.scheduler.block_size);
    let in_pool = match &shared.config.pool {
        Some(pool) => pool_prefix(&shared, pool, &keys).await,
        None => 0,
    };
    let placed = {
        let mut members = shared.members.lock();
        let epoch = members.epoch;
        let Members { engines, state, .. } = &mut *members;
        let Some(state) = state.as_mut() else {
            drop(members);
            return no_engines(&shared.requests);
        };
        let now = shared.now_s();
        state.set_pool_bandwidth(shared.fetch.lock().bandwidth_bps(shared.block_bytes()));
        let placed =
            state.place_with_pool(now, &keys, in_pool, tokens.len() as u64, req.max_tokens);
        if let Some(task) = state.take_replication() {
            replicate(&shared, &task, &engines.prefill);
        }
        match placed {
            Ok(ticket) => match (
                engines.prefill.get(ticket.prefill),
                engines.decode.get(ticket.decode),
            ) {
                (Some(p), Some(d)) => Placed {
                    ticket,
                    epoch,
                    prefill_url: p.clone(),
                    decode_url: d.clone(),
                    protocol: engines.pair_protocol(p, d, shared.config.protocol),
                },
                _ => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
            },
            Err(reason) => {
                drop(members);
                return rejected(&shared, reason);
            }
        }
    };
    tracing::debug!(?placed, "placed");
    // Releases the bookings however this request ends: error, client gone, or body done.
    let finish = Finish {
        shared: shared.clone(),
        placed: placed.clone(),
    };
    match placed.protocol.clone() {
        Ok(RoutingProtocol::Vllm) => route_vllm(shared, placed, finish, original, path).await,
        Ok(RoutingProtocol::Sglang { bootstrap_port }) => {
            route_sglang(shared, placed, finish, original, path, bootstrap_port).await
        }
        Err(mismatch) => upstream_failed(&shared, &UpstreamError::Mismatch(mismatch)),
    }
}

/// A prefill engine's answer, read in full: its status, body and the pool read it reports.
struct PrefillAnswer {
    status: StatusCode,
    body: Bytes,
}

/// Reads a prefill engine's response to the end, marks the request prefilled and feeds the
/// measured pool fetch (headers `x-kvpool-kv-load-*`) into the fetch estimate.
async fn prefill_answer(
    shared: &Shared,
    placed: &Placed,
    url: String,
    resp: Response<Body>,
) -> Result<PrefillAnswer, UpstreamError> {
    let status = resp.status();
    let loaded = {
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<f64>().ok())
        };
        (
            header(KV_LOAD_BLOCKS_HEADER),
            header(KV_LOAD_SECONDS_HEADER),
        )
    };
    let body = axum::body::to_bytes(resp.into_body(), MAX_PREFILL_RESPONSE)
        .await
        .map_err(|source| UpstreamError::Read { url, source })?;
    let now = shared.now_s();
    shared
        .members
        .lock()
        .with_ticket(placed, |s, t| s.prefilled(t, now));
    if let (Some(blocks), Some(seconds)) = loaded
        && blocks >= 1.0
    {
        let mut fetch = shared.fetch.lock();
        fetch.observe(blocks as u64, seconds / shared.config.time_scale);
        shared
            .fetch_bandwidth
            .set(fetch.bandwidth_bps(shared.block_bytes()));
    }
    Ok(PrefillAnswer { status, body })
}

/// Sends `body` to the placement's prefill engine and reads its answer; the client's response
/// instead when the engine cannot be reached (502) or answers an error, which goes back as it
/// is (e.g. 400).
async fn call_prefill(
    shared: &Shared,
    placed: &Placed,
    path: &str,
    body: &Value,
) -> Result<PrefillAnswer, Response> {
    let url = format!("{}{path}", placed.prefill_url.trim_end_matches('/'));
    let answer = match shared.post(url.clone(), body).await {
        Ok(r) => prefill_answer(shared, placed, url, r).await,
        Err(e) => Err(e),
    };
    match answer {
        Ok(a) if a.status.is_success() => Ok(a),
        Ok(a) => {
            shared.requests.with_label_values(&["prefill_error"]).inc();
            Err((a.status, a.body).into_response())
        }
        Err(e) => Err(upstream_failed(shared, &e)),
    }
}

/// vLLM's convention: prefill with one token and `kv_transfer_params: {do_remote_decode}`,
/// then decode with the original request plus the `kv_transfer_params` prefill returned.
async fn route_vllm(
    shared: Arc<Shared>,
    placed: Placed,
    finish: Finish,
    original: Value,
    path: &str,
) -> Response {
    // Prefill: one token, no streaming, and ask for the KV cache to be kept for decode.
    let mut prefill_req = original.clone();
    if let Some(obj) = prefill_req.as_object_mut() {
        obj.insert("max_tokens".into(), json!(1));
        obj.remove("max_completion_tokens");
        obj.insert("stream".into(), json!(false));
        obj.remove("stream_options");
        obj.insert(
            "kv_transfer_params".into(),
            json!({"do_remote_decode": true, "do_remote_prefill": false}),
        );
    }
    let answer = match call_prefill(&shared, &placed, path, &prefill_req).await {
        Ok(a) => a,
        // Dropping `finish` with the early return releases the bookings.
        Err(resp) => return resp,
    };
    let kv_params = serde_json::from_slice::<Value>(&answer.body)
        .ok()
        .and_then(|v| v.get("kv_transfer_params").cloned())
        .filter(|v| !v.is_null());

    // Decode: the original request, told where the KV cache is.
    let mut decode_req = original;
    if let (Some(obj), Some(kv)) = (decode_req.as_object_mut(), kv_params) {
        obj.insert("kv_transfer_params".into(), kv);
    }
    let url = format!("{}{path}", placed.decode_url.trim_end_matches('/'));
    match shared.post(url, &decode_req).await {
        Ok(resp) => relay_decode(&shared, &placed, finish, resp),
        Err(e) => upstream_failed(&shared, &e),
    }
}

/// The host part of an `http://host:port` base URL, as SGLang's router puts it in
/// `bootstrap_host` (IPv6 literals keep their brackets).
pub fn url_host(url: &str) -> Option<&str> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let host = if authority.starts_with('[') {
        authority.split_inclusive(']').next()?
    } else {
        authority.split(':').next()?
    };
    (!host.is_empty()).then_some(host)
}

/// SGLang's convention (its router's mini load balancer): the same request, plus
/// `bootstrap_host`/`bootstrap_port` of the prefill engine and a random 63-bit
/// `bootstrap_room`, goes to the prefill and the decode engine at once; the decode engine's
/// response is the client's. The prefill answer is read to the end (its failure fails the
/// request at once instead of leaving decode to time out).
async fn route_sglang(
    shared: Arc<Shared>,
    placed: Placed,
    finish: Finish,
    original: Value,
    path: &str,
    bootstrap_port: u16,
) -> Response {
    let room = rand::random::<u64>() & api::MAX_BOOTSTRAP_ROOM;
    let mut req = original;
    if let Some(obj) = req.as_object_mut() {
        obj.insert(
            "bootstrap_host".into(),
            json!(url_host(&placed.prefill_url).unwrap_or("127.0.0.1")),
        );
        obj.insert("bootstrap_port".into(), json!(bootstrap_port));
        obj.insert("bootstrap_room".into(), json!(room));
    }
    tracing::debug!(room, prefill = %placed.prefill_url, decode = %placed.decode_url,
        "sglang: sending to prefill and decode");
    let decode = {
        let shared = shared.clone();
        let url = format!("{}{path}", placed.decode_url.trim_end_matches('/'));
        let req = req.clone();
        // Aborted on drop, so a failed prefill or a gone client does not leave it running.
        AbortOnDrop(tokio::spawn(async move { shared.post(url, &req).await }))
    };
    // The prefill answer itself is not the client's: only its success matters here.
    if let Err(resp) = call_prefill(&shared, &placed, path, &req).await {
        return resp;
    }
    match decode.join().await {
        Some(Ok(resp)) => relay_decode(&shared, &placed, finish, resp),
        Some(Err(e)) => upstream_failed(&shared, &e),
        None => {
            shared.requests.with_label_values(&["upstream"]).inc();
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}

/// A spawned task aborted when dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> AbortOnDrop<T> {
    /// Its result; `None` when it panicked or was aborted.
    async fn join(mut self) -> Option<T> {
        (&mut self.0).await.ok()
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The decode engine's response goes back to the client as it is (streamed or not), with the
/// placement's assumptions in `x-kvpool-*` headers; the bookings are released when its body
/// ends or is dropped.
fn relay_decode(
    shared: &Shared,
    placed: &Placed,
    finish: Finish,
    resp: Response<Body>,
) -> Response {
    let now = shared.now_s();
    shared
        .members
        .lock()
        .with_ticket(placed, |s, t| s.decoding(t, now));
    // The decode engine's own error (e.g. a failed KV hand-off) is relayed as it is.
    let outcome = if resp.status().is_success() {
        "ok"
    } else {
        "decode_error"
    };
    shared.requests.with_label_values(&[outcome]).inc();
    let (parts, body) = resp.into_parts();
    let stream = body.into_data_stream().map(move |chunk| {
        let _ = &finish;
        chunk
    });
    let mut out = Response::new(Body::from_stream(stream));
    *out.status_mut() = parts.status;
    // The body passes through unchanged, so its length (when known) still holds.
    for name in [
        header::CONTENT_TYPE,
        header::CONTENT_LENGTH,
        header::CACHE_CONTROL,
    ] {
        if let Some(v) = parts.headers.get(&name) {
            out.headers_mut().insert(name, v.clone());
        }
    }
    // What the placement assumed, for clients and tests (docs/engine-contract.md).
    let t = &placed.ticket;
    for (name, value) in [
        (LOCAL_BLOCKS_HEADER, t.local_blocks.to_string()),
        (POOL_BLOCKS_HEADER, t.pool_blocks.to_string()),
        (TTFT_HEADER, format!("{:.3}", t.ttft_s * 1e3)),
    ] {
        if let Ok(v) = HeaderValue::from_str(&value) {
            out.headers_mut().insert(name, v);
        }
    }
    out
}

/// A conductor ready to serve: its API router and the handle that changes its engines.
#[derive(Debug)]
pub struct Conductor {
    pub router: Router,
    pub engines: EngineSet,
}

/// Router of the conductor API, serving the engines of `config` for good.
pub fn router(config: ConductorConfig, registry: &Registry) -> Result<Router, ServerError> {
    Ok(conductor(config, registry)?.router)
}

/// The conductor API and its engine set, starting with the engines of `config` (possibly none).
pub fn conductor(config: ConductorConfig, registry: &Registry) -> Result<Conductor, ServerError> {
    let requests = IntCounterVec::new(
        Opts::new(
            "kvpool_conductor_requests_total",
            "Requests by outcome (ok, rejected, or the error category)",
        ),
        &["outcome"],
    )
    .map_err(ServerError::Metrics)?;
    let rejections = IntCounterVec::new(
        Opts::new(
            "kvpool_conductor_rejections_total",
            "Requests rejected at arrival, by reason",
        ),
        &["reason"],
    )
    .map_err(ServerError::Metrics)?;
    let replication_tasks = IntCounter::new(
        "kvpool_conductor_replication_tasks_total",
        "Hot-prefix replication tasks planned (each sends prefetch requests to its targets)",
    )
    .map_err(ServerError::Metrics)?;
    let replication_blocks = IntCounterVec::new(
        Opts::new(
            "kvpool_conductor_replication_blocks_total",
            "Blocks that hot-prefix replication tasks ask to copy, by target prefill engine URL",
        ),
        &["target"],
    )
    .map_err(ServerError::Metrics)?;
    let pool_lookups = IntCounterVec::new(
        Opts::new(
            "kvpool_conductor_pool_lookups_total",
            "Per-request pool prefix lookups at the master, by outcome (hit, miss, error, \
             timeout, and backoff: skipped after a failure; all but hit and miss place the \
             request on local caches only)",
        ),
        &["outcome"],
    )
    .map_err(ServerError::Metrics)?;
    let prefetches = IntCounterVec::new(
        Opts::new(
            "kvpool_conductor_prefetches_total",
            "Prefetch requests of hot-prefix replication by outcome (ok, unsupported, error, \
             timeout; busy and skipped_unsupported were not sent)",
        ),
        &["outcome"],
    )
    .map_err(ServerError::Metrics)?;
    let engines = IntGaugeVec::new(
        Opts::new(
            "kvpool_conductor_engines",
            "Engine instances the conductor routes to, by role",
        ),
        &["role"],
    )
    .map_err(ServerError::Metrics)?;
    let fetch_bandwidth = Gauge::new(
        "kvpool_conductor_pool_fetch_bandwidth_bytes_per_second",
        "Pool -> prefill bandwidth the TTFT estimate assumes (cost-model seconds): the \
         configured figure until the engines report measured reads, then their moving average",
    )
    .map_err(ServerError::Metrics)?;
    let pool_lookup_seconds = Histogram::with_opts(
        HistogramOpts::new(
            "kvpool_conductor_pool_lookup_seconds",
            "Wall time of the per-request pool prefix lookups at the master",
        )
        .buckets(vec![
            1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
        ]),
    )
    .map_err(ServerError::Metrics)?;
    for c in [
        Box::new(fetch_bandwidth.clone()) as Box<dyn prometheus::core::Collector>,
        Box::new(pool_lookup_seconds.clone()),
        Box::new(requests.clone()),
        Box::new(rejections.clone()),
        Box::new(replication_tasks.clone()),
        Box::new(replication_blocks.clone()),
        Box::new(engines.clone()),
        Box::new(pool_lookups.clone()),
        Box::new(prefetches.clone()),
    ] {
        registry.register(c).map_err(ServerError::Metrics)?;
    }
    // Export the main outcomes at 0 from the start, so rate() and alert rules see the series
    // before the first request instead of an absent one.
    for outcome in ["ok", "rejected"] {
        requests.with_label_values(&[outcome]);
    }
    if config.pool.is_some() {
        for outcome in ["hit", "miss", "error", "timeout", "backoff"] {
            pool_lookups.with_label_values(&[outcome]);
        }
    }
    let initial = config.engines();
    engines
        .with_label_values(&["prefill"])
        .set(initial.prefill.len() as i64);
    engines
        .with_label_values(&["decode"])
        .set(initial.decode.len() as i64);
    let state = if initial.is_complete() {
        Some(State::new(&config).map_err(ServerError::State)?)
    } else {
        None
    };
    let fetch = FetchEstimate::new(
        config
            .scheduler
            .bytes_per_token
            .saturating_mul(u64::from(config.scheduler.block_size.get())),
        config.scheduler.pool_bandwidth_bps,
    );
    fetch_bandwidth.set(config.scheduler.pool_bandwidth_bps);
    let shared = Arc::new(Shared {
        fetch: parking_lot::Mutex::new(fetch),
        fetch_bandwidth,
        pool_lookup_seconds,
        config,
        members: parking_lot::Mutex::new(Members {
            engines: initial,
            state,
            epoch: 0,
        }),
        client: Client::builder(TokioExecutor::new()).build_http(),
        started: Instant::now(),
        requests,
        rejections,
        replication_tasks,
        replication_blocks,
        engines,
        pool_lookups,
        prefetches,
        prefetch_slots: Arc::new(tokio::sync::Semaphore::new(MAX_PREFETCHES_IN_FLIGHT)),
        no_prefetch: Default::default(),
        pool_backoff_until: parking_lot::Mutex::new(None),
    });
    let router = Router::new()
        .route(
            "/v1/completions",
            post(
                |AxumState(s): AxumState<Arc<Shared>>, body: Bytes| async move {
                    handle(s, Endpoint::Completions, "/v1/completions", body).await
                },
            ),
        )
        .route(
            "/v1/chat/completions",
            post(
                |AxumState(s): AxumState<Arc<Shared>>, body: Bytes| async move {
                    handle(s, Endpoint::ChatCompletions, "/v1/chat/completions", body).await
                },
            ),
        )
        .route(
            "/v1/models",
            get(|AxumState(s): AxumState<Arc<Shared>>| async move {
                Json(api::models_body(&s.config.model, 0))
            }),
        )
        .with_state(shared.clone());
    Ok(Conductor {
        router,
        engines: EngineSet(shared),
    })
}

/// The answer while the conductor has no prefill or no decode engine: 503 with an OpenAI-style
/// error saying so (the admin server reports not ready meanwhile).
fn no_engines(requests: &IntCounterVec) -> Response {
    requests.with_label_values(&["no_engines"]).inc();
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(error_body(
            "the conductor has no prefill or decode engines yet (start it with --prefill and \
             --decode, or let it discover engine pods with --discover-namespace)"
                .to_owned(),
            "service_unavailable",
            "no_engines",
        )),
    )
        .into_response()
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

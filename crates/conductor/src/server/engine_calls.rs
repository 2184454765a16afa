//! The two engine calls of every disaggregated request, whichever convention routes it: the
//! prefill call, read to its end (the request is then prefilled, the pool read the engine
//! measured feeds the fetch estimate, and the call's time the fit of the engine's prefill cost), and the decode engine's response, relayed to the client
//! with the placement's assumptions in `x-kvpool-*` headers. I/O boundary: the upstream HTTP
//! calls and the client's response stream.

use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::Value;

use super::access::Forward;
use super::error_bodies::upstream_failed;
use super::latency::FirstToken;
use super::members::Placed;
use super::shared::{Finish, Shared};
use super::upstream::{UpstreamError, engine_url, read_body};
use super::usage_fill::{UsageFill, reported_cached_tokens};
use crate::stream_tokens::TokenCounter;
use kvpool_core::sched::Observed;
use kvpool_proto::openai::{KV_LOAD_BLOCKS_HEADER, KV_LOAD_SECONDS_HEADER};

/// Response header: prompt blocks the chosen prefill engine was expected to hold locally.
pub const LOCAL_BLOCKS_HEADER: &str = "x-kvpool-local-blocks";
/// Response header: prompt blocks it was expected to fetch from the pool.
pub const POOL_BLOCKS_HEADER: &str = "x-kvpool-pool-blocks";
/// Response header: the estimated time to first token of the placement, milliseconds.
pub const TTFT_HEADER: &str = "x-kvpool-ttft-estimate-ms";
/// Response header: the base URL of the prefill engine the request was placed on.
pub const PREFILL_HEADER: &str = "x-kvpool-prefill-engine";
/// Response header: the base URL of the decode engine.
pub const DECODE_HEADER: &str = "x-kvpool-decode-engine";

/// A prefill engine's answer, read in full: its status and body.
pub(super) struct PrefillAnswer {
    pub(super) status: StatusCode,
    pub(super) body: Bytes,
    /// When its body was read to the end: the hand-off to the decode engine starts.
    pub(super) answered: Instant,
    /// The call's wall seconds, from sending the request to the end of the answer.
    pub(super) took_s: f64,
}

impl Finish {
    /// The request's prefill `answer` came: the hand-off to decode starts.
    pub(super) fn prefilled(&mut self, answer: &PrefillAnswer) {
        self.timer.prefilled(answer.answered);
        self.prefill_call_s = Some(answer.took_s);
    }
}

/// Reads a prefill engine's response to the end, marks the request prefilled and feeds the
/// measured pool fetch (headers `x-kvpool-kv-load-*`) into the fetch estimate.
async fn prefill_answer(
    shared: &Shared,
    placed: &Placed,
    url: String,
    sent: Instant,
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
    let body = read_body(url, resp.into_body()).await?;
    let answered = Instant::now();
    let took_s = answered.duration_since(sent).as_secs_f64();
    let took = took_s / shared.config.time_scale;
    let now = shared.now_s();
    shared
        .members
        .lock()
        .with_ticket(placed, |s, t| s.prefilled(t, now));
    if status.is_success() && placed.ticket.found_idle {
        // The engine's own compute: the call's time less the pool read it reports.
        let load = loaded.1.unwrap_or(0.0).max(0.0) / shared.config.time_scale;
        observe_prefill(shared, placed, (took - load).max(0.0));
    }
    if let (Some(blocks), Some(seconds)) = loaded
        && blocks >= 1.0
    {
        let mut fetch = shared.fetch.lock();
        fetch.observe(blocks as u64, seconds / shared.config.time_scale);
        shared
            .metrics
            .fetch_bandwidth
            .set(fetch.bandwidth_bps(shared.config.block_bytes()));
    }
    Ok(PrefillAnswer {
        status,
        body,
        answered,
        took_s,
    })
}

/// Feeds one measured prefill (cost-model seconds) to the fit of its engine's cost model; the
/// model the next placements on that engine assume follows it.
fn observe_prefill(shared: &Shared, placed: &Placed, seconds: f64) {
    let mut m = shared.members.lock();
    let url = placed.prefill_url.as_str();
    let tokens = placed.ticket.uncached_tokens;
    let Some(outcome) = m.costs.observe(url, &placed.model, tokens, seconds) else {
        return;
    };
    if outcome != Observed::Kept {
        tracing::debug!(
            engine = url,
            tokens,
            seconds,
            ?outcome,
            "prefill time not fitted"
        );
        return;
    }
    shared
        .metrics
        .prefill_cost_observations
        .with_label_values(&[url])
        .inc();
    if m.costs.is_fitted(url) {
        // The gauges follow the fit and its error on the last prediction; a pooled fit moves
        // every engine of the group still on it.
        m.apply_costs();
        let engines = m.engines.prefill.clone();
        shared.metrics.set_prefill_costs(&m.costs, &engines);
    }
}

/// Sends `body` to the placement's prefill engine and reads its answer; the client's response
/// instead when the engine cannot be reached (502) or answers an error, which goes back as it
/// is (e.g. 400).
pub(super) async fn call_prefill(
    shared: &Shared,
    placed: &Placed,
    path: &str,
    body: &Value,
    forward: &Forward,
) -> Result<PrefillAnswer, Response> {
    let url = engine_url(&placed.prefill_url, path);
    let sent = Instant::now();
    let answer = match shared
        .upstream
        .post_with(url.clone(), body, forward.headers())
        .await
    {
        Ok(r) => prefill_answer(shared, placed, url, sent, r).await,
        Err(e) => Err(e),
    };
    match answer {
        Ok(a) if a.status.is_success() => Ok(a),
        Ok(a) => {
            shared.metrics.request("prefill_error");
            Err((a.status, a.body).into_response())
        }
        Err(e) => Err(upstream_failed(shared, &e)),
    }
}

/// The prompt tokens the prefill engine did not compute: what its `answer` reports, else the
/// placement's cached blocks (local and pool) in tokens.
pub(super) fn cached_tokens(shared: &Shared, placed: &Placed, answer: &PrefillAnswer) -> u64 {
    reported_cached_tokens(&answer.body).unwrap_or_else(|| {
        let t = &placed.ticket;
        u64::from(t.local_blocks + t.pool_blocks)
            * u64::from(shared.config.scheduler.block_size.get())
    })
}

/// Feeds one served request's time per output token (cost-model seconds) to the decode cost
/// fit, against what its placement predicted; the next placements assume the model that
/// follows.
fn observe_decode(finish: &Finish, tpot_s: f64) {
    let shared = &finish.shared;
    let mut m = shared.members.lock();
    if m.decode_fit.observe(finish.placed.ticket.tpot_s, tpot_s) {
        let cost = m.decode_fit.current();
        if let Some(state) = m.state.as_mut() {
            state.set_decode_cost(cost);
        }
        shared.metrics.set_decode_cost(&m.decode_fit);
    }
}

/// The first token of a served answer came: the measured hand-off feeds its fit (the next
/// placements assume the model that follows), and the request's estimate against what
/// happened goes to the debug log (target `kvpool_conductor::timing`).
fn observe_first_token(finish: &Finish, first: FirstToken) {
    let shared = &finish.shared;
    let t = &finish.placed.ticket;
    if let Some(handoff) = first.handoff_s {
        let mut m = shared.members.lock();
        if m.handoff_fit
            .observe(t.prompt_tokens, handoff / shared.config.time_scale)
        {
            let cost = m.handoff_fit.current();
            if let Some(state) = m.state.as_mut() {
                state.set_handoff_cost(cost);
            }
            shared.metrics.set_handoff_cost(&m.handoff_fit);
        }
    }
    let e = &t.estimate;
    let ms = |s: f64| (s * 1e3 * shared.config.time_scale * 10.0).round() / 10.0;
    tracing::debug!(target: "kvpool_conductor::timing",
        request = t.request, prefill = %finish.placed.prefill_url,
        decode = %finish.placed.decode_url, prompt_tokens = t.prompt_tokens,
        uncached_tokens = t.uncached_tokens, found_idle = t.found_idle,
        est_queue_ms = ms(e.queue_s), est_fetch_ms = ms(e.fetch_s),
        est_prefill_ms = ms(e.prefill_s), est_handoff_ms = ms(e.handoff_s),
        est_ttft_ms = ms(e.total_s()), prefill_call_ms = finish.prefill_call_s.map(|s| ms(s / shared.config.time_scale)),
        handoff_ms = first.handoff_s.map(|s| ms(s / shared.config.time_scale)),
        ttft_ms = ms(first.ttft_s / shared.config.time_scale), "first token");
}

/// The request's decode response has carried `tokens` tokens, `new` of them since last time.
fn decode_progress(finish: &Finish, tokens: u32, new: u32) {
    let shared = &finish.shared;
    shared
        .members
        .lock()
        .with_ticket(&finish.placed, |s, t| s.decode_progress(t, tokens));
    shared
        .metrics
        .decode_tokens_observed
        .with_label_values(&[finish.placed.decode_url.as_str()])
        .inc_by(u64::from(new));
}

/// The decode engine's response goes back to the client as it is (streamed or not), with the
/// placement's assumptions in `x-kvpool-*` headers; the tokens it carries (SSE events with a
/// choice, or a JSON body's `usage.completion_tokens`) update the request's decode progress,
/// and the bookings are released when its body ends or is dropped. A served answer's `usage`
/// gains `prompt_tokens_details.cached_tokens` (`cached`) where the engine left it out.
/// Sends `body` to the decode engine of `placed` at `path` and relays its answer to the client
/// ([`relay_decode`]); a decode engine that cannot be reached gets the client a 502.
pub(super) async fn call_decode(
    shared: &Shared,
    placed: &Placed,
    finish: Finish,
    path: &str,
    body: &Value,
    forward: &Forward,
    cached: u64,
) -> Response {
    let url = engine_url(&placed.decode_url, path);
    match shared
        .upstream
        .post_with(url, body, forward.headers())
        .await
    {
        Ok(resp) => relay_decode(shared, placed, finish, resp, cached),
        Err(e) => upstream_failed(shared, &e),
    }
}

pub(super) fn relay_decode(
    shared: &Shared,
    placed: &Placed,
    finish: Finish,
    resp: Response<Body>,
    cached: u64,
) -> Response {
    let now = shared.now_s();
    shared
        .members
        .lock()
        .with_ticket(placed, |s, t| s.decoding(t, now));
    // The decode engine's own error (e.g. a failed KV hand-off) is relayed as it is.
    let served = resp.status().is_success();
    shared
        .metrics
        .request(if served { "ok" } else { "decode_error" });
    let (parts, body) = resp.into_parts();
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let counter = TokenCounter::new(content_type);
    let usage = served.then(|| UsageFill::new(content_type, cached));
    let whole_body_rewritten = usage.as_ref().is_some_and(UsageFill::rewrites_whole_body);
    // The tokens counted as the body passes are the request's progress in the bookkeeping;
    // `finish` leaves it when the body ends or is dropped. The bytes pass through the usage
    // fill (which holds back an incomplete SSE event, or a JSON body until its end).
    let stream = futures::stream::unfold(
        (Some(body.into_data_stream()), counter, finish, usage),
        move |(mut body, mut counter, mut finish, mut usage)| async move {
            let next = match body.as_mut() {
                Some(b) => b.next().await,
                // The body ended on the last turn, after its tail was sent.
                None => return None,
            };
            let (chunk, new) = match next {
                Some(chunk) => {
                    let new = chunk.as_ref().map_or(0, |b| counter.feed(b));
                    let chunk = match (chunk, usage.as_mut()) {
                        (Ok(b), Some(u)) => Ok(u.feed(&b)),
                        (other, _) => other,
                    };
                    (Some(chunk), new)
                }
                None => {
                    body = None;
                    let tail = usage.as_mut().map(UsageFill::finish).unwrap_or_default();
                    ((!tail.is_empty()).then_some(Ok(tail)), counter.finish())
                }
            };
            if new > 0 {
                decode_progress(&finish, counter.tokens(), new);
            }
            // A served answer's first bytes are the time to first token; its end, with the
            // tokens counted since, the time per output token.
            if served {
                if let Some(Ok(b)) = &chunk
                    && !b.is_empty()
                    && let Some(first) = finish.timer.chunk(counter.tokens())
                {
                    observe_first_token(&finish, first);
                }
                if body.is_none()
                    && let Some(tpot) = finish.timer.ended(counter.tokens())
                {
                    observe_decode(&finish, tpot / finish.shared.config.time_scale);
                }
            }
            // At the end (`None`) `finish` drops here, releasing the bookings.
            chunk.map(|c| (c, (body, counter, finish, usage)))
        },
    );
    let mut out = Response::new(Body::from_stream(stream));
    *out.status_mut() = parts.status;
    // An SSE stream's length is not known anyway; a rewritten JSON body's changes.
    for name in [
        header::CONTENT_TYPE,
        header::CONTENT_LENGTH,
        header::CACHE_CONTROL,
    ] {
        if name == header::CONTENT_LENGTH && whole_body_rewritten {
            continue;
        }
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
        (PREFILL_HEADER, placed.prefill_url.clone()),
        (DECODE_HEADER, placed.decode_url.clone()),
    ] {
        if let Ok(v) = HeaderValue::from_str(&value) {
            out.headers_mut().insert(name, v);
        }
    }
    out
}

//! One request from its body to its placement: parse and validate it (OpenAI contract),
//! tokenise the prompt into block keys, ask the pool which leading blocks it holds, let the
//! policy place it (or reject it), start any replication the placement planned, and hand it
//! to the routing convention of the chosen pair. I/O boundary: the tokenizer task, the pool
//! lookup and, through `vllm` and `sglang`, the engines.

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::error_bodies::{api_error, no_engines, rejected, tokenizer_failed, upstream_failed};
use super::members::{Members, Placed};
use super::pool_lookup::pool_prefix;
use super::prefetch::replicate;
use super::sglang::route_sglang;
use super::shared::{Finish, Shared};
use super::upstream::UpstreamError;
use super::vllm::route_vllm;
use crate::engines::RoutingProtocol;
use kvpool_proto::openai::{self as api, Endpoint};

/// Serves one completion request that came to `endpoint` (at `path`).
pub(super) async fn handle(
    shared: Arc<Shared>,
    endpoint: Endpoint,
    path: &str,
    body: Bytes,
) -> Response {
    // Without engines nothing can be served, whatever the request says.
    if shared.members.lock().state.is_none() {
        return no_engines(&shared);
    }
    let served = |m: &str| shared.models.serves(m);
    let req = match api::parse_request(endpoint, &body, &served) {
        Err(api::ApiError::UnknownModel(_)) if shared.models.learns() => {
            // Perhaps an engine serves it and was not asked yet (or changed its model).
            super::models::refresh(&shared.models, &shared.upstream, shared.engine_urls()).await;
            api::parse_request(endpoint, &body, &served)
        }
        parsed => parsed,
    };
    let req = match req {
        Ok(r) => Arc::new(r),
        Err(e) => return api_error(&shared, &e),
    };
    // parse_request accepted it, so it is a JSON object.
    let original: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let tokens = match shared
        .config
        .tokenizer
        .request_tokens_off_runtime(shared.config.chat_template.clone(), req.clone())
        .await
    {
        Ok(t) => t,
        Err(e) => return tokenizer_failed(&shared, &e),
    };
    let keys = shared
        .config
        .hashing
        .keys(&tokens, shared.config.scheduler.block_size);
    let in_pool = match &shared.config.pool {
        Some(pool) => pool_prefix(&shared, pool, &req.model, &keys).await,
        None => 0,
    };
    let placed = {
        let mut members = shared.members.lock();
        let epoch = members.epoch;
        let Members { engines, state, .. } = &mut *members;
        let Some(state) = state.as_mut() else {
            drop(members);
            return no_engines(&shared);
        };
        let now = shared.now_s();
        state.set_pool_bandwidth(
            shared
                .fetch
                .lock()
                .bandwidth_bps(shared.config.block_bytes()),
        );
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
                (Some(p), Some(d)) => {
                    if let Some(n) = state.mirror_blocks(ticket.prefill) {
                        // The guess kept for an engine without a KV event stream.
                        shared
                            .metrics
                            .engine_cached_blocks
                            .with_label_values(&[p, "mirror"])
                            .set(n as i64);
                    }
                    Placed {
                        ticket,
                        epoch,
                        prefill_url: p.clone(),
                        decode_url: d.clone(),
                        protocol: engines.pair_protocol(p, d, shared.config.protocol),
                    }
                }
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

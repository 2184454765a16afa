//! One request from its body to its placement: parse it once (the conductor's OpenAI layer,
//! `request`: the body as it came beside its typed view), tokenise the prompt into block keys
//! (a batch by its first prompt), ask the pool which leading blocks it holds, let the
//! policy place it (or reject it), start any replication the placement planned, and hand it
//! to the routing convention of the chosen pair. I/O boundary: the tokenizer task, the pool
//! lookup and, through `vllm` and `sglang`, the engines.

use std::sync::Arc;

use axum::body::Bytes;
use axum::response::Response;

use super::access::Forward;
use super::engine_tokenize::engine_tokens;
use super::error_bodies::{
    api_error, internal_error, no_engines, rejected, tokenizer_failed, upstream_failed,
};
use super::latency::RequestTimer;
use super::members::{Members, Placed};
use super::pool_lookup::pool_prefix;
use super::prefetch::replicate;
use super::sglang::route_sglang;
use super::shared::{Finish, Shared};
use super::upstream::UpstreamError;
use super::vllm::route_vllm;
use super::vllm_mooncake::route_vllm_mooncake;
use crate::engines::RoutingProtocol;
use crate::request::ClientRequest;
use crate::tokenize::PromptTokenizer;
use kvpool_core::sched::EngineHash;
use kvpool_proto::openai::{ApiError, Endpoint};

/// Serves one completion request that came to `endpoint` (at `path`).
pub(super) async fn handle(
    shared: Arc<Shared>,
    endpoint: Endpoint,
    path: &str,
    body: Bytes,
    forward: &Forward,
) -> Response {
    // In flight from here; the end-to-end time is observed when `timer` drops (with the
    // response body for a served request, on return for any other).
    let timer = RequestTimer::start(&shared.metrics.latency);
    // Without engines nothing can be served, whatever the request says.
    if shared.members.lock().state.is_none() {
        // Counted as refused for want of instances: what scales a pool up from zero.
        let wall = shared.wall_s();
        shared
            .load
            .lock()
            .rejected(wall, kvpool_core::sched::RejectReason::NoInstance);
        return no_engines(&shared);
    }
    let served = |m: &str| shared.models.serves(m);
    let req = match ClientRequest::parse(endpoint, &body, &served) {
        Ok(Err(unknown)) if shared.models.learns() => {
            // Perhaps an engine serves it and was not asked yet (or changed its model).
            super::models::refresh(&shared.models, &shared.upstream, shared.engine_urls()).await;
            ClientRequest::from_object(endpoint, unknown.body, &served)
        }
        parsed => parsed,
    };
    let req = match req {
        Ok(Ok(r)) => r,
        Ok(Err(unknown)) => return api_error(&shared, &unknown.error),
        Err(e) => return api_error(&shared, &e),
    };
    let urls = shared.engine_urls();
    if shared.models.missing(&urls) {
        // Which models a new engine serves, for the next requests' routing; this one goes on
        // (an engine not heard from may take any model).
        let s = shared.clone();
        tokio::spawn(async move { super::models::refresh(&s.models, &s.upstream, urls).await });
    }
    let limit = shared.config.max_prompts;
    if req.view.prompts.len() > limit {
        let e = ApiError::Invalid {
            field: "prompt",
            problem: format!(
                "batches {} prompts, more than this conductor's limit of {limit} per request \
                 (--max-prompts-per-request)",
                req.view.prompts.len()
            ),
        };
        return api_error(&shared, &e);
    }
    let mut tokens = match shared
        .config
        .tokenizer
        .prompt_tokens_off_runtime(shared.config.chat_template.clone(), req.view.clone())
        .await
    {
        Ok(t) => t,
        Err(e) => return tokenizer_failed(&shared, &e),
    };
    if matches!(shared.config.tokenizer, PromptTokenizer::Engine { .. }) {
        // The engines' own tokens for the first prompt; stand-in chunks if none can say.
        let engine = shared.members.lock().engines.prefill.first().cloned();
        if let Some(engine) = engine
            && let Some(ids) = engine_tokens(&shared, &engine, &req.body).await
        {
            tokens.total = tokens.total - tokens.first.len() as u64 + ids.len() as u64;
            tokens.first = ids;
        }
    }
    // A batch goes to one engine pair, as one request, routed by its first prompt's prefix
    // (docs/openai.md); all its prompt tokens and choices are booked.
    let block_size = shared.config.scheduler.block_size;
    let hashes = shared
        .config
        .hashing
        .engine_hashes(&tokens.first, block_size);
    let keys = match &hashes {
        Some(h) => h.iter().map(EngineHash::as_u64).collect(),
        None => shared.config.hashing.keys(&tokens.first, block_size),
    };
    let in_pool = match &shared.config.pool {
        Some(pool) => pool_prefix(&shared, pool, &req.view.model, &keys, hashes.as_deref()).await,
        None => 0,
    };
    let output_tokens = req.booked_output_tokens();
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
        // Only engines that serve the request's model (docs/scheduling.md, "Several models").
        state.set_eligible(shared.models.eligible(&req.view.model, engines));
        let placed = state.place_with_pool(now, &keys, in_pool, tokens.total, output_tokens);
        state.set_eligible(kvpool_core::sched::Eligible::default());
        {
            let wall = shared.wall_s();
            let mut load = shared.load.lock();
            match &placed {
                Ok(t) => load.admitted(wall, t.ttft_s, t.tpot_s),
                Err(refusal) => load.rejected(wall, refusal.reason),
            }
        }
        if let Some(task) = state.take_replication() {
            replicate(&shared, &task, &engines.prefill);
            // The pool's own copies, named as the engines name the blocks.
            let names = shared.config.pool.as_ref().and_then(|p| {
                let n = task.keys.len();
                let hashes = hashes.as_deref().and_then(|h| h.get(..n));
                p.keys.names(&req.view.model, &task.keys, hashes)
            });
            super::hot_pool::replicate_in_pool(&shared, names);
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
                        model: req.view.model.clone(),
                        protocol: engines.pair_protocol(p, d, shared.config.protocol),
                    }
                }
                _ => {
                    drop(members);
                    return internal_error(&shared, "the placement names an engine that left");
                }
            },
            Err(refusal) => {
                drop(members);
                return rejected(&shared, refusal);
            }
        }
    };
    tracing::debug!(?placed, "placed");
    timer.placed();
    // Releases the bookings however this request ends: error, client gone, or body done.
    let finish = Finish {
        shared: shared.clone(),
        placed: placed.clone(),
        timer,
        prefill_call_s: None,
    };
    let original = req.into_body();
    match placed.protocol.clone() {
        Ok(RoutingProtocol::Vllm) => {
            route_vllm(shared, placed, finish, original, path, forward).await
        }
        Ok(RoutingProtocol::VllmMooncake { bootstrap_port }) => {
            route_vllm_mooncake(
                shared,
                placed,
                finish,
                original,
                path,
                bootstrap_port,
                forward,
            )
            .await
        }
        Ok(RoutingProtocol::Sglang { bootstrap_port }) => {
            route_sglang(
                shared,
                placed,
                finish,
                original,
                path,
                bootstrap_port,
                forward,
            )
            .await
        }
        Err(mismatch) => upstream_failed(&shared, &UpstreamError::Mismatch(mismatch)),
    }
}

//! vLLM's `MooncakeConnector` convention (P2P prefill -> decode over a transfer engine, with a
//! bootstrap server on each prefill instance): one `transfer_id` names both halves of a request;
//! prefill gets the one-token request with `kv_transfer_params: {do_remote_decode,
//! transfer_id}` and answers no `kv_transfer_params` of its own; decode gets the original
//! request with `{do_remote_prefill, remote_engine_id, remote_bootstrap_addr, transfer_id}`,
//! asks the bootstrap server where the prefill worker is, and the prefill worker writes the
//! blocks into the decode engine's KV cache. The prefill instance's engine id (one per data
//! parallel rank) comes from its bootstrap server's `GET /query` (`bootstrap`).
//! I/O boundary: the bootstrap query and the two engine calls, in turn.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, Request};
use axum::response::Response;
use kvpool_runtime::telemetry::chain;
use serde_json::{Value, json};

use super::access::Forward;
use super::bootstrap::{PrefillRank, bootstrap_url, parse_query};
use super::engine_calls::{cached_tokens, call_decode, call_prefill};
use super::error_bodies::upstream_failed;
use super::members::Placed;
use super::shared::{Finish, Shared};
use super::upstream::{UpstreamError, read_body};
use super::vllm::one_token_prefill;

/// Longest wait for a bootstrap server's answer.
const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(5);
/// The header vLLM's API server reads to run a request on one data parallel rank.
const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// The ranks `bootstrap` lists, from the cache or asked now.
async fn prefill_ranks(shared: &Shared, bootstrap: &str) -> Result<Vec<PrefillRank>, String> {
    if let Some(ranks) = shared.bootstraps.fresh(bootstrap) {
        return Ok(ranks);
    }
    let url = format!("{bootstrap}/query");
    let req = Request::get(&url)
        .body(Body::empty())
        .map_err(|e| e.to_string())?;
    let call = async {
        let resp = shared
            .upstream
            .request(url.clone(), req)
            .await
            .map_err(|e| match e {
                // The URL is in the message already.
                UpstreamError::Connect { source, .. } => {
                    format!("cannot connect: {}", chain(&source))
                }
                other => chain(&other).to_string(),
            })?;
        let status = resp.status();
        let body = read_body(url.clone(), resp.into_body())
            .await
            .map_err(|e| e.to_string())?;
        if !status.is_success() {
            return Err(format!("status {status}"));
        }
        parse_query(&body)
    };
    let ranks = tokio::time::timeout(BOOTSTRAP_TIMEOUT, call)
        .await
        .map_err(|_| format!("no answer within {BOOTSTRAP_TIMEOUT:?}"))??;
    shared.bootstraps.store(bootstrap, ranks.clone());
    Ok(ranks)
}

/// vLLM's `MooncakeConnector` convention: the prefill instance's engine id from its bootstrap
/// server, then prefill (one token, `{do_remote_decode, transfer_id}`) and decode (the original
/// request, told which engine, bootstrap server and transfer to pull), in turn. With several
/// data parallel ranks behind one prefill server, one is chosen at random and the prefill call
/// pinned to it (`X-data-parallel-rank`), so that the engine id decode is given is the one
/// that holds the blocks.
pub(super) async fn route_vllm_mooncake(
    shared: Arc<Shared>,
    placed: Placed,
    mut finish: Finish,
    original: Value,
    path: &str,
    bootstrap_port: u16,
    forward: &Forward,
) -> Response {
    let bootstrap = bootstrap_url(&placed.prefill_url, bootstrap_port);
    let ranks = match prefill_ranks(&shared, &bootstrap).await {
        Ok(r) => r,
        Err(problem) => {
            let e = UpstreamError::Bootstrap(format!(
                "the prefill engine {}'s Mooncake bootstrap server {bootstrap}/query: {problem}",
                placed.prefill_url
            ));
            return upstream_failed(&shared, &e);
        }
    };
    let rank = &ranks[rand::random_range(0..ranks.len())];
    let transfer_id = format!("kvpool-{:032x}", rand::random::<u128>());
    let prefill_req = one_token_prefill(
        &original,
        json!({"do_remote_decode": true, "do_remote_prefill": false,
               "transfer_id": transfer_id}),
    );
    let pinned;
    let prefill_forward = if ranks.len() > 1 {
        pinned = forward.with_header(
            HeaderName::from_static(DP_RANK_HEADER),
            HeaderValue::from(rank.dp_rank),
        );
        &pinned
    } else {
        forward
    };
    let answer = match call_prefill(&shared, &placed, path, &prefill_req, prefill_forward).await {
        Ok(a) => a,
        Err(resp) => {
            // The instance may have restarted under a new engine id.
            shared.bootstraps.forget(&bootstrap);
            return resp;
        }
    };
    finish.prefilled(&answer);
    let cached = cached_tokens(&shared, &placed, &answer);

    let mut decode_req = original;
    if let Some(obj) = decode_req.as_object_mut() {
        obj.insert(
            "kv_transfer_params".into(),
            json!({"do_remote_prefill": true, "do_remote_decode": false,
                   "remote_engine_id": rank.engine_id, "remote_bootstrap_addr": bootstrap,
                   "transfer_id": transfer_id}),
        );
    }
    call_decode(&shared, &placed, finish, path, &decode_req, forward, cached).await
}

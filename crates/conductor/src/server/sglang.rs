//! SGLang's disaggregated-serving convention (its router's mini load balancer): the same
//! request, plus the prefill engine's `bootstrap_host`/`bootstrap_port` and a random
//! `bootstrap_room`, goes to the prefill and the decode engine at once, prefill first. I/O
//! boundary: the two engine calls, concurrently in the request's task.

use std::sync::Arc;
use std::task::Poll;

use axum::response::Response;
use serde_json::{Value, json};

use super::access::Forward;
use super::engine_calls::{cached_tokens, call_prefill, relay_decode};
use super::error_bodies::upstream_failed;
use super::members::Placed;
use super::shared::{Finish, Shared};
use super::upstream::{engine_url, url_host};
use kvpool_proto::openai as api;

/// SGLang's convention (its router's mini load balancer): the same request, plus
/// `bootstrap_host`/`bootstrap_port` of the prefill engine and a random 63-bit
/// `bootstrap_room`, goes to the prefill and the decode engine at once; the decode engine's
/// response is the client's. The prefill call goes out first, as SGLang's router joins the two
/// sends with prefill first: a decode engine that hears of a room before its prefill engine
/// only waits longer for the KV (the synthetic engine then loses a poll of its agent, a
/// millisecond). The prefill answer is read to the end; its failure answers the client at
/// once, and the decode call, dropped, is cancelled.
pub(super) async fn route_sglang(
    shared: Arc<Shared>,
    placed: Placed,
    mut finish: Finish,
    original: Value,
    path: &str,
    bootstrap_port: u16,
    forward: &Forward,
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
    let prefill_call = call_prefill(&shared, &placed, path, &req, forward);
    let decode_call = shared.upstream.post_with(
        engine_url(&placed.decode_url, path),
        &req,
        forward.headers(),
    );
    tokio::pin!(prefill_call, decode_call);
    // The first poll hands the prefill request to its connection's task; yielding once lets
    // that task write it before the decode call is even started.
    let mut prefilled = match futures::poll!(&mut prefill_call) {
        Poll::Ready(p) => Some(p),
        Poll::Pending => None,
    };
    if prefilled.is_none() {
        tokio::task::yield_now().await;
    }
    let mut decoded = None;
    while prefilled.is_none() {
        tokio::select! {
            biased;
            p = &mut prefill_call => prefilled = Some(p),
            d = &mut decode_call, if decoded.is_none() => decoded = Some(d),
        }
    }
    // The prefill answer itself is not the client's: its success matters here, and what it
    // says of the prompt tokens it found cached.
    let cached = match prefilled {
        Some(Err(resp)) => return resp,
        Some(Ok(answer)) => {
            finish.prefilled(&answer);
            cached_tokens(&shared, &placed, &answer)
        }
        None => 0,
    };
    let decoded = match decoded {
        Some(d) => d,
        None => decode_call.await,
    };
    match decoded {
        Ok(resp) => relay_decode(&shared, &placed, finish, resp, cached),
        Err(e) => upstream_failed(&shared, &e),
    }
}

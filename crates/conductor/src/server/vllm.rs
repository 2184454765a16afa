//! vLLM's disaggregated-serving convention (its proxy's): prefill with one token and
//! `kv_transfer_params: {do_remote_decode}`, then decode with the original request plus the
//! `kv_transfer_params` prefill returned. I/O boundary: the two engine calls, in turn.

use std::sync::Arc;

use axum::response::Response;
use serde_json::{Value, json};

use super::access::Forward;
use super::engine_calls::{cached_tokens, call_decode, call_prefill};
use super::members::Placed;
use super::shared::{Finish, Shared};

/// The prefill form of `original` under vLLM's conventions: one token, one choice, no
/// streaming, and `kv_params` as its `kv_transfer_params`.
pub(super) fn one_token_prefill(original: &Value, kv_params: Value) -> Value {
    let mut req = original.clone();
    if let Some(obj) = req.as_object_mut() {
        obj.insert("max_tokens".into(), json!(1));
        obj.remove("max_completion_tokens");
        // One choice is enough to compute the prompt's KV, and a floor on the output length
        // would contradict the one token.
        obj.insert("n".into(), json!(1));
        obj.remove("min_tokens");
        obj.insert("stream".into(), json!(false));
        obj.remove("stream_options");
        obj.insert("kv_transfer_params".into(), kv_params);
    }
    req
}

/// vLLM's convention: prefill with one token and `kv_transfer_params: {do_remote_decode}`,
/// then decode with the original request plus the `kv_transfer_params` prefill returned.
pub(super) async fn route_vllm(
    shared: Arc<Shared>,
    placed: Placed,
    mut finish: Finish,
    original: Value,
    path: &str,
    forward: &Forward,
) -> Response {
    // Prefill: one token, no streaming, and ask for the KV cache to be kept for decode.
    let prefill_req = one_token_prefill(
        &original,
        json!({"do_remote_decode": true, "do_remote_prefill": false}),
    );
    let answer = match call_prefill(&shared, &placed, path, &prefill_req, forward).await {
        Ok(a) => a,
        // Dropping `finish` with the early return releases the bookings.
        Err(resp) => return resp,
    };
    finish.prefilled(&answer);
    let cached = cached_tokens(&shared, &placed, &answer);
    let kv_params = serde_json::from_slice::<Value>(&answer.body)
        .ok()
        .and_then(|v| v.get("kv_transfer_params").cloned())
        .filter(|v| !v.is_null());

    // Decode: the original request, told where the KV cache is.
    let mut decode_req = original;
    if let (Some(obj), Some(kv)) = (decode_req.as_object_mut(), kv_params) {
        obj.insert("kv_transfer_params".into(), kv);
    }
    call_decode(&shared, &placed, finish, path, &decode_req, forward, cached).await
}

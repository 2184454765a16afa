//! SGLang's disaggregated-serving convention (its router's mini load balancer): the same
//! request, plus the prefill engine's `bootstrap_host`/`bootstrap_port` and a random
//! `bootstrap_room`, goes to the prefill and the decode engine at once. I/O boundary: the two
//! engine calls, concurrently.

use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::engine_calls::{call_prefill, relay_decode};
use super::error_bodies::upstream_failed;
use super::members::Placed;
use super::shared::{Finish, Shared};
use super::upstream::engine_url;
use kvpool_proto::openai as api;

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
pub(super) async fn route_sglang(
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
        let url = engine_url(&placed.decode_url, path);
        let req = req.clone();
        // Aborted on drop, so a failed prefill or a gone client does not leave it running.
        AbortOnDrop(tokio::spawn(async move {
            shared.upstream.post(url, &req).await
        }))
    };
    // The prefill answer itself is not the client's: only its success matters here.
    if let Err(resp) = call_prefill(&shared, &placed, path, &req).await {
        return resp;
    }
    match decode.join().await {
        Some(Ok(resp)) => relay_decode(&shared, &placed, finish, resp),
        Some(Err(e)) => upstream_failed(&shared, &e),
        None => {
            shared.metrics.request("upstream");
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

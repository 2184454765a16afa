//! The engine's KV events, as vLLM's `--kv-events-config` sets them up: every change of the
//! prefix cache goes out as a msgpack batch through the shared publisher of
//! `kvpool_runtime::kv_events` (ZMQ PUB `[topic, sequence, batch]`, ROUTER replays of the last
//! `buffer_steps` batches). I/O boundary: the publisher's two ZMQ sockets.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvpool_proto::kv_events::{Encoding, EventBatch, encode_batch};
pub use kvpool_runtime::kv_events::KvEventsConfig;
use kvpool_runtime::kv_events::Publisher;
use tokio_util::sync::CancellationToken;

use super::shared::Shared;

/// How often the cache's new events are collected and published.
const TICK: Duration = Duration::from_millis(5);

/// The engine API's router (as [`super::router_with_agent`]) with, when `events` is set, the
/// KV event publisher bound and running until `stop` fires.
pub async fn router_publishing(
    config: crate::EngineConfig,
    kv: Option<crate::agent::AgentKv>,
    registry: &prometheus::Registry,
    events: Option<KvEventsConfig>,
    stop: CancellationToken,
) -> Result<axum::Router, super::ServerError> {
    let (router, shared) = super::endpoints::engine(config, kv, registry)?;
    if let Some(events) = events {
        start(shared, events, stop).await?;
    }
    Ok(router)
}

/// Binds the sockets (errors name the endpoint), then publishes until `stop` fires.
async fn start(
    shared: Arc<Shared>,
    config: KvEventsConfig,
    stop: CancellationToken,
) -> Result<(), super::ServerError> {
    let publisher = Publisher::bind(config)
        .await
        .map_err(super::ServerError::KvEvents)?;
    shared.core.lock().publish_events();
    let next = move || {
        let events = shared.core.lock().take_events();
        if events.is_empty() {
            return Vec::new();
        }
        shared.metrics.kv_event_batches.inc();
        vec![Bytes::from(encode_batch(
            &EventBatch::now(events),
            Encoding::Array,
        ))]
    };
    tokio::spawn(publisher.run(TICK, next, stop));
    Ok(())
}

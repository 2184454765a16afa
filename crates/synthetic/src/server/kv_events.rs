//! The engine's KV event publisher, as vLLM's `--kv-events-config` sets one up: a ZMQ PUB
//! socket sending `[topic, sequence, msgpack batch]` for every change of the prefix cache, and
//! a ROUTER socket answering replay requests from the last `buffer_steps` batches. I/O
//! boundary: the two ZMQ sockets.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvpool_proto::kv_events::{END_SEQUENCE, Encoding, EventBatch, KvEvent, encode_batch};
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use super::shared::Shared;

/// vLLM's `--kv-events-config` (the fields the synthetic engine uses).
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
pub struct KvEventsConfig {
    #[serde(default)]
    pub enable_kv_cache_events: bool,
    #[serde(default = "zmq")]
    pub publisher: String,
    /// PUB endpoint to bind (`tcp://*:5557` binds every address).
    #[serde(default = "default_endpoint")]
    pub endpoint: String,
    /// ROUTER endpoint answering replay requests; none: no replay.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    #[serde(default = "default_buffer")]
    pub buffer_steps: usize,
    #[serde(default)]
    pub topic: String,
}

fn zmq() -> String {
    "zmq".into()
}
fn default_endpoint() -> String {
    "tcp://*:5557".into()
}
fn default_buffer() -> usize {
    10_000
}

impl KvEventsConfig {
    /// Parses the flag's JSON; `None` when events are not enabled.
    pub fn parse(json: &str) -> Result<Option<Self>, String> {
        let c: KvEventsConfig =
            serde_json::from_str(json).map_err(|e| format!("not a KV events config: {e}"))?;
        if !c.enable_kv_cache_events {
            return Ok(None);
        }
        if c.publisher != "zmq" {
            return Err(format!(
                "publisher {:?}: only \"zmq\" is supported",
                c.publisher
            ));
        }
        if c.buffer_steps == 0 {
            return Err("buffer_steps must be at least 1".into());
        }
        Ok(Some(c))
    }
}

/// How often the cache's new events are collected and published.
const TICK: Duration = Duration::from_millis(5);

/// ZMQ's `*` host is every address; zeromq-rs binds `0.0.0.0`.
fn bind_address(endpoint: &str) -> String {
    endpoint.replace("://*:", "://0.0.0.0:")
}

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
        start(shared, events, stop)
            .await
            .map_err(super::ServerError::KvEvents)?;
    }
    Ok(router)
}

/// Binds the sockets (errors name the endpoint), then publishes until `stop` fires.
async fn start(
    shared: Arc<Shared>,
    config: KvEventsConfig,
    stop: CancellationToken,
) -> Result<(), String> {
    let mut publisher = zeromq::PubSocket::new();
    publisher
        .bind(&bind_address(&config.endpoint))
        .await
        .map_err(|e| format!("cannot bind KV events endpoint {}: {e}", config.endpoint))?;
    let replay = match &config.replay_endpoint {
        Some(endpoint) => {
            let mut router = zeromq::RouterSocket::new();
            router
                .bind(&bind_address(endpoint))
                .await
                .map_err(|e| format!("cannot bind KV events replay endpoint {endpoint}: {e}"))?;
            Some(router)
        }
        None => None,
    };
    shared.core.lock().publish_events();
    tracing::info!(endpoint = %config.endpoint, replay = ?config.replay_endpoint, "publishing KV events");
    tokio::spawn(publish(shared, config, publisher, replay, stop));
    Ok(())
}

async fn publish(
    shared: Arc<Shared>,
    config: KvEventsConfig,
    mut publisher: zeromq::PubSocket,
    mut replay: Option<zeromq::RouterSocket>,
    stop: CancellationToken,
) {
    let mut buffer: VecDeque<(u64, Bytes)> = VecDeque::new();
    let mut seq = 0u64;
    let mut tick = tokio::time::interval(TICK);
    let topic = Bytes::from(config.topic.clone().into_bytes());
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {
                let events: Vec<KvEvent> = shared.core.lock().take_events();
                if events.is_empty() {
                    continue;
                }
                let ts = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                let payload = Bytes::from(encode_batch(
                    &EventBatch { ts, events, data_parallel_rank: None },
                    Encoding::Array,
                ));
                let mut msg = ZmqMessage::from(topic.clone());
                msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
                msg.push_back(payload.clone());
                if let Err(e) = publisher.send(msg).await {
                    tracing::warn!(error = %e, "cannot publish KV events");
                }
                shared.metrics.kv_event_batches.inc();
                buffer.push_back((seq, payload));
                while buffer.len() > config.buffer_steps {
                    buffer.pop_front();
                }
                seq += 1;
            }
            request = recv_replay(&mut replay) => {
                if let (Some(router), Ok(req)) = (replay.as_mut(), request) {
                    answer_replay(router, req, &buffer).await;
                }
            }
        }
    }
}

async fn recv_replay(
    replay: &mut Option<zeromq::RouterSocket>,
) -> Result<ZmqMessage, zeromq::ZmqError> {
    match replay {
        Some(r) => r.recv().await,
        None => std::future::pending().await,
    }
}

/// `[identity, "", start]`: every buffered batch from `start` on, then the end marker.
async fn answer_replay(
    router: &mut zeromq::RouterSocket,
    req: ZmqMessage,
    buffer: &VecDeque<(u64, Bytes)>,
) {
    let (Some(identity), Some(start)) = (req.get(0).cloned(), req.get(req.len() - 1)) else {
        return;
    };
    let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else {
        tracing::debug!(frames = req.len(), "malformed KV event replay request");
        return;
    };
    let reply = |seq: &[u8], payload: Bytes| {
        let mut m = ZmqMessage::from(identity.clone());
        m.push_back(Bytes::new());
        m.push_back(Bytes::copy_from_slice(seq));
        m.push_back(payload);
        m
    };
    for (s, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
        if router
            .send(reply(&s.to_be_bytes(), payload.clone()))
            .await
            .is_err()
        {
            return;
        }
    }
    let _ = router.send(reply(&END_SEQUENCE, Bytes::new())).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_reads_vllm_s_json_and_refuses_what_it_cannot_do() {
        let c = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events": true, "publisher": "zmq",
                "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}"#,
        )
        .expect("valid")
        .expect("enabled");
        assert_eq!(c.replay_endpoint.as_deref(), Some("tcp://*:5558"));
        assert_eq!((c.buffer_steps, c.topic.as_str()), (10_000, "kv"));
        assert_eq!(bind_address(&c.endpoint), "tcp://0.0.0.0:5557");
        assert_eq!(
            KvEventsConfig::parse(r#"{"enable_kv_cache_events": false}"#),
            Ok(None)
        );
        assert!(
            KvEventsConfig::parse(r#"{"enable_kv_cache_events": true, "publisher": "null"}"#)
                .expect_err("publisher")
                .contains("zmq")
        );
        assert!(KvEventsConfig::parse("not json").is_err());
    }
}

//! A KV event publisher in vLLM's shape, shared by every kvpool process that publishes block
//! events (the synthetic engine, the master): vLLM's `--kv-events-config` JSON, a ZMQ PUB
//! socket sending `[topic, 8-byte big-endian sequence, payload]` and an optional ROUTER socket
//! answering replay requests from the last `buffer_steps` payloads. What a payload holds (a
//! msgpack event batch, `kvpool_proto::kv_events`) is the caller's. I/O boundary: the two ZMQ
//! sockets.

use crate::telemetry::chain;
use std::collections::VecDeque;
use std::time::Duration;

use bytes::Bytes;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// The sequence frame that closes a replay answer (-1 as a signed 64-bit big-endian number).
pub const END_SEQUENCE: [u8; 8] = [0xff; 8];

/// vLLM's `--kv-events-config` (the fields kvpool reads).
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

/// Why a KV events config is refused or its sockets cannot be bound.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum KvEventsError {
    #[error("not a KV events config: {0}")]
    Json(#[source] serde_json::Error),
    #[error("publisher {0:?}: only \"zmq\" is supported")]
    Publisher(String),
    #[error("buffer_steps must be at least 1")]
    NoBuffer,
    #[error("cannot bind KV events endpoint {endpoint}")]
    Bind {
        endpoint: String,
        #[source]
        source: zeromq::ZmqError,
    },
}

impl KvEventsConfig {
    /// Parses the flag's JSON; `None` when events are not enabled.
    pub fn parse(json: &str) -> Result<Option<Self>, KvEventsError> {
        let c: KvEventsConfig = serde_json::from_str(json).map_err(KvEventsError::Json)?;
        if !c.enable_kv_cache_events {
            return Ok(None);
        }
        if c.publisher != "zmq" {
            return Err(KvEventsError::Publisher(c.publisher));
        }
        if c.buffer_steps == 0 {
            return Err(KvEventsError::NoBuffer);
        }
        Ok(Some(c))
    }
}

/// ZMQ's `*` host is every address; zeromq-rs binds `0.0.0.0`.
fn bind_address(endpoint: &str) -> String {
    endpoint.replace("://*:", "://0.0.0.0:")
}

/// The bound sockets, the sequence counter and the replay buffer of one publisher.
pub struct Publisher {
    config: KvEventsConfig,
    publisher: zeromq::PubSocket,
    replay: Option<zeromq::RouterSocket>,
    buffer: VecDeque<(u64, Bytes)>,
    seq: u64,
    topic: Bytes,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("endpoint", &self.config.endpoint)
            .field("replay_endpoint", &self.config.replay_endpoint)
            .field("next_seq", &self.seq)
            .finish_non_exhaustive()
    }
}

async fn bind<S: Socket>(socket: &mut S, endpoint: &str) -> Result<(), KvEventsError> {
    socket
        .bind(&bind_address(endpoint))
        .await
        .map(|_| ())
        .map_err(|source| KvEventsError::Bind {
            endpoint: endpoint.to_owned(),
            source,
        })
}

impl Publisher {
    /// Binds the PUB socket and, when configured, the replay ROUTER (errors name the endpoint).
    pub async fn bind(config: KvEventsConfig) -> Result<Self, KvEventsError> {
        let mut publisher = zeromq::PubSocket::new();
        bind(&mut publisher, &config.endpoint).await?;
        let replay = match &config.replay_endpoint {
            Some(endpoint) => {
                let mut router = zeromq::RouterSocket::new();
                bind(&mut router, endpoint).await?;
                Some(router)
            }
            None => None,
        };
        tracing::info!(endpoint = %config.endpoint, replay = ?config.replay_endpoint, "publishing KV events");
        Ok(Self {
            topic: Bytes::from(config.topic.clone().into_bytes()),
            config,
            publisher,
            replay,
            buffer: VecDeque::new(),
            seq: 0,
        })
    }

    /// Publishes one payload under the next sequence number and keeps it for replays.
    pub async fn send(&mut self, payload: Bytes) {
        let mut msg = ZmqMessage::from(self.topic.clone());
        msg.push_back(Bytes::copy_from_slice(&self.seq.to_be_bytes()));
        msg.push_back(payload.clone());
        if let Err(e) = self.publisher.send(msg).await {
            tracing::warn!(error = %chain(&e), "cannot publish KV events");
        }
        self.buffer.push_back((self.seq, payload));
        while self.buffer.len() > self.config.buffer_steps {
            self.buffer.pop_front();
        }
        self.seq += 1;
    }

    /// Every `tick`, publishes what `next` hands over (one payload per batch, in order), and
    /// answers replay requests in between, until `stop` fires.
    pub async fn run(
        mut self,
        tick: Duration,
        mut next: impl FnMut() -> Vec<Bytes> + Send,
        stop: CancellationToken,
    ) {
        let mut ticks = tokio::time::interval(tick);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = ticks.tick() => {
                    for payload in next() {
                        self.send(payload).await;
                    }
                }
                request = recv_replay(&mut self.replay) => {
                    if let Ok(req) = request {
                        self.answer_replay(req).await;
                    }
                }
            }
        }
    }

    /// `[identity, "", start]`: every buffered batch from `start` on, then the end marker.
    async fn answer_replay(&mut self, req: ZmqMessage) {
        let Some(router) = self.replay.as_mut() else {
            return;
        };
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
        for (s, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
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
}

async fn recv_replay(
    replay: &mut Option<zeromq::RouterSocket>,
) -> Result<ZmqMessage, zeromq::ZmqError> {
    match replay {
        Some(r) => r.recv().await,
        None => std::future::pending().await,
    }
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
        assert!(matches!(
            KvEventsConfig::parse(r#"{"enable_kv_cache_events": false}"#),
            Ok(None)
        ));
        let refused =
            KvEventsConfig::parse(r#"{"enable_kv_cache_events": true, "publisher": "null"}"#)
                .expect_err("publisher");
        assert!(refused.to_string().contains("zmq"));
        assert!(KvEventsConfig::parse("not json").is_err());
        assert!(matches!(
            KvEventsConfig::parse(r#"{"enable_kv_cache_events": true, "buffer_steps": 0}"#),
            Err(KvEventsError::NoBuffer)
        ));
    }
}

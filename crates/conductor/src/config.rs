//! The conductor's settings ([`ConductorConfig`]), validated from the flags by `cli`, and the
//! master connection it asks for pooled prefixes ([`PoolLookup`]). Pure data; the I/O is the
//! caller's (the master client connects lazily).

use kvpool_core::sched::SchedulerConfig;

use crate::engines::{Engines, RoutingProtocol};
use crate::tokenize;

/// Settings of the conductor.
#[derive(Clone, Debug)]
pub struct ConductorConfig {
    /// Model names served; empty: those the engines list on their `/v1/models`.
    pub models: Vec<String>,
    /// Base URLs (`http://host:port`) of the prefill engines.
    pub prefill: Vec<String>,
    /// Base URLs of the decode engines.
    pub decode: Vec<String>,
    /// Policy, SLOs and cost models (one prefill cost per prefill URL).
    pub scheduler: SchedulerConfig,
    /// Prefix cache capacity of each prefill engine, in blocks (mirrored here).
    pub engine_cache_blocks: usize,
    /// How prompts become token ids: a Hugging Face tokenizer, or stand-in text chunks (whose
    /// size must match the engines').
    pub tokenizer: tokenize::PromptTokenizer,
    /// The model's chat template: chat requests are rendered with it before tokenising, as the
    /// engine renders them (without one, their `role: content` lines stand in).
    pub chat_template: Option<std::sync::Arc<crate::chat::ChatTemplate>>,
    /// The pool's master, asked per request which prefix blocks the pool holds; `None`: the
    /// policy knows only the engines' local caches.
    pub pool: Option<PoolLookup>,
    /// How requests are handed to the prefill and decode engines.
    pub protocol: RoutingProtocol,
    /// Wall seconds per cost-model second of the engines (their `--time-scale`): the
    /// conductor's clock and the engines' measured KV fetch times are divided by it, so that
    /// queues, fetches and SLOs are all in the cost model's seconds.
    pub time_scale: f64,
    /// How prompt blocks are keyed: vLLM's block hashes (what the engines publish in their KV
    /// events) or kvpool's own chain.
    pub hashing: kvpool_core::sched::BlockHashing,
    /// The prefill engines' KV event streams: the conductor's index follows what they store
    /// and evict; engines without one are mirrored from the routing decisions.
    pub kv_events: Vec<KvEventSource>,
    /// Every other prefill engine (flagged or discovered) publishes on this port of its host,
    /// with replays on the next port (the operator's engine pods: vLLM's and SGLang's
    /// `--kv-events-config`).
    pub kv_events_port: Option<u16>,
    /// Fit each prefill engine's cost model from its measured prefills (the configured
    /// `scheduler.prefill_costs` are the prior); `false`: the configured models stay.
    pub fit_prefill_cost: bool,
    /// The pool of keep-alive connections to the engines.
    pub upstream: UpstreamPool,
    /// Most prompts one completions request may batch (`--max-prompts-per-request`).
    pub max_prompts: usize,
    /// Client API keys and the engines' key (`--api-key-file`, `--engine-api-key-file`).
    pub access: crate::server::Access,
}

/// Default of `--max-prompts-per-request`: a batch larger than this is refused with 400
/// before any tokenising (a 500 KB body can hold 100,000 one-token prompts).
pub const DEFAULT_MAX_PROMPTS: usize = 256;

/// How the conductor keeps idle connections to the engines: each expires after `idle_timeout`
/// unused, and at most `max_idle_per_host` stay open per engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UpstreamPool {
    pub idle_timeout: std::time::Duration,
    pub max_idle_per_host: usize,
}

impl Default for UpstreamPool {
    fn default() -> Self {
        UpstreamPool {
            idle_timeout: std::time::Duration::from_secs(30),
            max_idle_per_host: 64,
        }
    }
}

/// Where one prefill engine publishes its KV events (ZMQ, vLLM's wire format).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventSource {
    /// The engine's base URL, as in the prefill list.
    pub engine: String,
    /// Its PUB endpoint (`tcp://host:port`).
    pub endpoint: String,
    /// Its replay (ROUTER) endpoint, to recover missed batches.
    pub replay: Option<String>,
}

impl KvEventSource {
    /// The stream of prefill engine `engine` under the configuration: its `--kv-events` entry,
    /// else the `--kv-events-port` convention on its host, else none.
    pub fn of(engine: &str, explicit: &[KvEventSource], port: Option<u16>) -> Option<Self> {
        let engine = engine.trim_end_matches('/');
        if let Some(s) = explicit.iter().find(|s| s.engine == engine) {
            return Some(s.clone());
        }
        let port = port?;
        let host = crate::server::url_host(engine)?;
        Some(Self {
            engine: engine.to_owned(),
            endpoint: format!("tcp://{host}:{port}"),
            replay: port.checked_add(1).map(|r| format!("tcp://{host}:{r}")),
        })
    }

    /// Parses `ENGINE_URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]` (the `--kv-events` flag).
    pub fn parse(s: &str) -> Result<Self, String> {
        let (engine, rest) = s.split_once('=').ok_or_else(|| {
            format!("{s:?}: expected ENGINE_URL=tcp://HOST:PORT[,tcp://HOST:PORT]")
        })?;
        let mut parts = rest.split(',');
        let endpoint = parts.next().unwrap_or_default().to_owned();
        let replay = parts.next().map(str::to_owned);
        if parts.next().is_some() {
            return Err(format!("{s:?}: at most two endpoints (events, replay)"));
        }
        for e in std::iter::once(&endpoint).chain(replay.iter()) {
            if !e.starts_with("tcp://") || e.len() <= "tcp://".len() {
                return Err(format!("{s:?}: endpoint {e:?} is not tcp://HOST:PORT"));
            }
        }
        if !engine.starts_with("http://") && !engine.starts_with("https://") {
            return Err(format!("{s:?}: engine {engine:?} is not a base URL"));
        }
        Ok(Self {
            engine: engine.trim_end_matches('/').to_owned(),
            endpoint,
            replay,
        })
    }
}

/// How the conductor asks the pool's master for a request's cached prefix.
#[derive(Clone, Debug)]
pub struct PoolLookup {
    pub client: kvpool_client::master::MasterClient,
    /// Longest wait for one lookup; past it the request is placed on local knowledge only.
    pub timeout: std::time::Duration,
    /// The names the engines store blocks under (docs/engine-contract.md, "Pool keys").
    pub keys: kvpool_core::sched::PoolKeys,
    /// How this replica shares its bookings with the other conductor replicas through the
    /// master (`ShareLoad`); `None`: it books alone.
    pub share: Option<ShareLoad>,
    /// More copies of a hot prefix's blocks in the pool (`ReplicateHot`); `None`: none.
    pub hot: Option<HotPool>,
}

/// How many copies of a hot prefix's blocks the pool keeps, and for how long after its last
/// hot hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HotPool {
    pub replicas: u8,
    pub ttl: std::time::Duration,
}

/// How often a conductor replica reports its bookings to the master (and learns the other
/// replicas'), and how long a report counts (docs/adr/0010-conductor-replicas-share-bookings.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShareLoad {
    pub period: std::time::Duration,
    pub ttl: std::time::Duration,
}

impl ShareLoad {
    /// Reports every `period`; each counts for 20 periods but at least a second, so that a
    /// late report or two never makes a live replica's bookings vanish, and a replica that
    /// died stops counting soon.
    pub fn every(period: std::time::Duration) -> Self {
        ShareLoad {
            period,
            ttl: (period * 20).max(std::time::Duration::from_secs(1)),
        }
    }
}

impl ConductorConfig {
    /// Whether at least one prefill and one decode engine are configured; without them the
    /// conductor serves 503s and is not ready.
    pub fn has_engines(&self) -> bool {
        !self.prefill.is_empty() && !self.decode.is_empty()
    }

    /// Bytes of one KV block as the scheduler counts them.
    pub fn block_bytes(&self) -> u64 {
        let s = &self.scheduler;
        s.bytes_per_token
            .saturating_mul(u64::from(s.block_size.get()))
    }

    /// The engines configured at start.
    pub fn engines(&self) -> Engines {
        Engines {
            prefill: self.prefill.clone(),
            decode: self.decode.clone(),
            protocols: Default::default(),
        }
    }

    /// This configuration serving `engines` instead: one prefill cost per prefill engine (the
    /// first configured cost, or the default when none was configured).
    pub fn with_engines(&self, engines: &Engines) -> Self {
        let cost = self
            .scheduler
            .prefill_costs
            .first()
            .copied()
            .unwrap_or_default();
        let mut c = self.clone();
        c.prefill = engines.prefill.clone();
        c.decode = engines.decode.clone();
        c.scheduler.prefill_costs = vec![cost; engines.prefill.len()];
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_event_sources_parse_and_follow_the_port_convention() {
        let s =
            KvEventSource::parse("http://10.0.0.5:8000/=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558")
                .expect("valid");
        assert_eq!(s.engine, "http://10.0.0.5:8000");
        assert_eq!(s.replay.as_deref(), Some("tcp://10.0.0.5:5558"));
        for bad in [
            "tcp://h:1",
            "http://e=udp://h:1",
            "http://e=tcp://",
            "ftp://e=tcp://h:1",
            "http://e=tcp://h:1,tcp://h:2,tcp://h:3",
        ] {
            assert!(KvEventSource::parse(bad).is_err(), "{bad}");
        }
        // An explicit entry wins; otherwise the port convention on the engine's host.
        let explicit = vec![s.clone()];
        assert_eq!(
            KvEventSource::of("http://10.0.0.5:8000", &explicit, Some(6000)),
            Some(s)
        );
        let derived =
            KvEventSource::of("http://10.0.0.9:8000/", &explicit, Some(6000)).expect("port");
        assert_eq!(derived.endpoint, "tcp://10.0.0.9:6000");
        assert_eq!(derived.replay.as_deref(), Some("tcp://10.0.0.9:6001"));
        assert_eq!(
            KvEventSource::of("http://10.0.0.9:8000", &explicit, None),
            None
        );
    }
}

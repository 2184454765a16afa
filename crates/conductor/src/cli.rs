//! `kvpool conductor`: flags, validation and process wiring (runtime, signals, listeners, and
//! engine discovery when `--discover-namespace` is given).
//! I/O boundary: sockets, signals and (with discovery) the Kubernetes API.

use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Duration;

use super::PoolLookup;
use super::discovery::{self, DiscoveryConfig, DiscoveryError};
use super::server::{self, ServerError};
use super::tokenize::PromptTokenizer;
use super::{ConductorConfig, ConductorProtocol, Engines, KvEventSource, UpstreamPool};
use kvpool_client::master::{ClientConfig, MasterClient};
use kvpool_core::flags::{Bandwidth, FlagError, parse_bandwidth, parse_duration, positive};
use kvpool_core::sched::{
    BlockHashKind, DecodeCost, HotConfig, Policy, PrefillCost, Rejection, SchedulerConfig, Slo,
};
use kvpool_proto::auth::AuthKey;
use kvpool_runtime::listen::ListenArgs;
use kvpool_runtime::wiring::{self, Wired, WiringError};

/// Prefix cache of a prefill engine without a KV event stream, in tokens, when
/// `--engine-cache-blocks` is not given.
pub const DEFAULT_ENGINE_CACHE_TOKENS: u64 = 3_000_000;

/// Flags of `kvpool conductor`.
#[derive(Debug, Clone, clap::Args)]
pub struct ConductorArgs {
    /// `--listen` (the OpenAI-compatible API) and `--admin-listen`.
    #[command(flatten)]
    pub addrs: ListenArgs<ConductorArgs>,
    /// Model name served (repeat or comma-separate for several). Without it the conductor
    /// serves the names its engines list on their own `/v1/models` (vLLM's and SGLang's
    /// served model names), asked when a request or `/v1/models` needs them.
    #[arg(long, value_delimiter = ',', env = "KVPOOL_CONDUCTOR_MODEL")]
    pub model: Vec<String>,
    /// Base URL of a prefill engine (repeat the flag for each). Without prefill and decode
    /// engines the conductor starts, answers 503 and reports not ready.
    #[arg(long = "prefill")]
    pub prefill: Vec<String>,
    /// Base URL of a decode engine (repeat the flag for each).
    #[arg(long = "decode")]
    pub decode: Vec<String>,
    /// Discover the engines instead: watch the Pods of this Kubernetes namespace (in-cluster
    /// service account, or the kubeconfig) and route to the Ready ones matching
    /// --prefill-selector and --decode-selector, as they come and go.
    #[arg(
        long,
        value_name = "NAMESPACE",
        env = "KVPOOL_CONDUCTOR_DISCOVER_NAMESPACE",
        conflicts_with_all = ["prefill", "decode"]
    )]
    pub discover_namespace: Option<String>,
    /// Label selector of the prefill engine pods (with --discover-namespace).
    #[arg(
        long,
        default_value = "app.kubernetes.io/name=kvpool,kvpool.dev/component=prefill",
        requires = "discover_namespace"
    )]
    pub prefill_selector: String,
    /// Label selector of the decode engine pods (with --discover-namespace).
    #[arg(
        long,
        default_value = "app.kubernetes.io/name=kvpool,kvpool.dev/component=decode",
        requires = "discover_namespace"
    )]
    pub decode_selector: String,
    /// Port the discovered engines serve their OpenAI-compatible API on.
    #[arg(long, default_value_t = 8000, requires = "discover_namespace")]
    pub engine_port: u16,
    /// Prefill placement policy.
    #[arg(long, value_enum, default_value_t = Policy::Conductor)]
    pub policy: Policy,
    /// Early rejection mode.
    #[arg(long, value_enum, default_value_t = Rejection::Predicted)]
    pub rejection: Rejection,
    /// TTFT SLO (a duration: `30s`, `800ms`; `--ttft-slo-s` is its old spelling).
    #[arg(long, alias = "ttft-slo-s", default_value = "30s", value_parser = parse_duration)]
    pub ttft_slo: Duration,
    /// TPOT SLO (a duration: `100ms`; `--tpot-slo-s` is its old spelling).
    #[arg(long, alias = "tpot-slo-s", default_value = "100ms", value_parser = parse_duration)]
    pub tpot_slo: Duration,
    /// Tokens per KV block (must match the engines').
    #[arg(long, default_value_t = 256)]
    pub block_size: u32,
    /// Prefix cache capacity of each prefill engine, blocks; used only for engines without a
    /// KV event stream (the conductor then mirrors their cache by what it routed to them).
    /// Default: 3,000,000 tokens' worth of blocks of --block-size (11,718 blocks of 256
    /// tokens, 187,500 of 16).
    #[arg(long)]
    pub engine_cache_blocks: Option<usize>,
    /// Bytes of prompt text per stand-in token (must match the engines').
    #[arg(long, default_value_t = 4)]
    pub chunk_bytes: usize,
    /// Copy a hot prefix to more prefill engines every this many hits on one of its blocks
    /// (0: off): with --master the pool keeps more copies of its blocks (--hot-pool-replicas),
    /// and engines that can prefetch are asked to load it.
    #[arg(long, default_value_t = 32)]
    pub hot_threshold: u32,
    /// Prefill engines a hot prefix is copied to each time.
    #[arg(long, default_value_t = 2)]
    pub hot_fanout: usize,
    /// The served model's files and the KV bytes per token (`--model-dir`, `--tokenizer`,
    /// `--chat-template`, `--kv-bytes-per-token`).
    #[command(flatten)]
    pub model_files: crate::model_flags::ModelArgs,
    /// Prefill -> decode KV transfer rate (`25GB/s`, `200Gbit/s`; a bare number is GB/s, as
    /// its old spelling `--kv-bandwidth-gbps` read it).
    #[arg(long, alias = "kv-bandwidth-gbps", default_value = "25GB/s", value_parser = parse_bandwidth)]
    pub kv_bandwidth: Bandwidth,
    /// KV tokens one decode instance holds.
    #[arg(long, default_value_t = 1_500_000)]
    pub decode_kv_capacity_tokens: u64,
    /// The pool's master (`host:port`; comma separated or repeated for several): every request
    /// asks it which of the prompt's leading blocks the pool holds, and the policy counts those
    /// as fetched at --pool-bandwidth instead of prefilled. Without it the policy knows
    /// only the engines' local caches.
    #[arg(long, env = "KVPOOL_MASTER", value_delimiter = ',')]
    pub master: Vec<String>,
    /// File holding the pool's shared key (with --master).
    #[arg(long, env = "KVPOOL_AUTH_KEY_FILE")]
    pub auth_key_file: Option<std::path::PathBuf>,
    /// Longest wait for the master's answer; past it the request is placed on the local
    /// caches alone (counted in kvpool_conductor_pool_lookups_total{outcome="timeout"}).
    #[arg(long, default_value = "100ms", value_parser = kvpool_core::flags::parse_duration)]
    pub pool_lookup_timeout: std::time::Duration,
    /// Bookings shared with the other replicas, hot prefixes copied in the pool.
    #[command(flatten)]
    pub master_share: crate::master_flags::MasterShareArgs,
    /// TLS to the master (`--master-ca-file` and the like).
    #[command(flatten)]
    pub master_tls: kvpool_client::master::MasterTlsArgs,
    /// Pool -> prefill engine rate (`25GB/s`; a bare number is GB/s, as its old spelling
    /// `--pool-bandwidth-gbps` read it): the fetch term of the TTFT estimate until the prefill
    /// engines report measured pool reads (`x-kvpool-kv-load-*` response headers), whose
    /// moving average replaces it.
    #[arg(long, alias = "pool-bandwidth-gbps", default_value = "25GB/s", value_parser = parse_bandwidth)]
    pub pool_bandwidth: Bandwidth,
    /// Disaggregation convention of the engines: `vllm` (prefill, then decode with the
    /// returned `kv_transfer_params`: kvpool's and vLLM's NIXL-style connectors),
    /// `vllm-mooncake` (vLLM's MooncakeConnector: prefill, then decode told the prefill
    /// instance's engine id and bootstrap server, paired by a transfer id) or `sglang` (both at
    /// once, paired by a bootstrap room).
    #[arg(long, value_enum, default_value_t = ConductorProtocol::Vllm,
        env = "KVPOOL_ENGINE_PROTOCOL")]
    pub engine_protocol: ConductorProtocol,
    /// With --engine-protocol sglang or vllm-mooncake: the prefill engines' bootstrap port
    /// (SGLang's --disaggregation-bootstrap-port, vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT; both
    /// default to 8998).
    #[arg(long, default_value_t = 8998, env = "KVPOOL_BOOTSTRAP_PORT")]
    pub bootstrap_port: u16,
    /// Wall seconds per cost-model second of the engines (their --time-scale; 1 for real
    /// engines): the conductor's clock and the engines' measured fetch times are divided by it.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// How prompt blocks are keyed: `vllm` (vLLM's sha256_cbor block hashes, full blocks only:
    /// what vLLM engines publish in their KV events, with `--prefix-caching-hash-algo
    /// sha256_cbor` and the same PYTHONHASHSEED) or `kvpool` (kvpool's own xxh3 chain).
    #[arg(long, value_enum, default_value_t = BlockHashKind::Vllm, env = "KVPOOL_BLOCK_HASH")]
    pub block_hash: BlockHashKind,
    /// The engines' PYTHONHASHSEED (with --block-hash vllm).
    #[arg(long, env = "PYTHONHASHSEED", default_value = "0")]
    pub hash_seed: String,
    /// A prefill engine's KV event stream, `ENGINE_URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]`
    /// (repeat per engine): the index follows what it stores and evicts instead of guessing.
    #[arg(long, value_parser = KvEventSource::parse)]
    pub kv_events: Vec<KvEventSource>,
    /// Every prefill engine without a --kv-events entry (discovered ones included) publishes
    /// its KV events on this port of its host, and answers replays on the next one.
    #[arg(long, env = "KVPOOL_KV_EVENTS_PORT")]
    pub kv_events_port: Option<u16>,
    /// The prefill engines' cost model, `FIXED_S,LINEAR_S,QUADRATIC_S`: seconds to prefill `n`
    /// uncached prompt tokens = FIXED_S + LINEAR_S * n + QUADRATIC_S * n^2 (cost-model seconds,
    /// see --time-scale). The prior of the fit (--fit-prefill-cost); default: the 70B-class
    /// model of docs/scheduling.md.
    #[arg(long, value_name = "FIXED_S,LINEAR_S,QUADRATIC_S", value_parser = parse_prefill_cost,
        default_value = "0.02,0.00011,0.000000001")]
    pub prefill_cost: PrefillCost,
    /// Fit each prefill engine's cost model from its measured prefills (the wall time of the
    /// prefill call of requests that found the engine idle, divided by --time-scale, less the
    /// pool read the engine reports); the fit replaces --prefill-cost once 8 prefills of 3
    /// distinct sizes were measured. Shown on GET /v1/kvpool/status and in /metrics.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub fit_prefill_cost: bool,
    /// The pool key contract (`--pool-keys` and the engines' settings it needs).
    #[command(flatten)]
    pub keys: crate::pool_flags::PoolKeyArgs,
    /// Idle keep-alive connections to an engine are closed after this long unused.
    #[arg(long, default_value = "30s", value_parser = kvpool_core::flags::parse_duration,
        env = "KVPOOL_UPSTREAM_IDLE_TIMEOUT")]
    pub upstream_idle_timeout: std::time::Duration,
    /// Idle keep-alive connections kept open per engine at most.
    #[arg(long, default_value_t = 64, env = "KVPOOL_UPSTREAM_MAX_IDLE_PER_HOST")]
    pub upstream_max_idle_per_host: usize,
    /// Most prompts one completions request may batch; more is refused with 400 naming the
    /// limit, before any tokenising.
    #[arg(long, default_value_t = crate::config::DEFAULT_MAX_PROMPTS,
        env = "KVPOOL_MAX_PROMPTS_PER_REQUEST")]
    pub max_prompts_per_request: usize,
    /// Client API keys, one per line (blank lines and `#` comments skipped): every request
    /// but `/health` and `/v1/kvpool/load` must carry one as `Authorization: Bearer <key>`,
    /// else 401. Unset: no key is asked for.
    #[arg(long, value_name = "FILE", env = "KVPOOL_CONDUCTOR_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// The key the engines expect (their `--api-key`), sent as `Authorization: Bearer` on every
    /// call to them. Unset: a client's own `Authorization` goes to the engines with its request.
    #[arg(long, value_name = "FILE", env = "KVPOOL_ENGINE_API_KEY_FILE")]
    pub engine_api_key_file: Option<PathBuf>,
}

/// `FIXED_S,LINEAR_S,QUADRATIC_S` (each finite and >= 0).
fn parse_prefill_cost(s: &str) -> Result<PrefillCost, String> {
    let terms: Vec<f64> = s
        .split(',')
        .map(|t| t.trim().parse::<f64>().map_err(|e| format!("{t:?}: {e}")))
        .collect::<Result<_, _>>()?;
    let [fixed_s, linear_s, quadratic_s] = terms[..] else {
        return Err(format!("{s:?}: expected FIXED_S,LINEAR_S,QUADRATIC_S"));
    };
    if terms.iter().any(|t| !t.is_finite() || *t < 0.0) {
        return Err(format!("{s:?}: every term must be finite and >= 0"));
    }
    Ok(PrefillCost {
        fixed_s,
        linear_s,
        quadratic_s,
    })
}

pub use crate::model_flags::ENGINE_TOKENIZER;

// The defaults of `--listen` and `--admin-listen`; the variables follow from the role name.
kvpool_runtime::listen_defaults!(
    ConductorArgs,
    "CONDUCTOR",
    "127.0.0.1:8080",
    "127.0.0.1:9101"
);

/// Errors of `kvpool conductor`.
#[derive(Debug, thiserror::Error)]
pub enum ConductorError {
    #[error(transparent)]
    Flag(#[from] FlagError),
    #[error("process wiring")]
    Wiring(#[from] WiringError),
    #[error("conductor server")]
    Server(#[source] ServerError),
    #[error("engine discovery")]
    Discovery(#[source] DiscoveryError),
}

impl ConductorError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        match self {
            ConductorError::Flag(_) => "flag",
            ConductorError::Wiring(e) => e.category(),
            ConductorError::Server(_) => "server",
            ConductorError::Discovery(_) => "discovery",
        }
    }
}

pub(crate) fn flag(flag: &'static str, problem: impl Into<String>) -> ConductorError {
    FlagError::new(flag, problem).into()
}

/// The upstream connection pool of the flags.
fn upstream_pool(args: &ConductorArgs) -> Result<UpstreamPool, ConductorError> {
    if args.upstream_idle_timeout.is_zero() {
        return Err(flag("upstream-idle-timeout", "must be > 0"));
    }
    Ok(UpstreamPool {
        idle_timeout: args.upstream_idle_timeout,
        max_idle_per_host: args.upstream_max_idle_per_host,
    })
}

/// The discovery settings of the flags, `None` without `--discover-namespace`.
pub fn discovery_config(args: &ConductorArgs) -> Result<Option<DiscoveryConfig>, ConductorError> {
    let Some(namespace) = &args.discover_namespace else {
        return Ok(None);
    };
    discovery::supported().map_err(|why| flag("discover-namespace", why))?;
    if namespace.is_empty() {
        return Err(flag("discover-namespace", "must not be empty"));
    }
    for (name, selector) in [
        ("prefill-selector", &args.prefill_selector),
        ("decode-selector", &args.decode_selector),
    ] {
        if selector.trim().is_empty() {
            return Err(flag(name, "must not be empty (it would select every pod)"));
        }
    }
    if args.prefill_selector == args.decode_selector {
        return Err(flag(
            "decode-selector",
            "must differ from --prefill-selector (a pod cannot be both)",
        ));
    }
    if args.engine_port == 0 {
        return Err(flag("engine-port", "must be a port number 1-65535"));
    }
    Ok(Some(DiscoveryConfig {
        namespace: namespace.clone(),
        prefill_selector: args.prefill_selector.clone(),
        decode_selector: args.decode_selector.clone(),
        engine_port: args.engine_port,
    }))
}

/// Validates the flags.
pub fn conductor_config(args: &ConductorArgs) -> Result<ConductorConfig, ConductorError> {
    for (name, urls) in [("prefill", &args.prefill), ("decode", &args.decode)] {
        for url in urls {
            if !url.starts_with("http://") {
                return Err(flag(
                    if name == "prefill" {
                        "prefill"
                    } else {
                        "decode"
                    },
                    format!("`{url}` must be an http:// base URL"),
                ));
            }
        }
    }
    if args.prefill.len() > kvpool_core::sched::index::MAX_PREFILL_INSTANCES {
        return Err(flag(
            "prefill",
            format!(
                "at most {} instances",
                kvpool_core::sched::index::MAX_PREFILL_INSTANCES
            ),
        ));
    }
    if args.rejection == Rejection::AtDecode {
        return Err(flag(
            "rejection",
            "at-decode is a simulator baseline; the conductor rejects at arrival (none, early or predicted)",
        ));
    }
    if args.chunk_bytes == 0 {
        return Err(flag("chunk-bytes", "must be at least 1"));
    }
    if let Some(m) = args.model.iter().find(|m| m.is_empty()) {
        return Err(flag(
            "model",
            format!("{m:?}: a model name cannot be empty"),
        ));
    }
    Ok(ConductorConfig {
        models: args.model.clone(),
        prefill: args.prefill.clone(),
        decode: args.decode.clone(),
        scheduler: SchedulerConfig {
            policy: args.policy,
            rejection: args.rejection,
            slo: Slo::from_flags(args.ttft_slo, args.tpot_slo)?,
            block_size: NonZeroU32::new(args.block_size)
                .ok_or_else(|| flag("block-size", "must be at least 1"))?,
            bytes_per_token: crate::model_flags::kv_bytes_per_token(&args.model_files, &args.keys)?
                .0,
            pool_bandwidth_bps: args.pool_bandwidth.bytes_per_s(),
            kv_bandwidth_bps: args.kv_bandwidth.bytes_per_s(),
            prefill_costs: vec![args.prefill_cost; args.prefill.len()],
            decode_cost: DecodeCost::default(),
            handoff: Default::default(),
            decode_kv_capacity_tokens: args.decode_kv_capacity_tokens.max(1),
            hot: HotConfig {
                threshold: args.hot_threshold,
                fanout: args.hot_fanout,
            },
            seed: 1,
        },
        engine_cache_blocks: args.engine_cache_blocks.unwrap_or_else(|| {
            usize::try_from(DEFAULT_ENGINE_CACHE_TOKENS.div_ceil(u64::from(args.block_size.max(1))))
                .unwrap_or(usize::MAX)
        }),
        chat_template: chat_template(args)?,
        tokenizer: match crate::model_flags::tokenizer_path(&args.model_files) {
            Some(path) if path.as_os_str() == ENGINE_TOKENIZER => PromptTokenizer::Engine {
                bytes: args.chunk_bytes,
            },
            Some(path) => PromptTokenizer::from_path(path)
                .map_err(|e| flag("tokenizer", format!("{e}: {}", source_chain(&e))))?,
            None => PromptTokenizer::Chunks {
                bytes: args.chunk_bytes,
            },
        },
        pool: pool_lookup(args)?,
        protocol: args.engine_protocol.routing(args.bootstrap_port),
        time_scale: positive("time-scale", args.time_scale)?,
        hashing: args.block_hash.hashing(&args.hash_seed),
        kv_events: kv_events(args)?,
        kv_events_port: args.kv_events_port,
        fit_prefill_cost: args.fit_prefill_cost,
        upstream: upstream_pool(args)?,
        max_prompts: match args.max_prompts_per_request {
            0 => return Err(flag("max-prompts-per-request", "must be at least 1")),
            n => n,
        },
        access: access(args)?,
    })
}

/// `--api-key-file` and `--engine-api-key-file`, read now (see `server::Access::read`).
fn access(args: &ConductorArgs) -> Result<crate::server::Access, ConductorError> {
    crate::server::Access::read(
        args.api_key_file.as_deref(),
        args.engine_api_key_file.as_deref(),
    )
    .map_err(|(name, why)| flag(name, why))
}

/// `--kv-events`, each naming one of the prefill engines.
fn kv_events(args: &ConductorArgs) -> Result<Vec<KvEventSource>, ConductorError> {
    for s in &args.kv_events {
        let known = args
            .prefill
            .iter()
            .any(|u| u.trim_end_matches('/') == s.engine);
        if !known && args.discover_namespace.is_none() {
            return Err(flag(
                "kv-events",
                format!("{} is not one of the --prefill engines", s.engine),
            ));
        }
    }
    Ok(args.kv_events.clone())
}

/// The chat template of `--chat-template`, else of the `--tokenizer` model directory.
fn chat_template(
    args: &ConductorArgs,
) -> Result<Option<std::sync::Arc<crate::chat::ChatTemplate>>, ConductorError> {
    let dir = crate::model_flags::tokenizer_path(&args.model_files).filter(|p| p.is_dir());
    crate::chat::ChatTemplate::load(args.model_files.chat_template.as_deref(), dir)
        .map(|t| t.map(std::sync::Arc::new))
        .map_err(|e| {
            let name = if args.model_files.chat_template.is_some() {
                "chat-template"
            } else {
                "tokenizer"
            };
            flag(name, format!("{e}: {}", source_chain(&e)))
        })
}

/// The master connection of the flags, `None` without `--master`. Connects lazily: a master
/// that is down at start only makes the lookups fail (and fall back) until it is up.
fn pool_lookup(args: &ConductorArgs) -> Result<Option<PoolLookup>, ConductorError> {
    let endpoints: Vec<String> = args
        .master
        .iter()
        .map(|m| m.trim().to_owned())
        .filter(|m| !m.is_empty())
        .collect();
    if endpoints.is_empty() {
        if args.auth_key_file.is_some() && !args.master.is_empty() {
            return Err(flag("master", "must name at least one host:port"));
        }
        return Ok(None);
    }
    let Some(key_file) = &args.auth_key_file else {
        return Err(flag(
            "auth-key-file",
            "is required with --master (the pool's shared key)",
        ));
    };
    let key = AuthKey::from_file(key_file).map_err(|e| {
        flag(
            "auth-key-file",
            format!("{}: {e}: {}", key_file.display(), source_chain(&e)),
        )
    })?;
    let timeout = args.pool_lookup_timeout;
    if timeout.is_zero() {
        return Err(flag("pool-lookup-timeout", "must be more than 0"));
    }
    let (share, hot) = crate::master_flags::settings(&args.master_share, args.hot_fanout)?;
    let client = MasterClient::new(
        endpoints,
        key,
        ClientConfig {
            connect_timeout: timeout,
            request_timeout: timeout,
            // A standby's leader hint is followed, but only within the lookup's own timeout:
            // past it the request goes on without the pool's answer.
            failover_budget: timeout,
            tls: args.master_tls.tls(),
            ..Default::default()
        },
    )
    .map_err(|e| flag("master", format!("{e}: {}", source_chain(&e))))?;
    Ok(Some(PoolLookup {
        client,
        timeout,
        keys: crate::pool_flags::pool_keys(
            &args.keys,
            args.block_size,
            args.block_hash,
            crate::model_flags::model_dir(&args.model_files, &args.keys),
        )?,
        share,
        hot,
    }))
}

/// The messages of `err`'s sources, outermost first.
pub(crate) fn source_chain(err: &dyn std::error::Error) -> String {
    let mut parts = Vec::new();
    let mut cur = err.source();
    while let Some(e) = cur {
        parts.push(e.to_string());
        cur = e.source();
    }
    parts.join(": ")
}

/// Entry point of `kvpool conductor`: serves until SIGTERM or SIGINT.
pub fn run(args: &ConductorArgs) -> Result<(), ConductorError> {
    let config = conductor_config(args)?;
    let discovery = discovery_config(args)?;
    let listening = args.addrs.listening().map_err(|(f, p)| flag(f, p))?;
    let s = &config.scheduler;
    let (_, kv_source) = crate::model_flags::kv_bytes_per_token(&args.model_files, &args.keys)?;
    tracing::info!(
        listen = %args.addrs.listen,
        admin = %args.addrs.admin_listen,
        models = ?config.models,
        prefill = config.prefill.len(),
        decode = config.decode.len(),
        discover_namespace = discovery.as_ref().map(|d| d.namespace.as_str()),
        policy = s.policy.name(),
        rejection = s.rejection.name(),
        ttft_slo_s = s.slo.ttft_s,
        tpot_slo_s = s.slo.tpot_s,
        block_size = s.block_size.get(),
        kv_bytes_per_token = s.bytes_per_token,
        kv_bytes_from = match &kv_source {
            crate::model_flags::KvBytesSource::ModelConfig(d) => d.display().to_string(),
            other => other.name().to_owned(),
        },
        tokenizer = match &config.tokenizer {
            PromptTokenizer::Chunks { .. } => "stand-in chunks",
            PromptTokenizer::HuggingFace(_) => "hugging face",
            PromptTokenizer::Engine { .. } => "the engines' /tokenize",
        },
        chat_template = config.chat_template.is_some(),
        pool_lookup = config.pool.is_some(),
        protocol = config.protocol.name(),
        kv_event_streams = config.kv_events.len(),
        time_scale = config.time_scale,
        "starting conductor"
    );
    let has_engines = config.has_engines();
    let setup = |wired: Wired| async move {
        server::conductor(config, &wired.registry).map_err(ConductorError::Server)
    };
    let serve = |conductor: server::Conductor, listener, wired: Wired| async move {
        conductor.engines.follow_kv_events(&wired.shutdown);
        conductor.engines.share_load(&wired.shutdown);
        if let Some(discovery) = discovery {
            let client = discovery::client()
                .await
                .map_err(ConductorError::Discovery)?;
            let (tx, rx) = tokio::sync::watch::channel(Engines::default());
            tokio::spawn(discovery::run(
                client,
                discovery,
                tx,
                wired.shutdown.clone(),
            ));
            tokio::spawn(conductor.engines.follow(
                rx,
                wired.readiness.clone(),
                wired.shutdown.clone(),
            ));
        } else if has_engines {
            wired.readiness.set_ready(true);
        } else {
            tracing::warn!(
                "no --prefill/--decode engines and no --discover-namespace: answering 503 and \
                 staying not ready until restarted with engines"
            );
        }
        wired
            .serve(listener, conductor.router)
            .await
            .map_err(|e| ConductorError::Server(ServerError::Serve(e)))
    };
    wiring::run(listening, setup, serve)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct T {
        #[command(flatten)]
        a: ConductorArgs,
    }

    #[test]
    #[cfg(not(feature = "kube"))]
    fn discovery_is_refused_without_the_kube_feature() {
        let a = T::try_parse_from(["t", "--discover-namespace", "llm"]).unwrap();
        let err = discovery_config(&a.a).unwrap_err().to_string();
        assert!(err.starts_with("--discover-namespace: "), "{err}");
        assert!(err.contains("rebuild with --features k8s"), "{err}");
    }

    #[test]
    #[cfg(feature = "kube")]
    fn discovery_flags_parse_validate_and_exclude_static_engines() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["t"];
            argv.extend_from_slice(extra);
            T::try_parse_from(argv)
        };
        let a = parse(&[
            "--discover-namespace",
            "llm",
            "--prefill-selector",
            "kvpool.dev/pool=cache,kvpool.dev/component=prefill",
            "--engine-port",
            "8001",
        ])
        .unwrap()
        .a;
        let d = discovery_config(&a).unwrap().expect("discovery on");
        assert_eq!(d.namespace, "llm");
        assert_eq!(
            d.prefill_selector,
            "kvpool.dev/pool=cache,kvpool.dev/component=prefill"
        );
        assert_eq!(
            d.decode_selector,
            "app.kubernetes.io/name=kvpool,kvpool.dev/component=decode"
        );
        assert_eq!(d.engine_port, 8001);
        // Without the namespace: no discovery, and its flags are refused.
        assert_eq!(discovery_config(&parse(&[]).unwrap().a).unwrap(), None);
        assert!(parse(&["--engine-port", "8001"]).is_err());
        // Static engines and discovery exclude each other.
        assert!(parse(&["--discover-namespace", "llm", "--prefill", "http://a"]).is_err());
        // Same selector twice, an empty one, port 0: named.
        let same = parse(&[
            "--discover-namespace",
            "llm",
            "--prefill-selector",
            "a=b",
            "--decode-selector",
            "a=b",
        ])
        .unwrap()
        .a;
        let err = discovery_config(&same).unwrap_err().to_string();
        assert!(err.starts_with("--decode-selector:"), "{err}");
        let empty = parse(&["--discover-namespace", "llm", "--prefill-selector", " "])
            .unwrap()
            .a;
        let err = discovery_config(&empty).unwrap_err().to_string();
        assert!(err.starts_with("--prefill-selector:"), "{err}");
        let port = parse(&["--discover-namespace", "llm", "--engine-port", "0"])
            .unwrap()
            .a;
        let err = discovery_config(&port).unwrap_err().to_string();
        assert!(err.starts_with("--engine-port:"), "{err}");
    }

    #[test]
    fn flags_validate_and_name_the_bad_one() {
        let ok = T::try_parse_from([
            "t",
            "--prefill",
            "http://127.0.0.1:1",
            "--prefill",
            "http://127.0.0.1:2",
            "--decode",
            "http://127.0.0.1:3",
        ])
        .unwrap();
        let c = conductor_config(&ok.a).unwrap();
        assert_eq!(c.scheduler.prefill_costs.len(), 2);
        assert_eq!(c.scheduler.rejection, Rejection::Predicted);
        // The prior's default is the model's default, and the fit is on by default.
        assert_eq!(c.scheduler.prefill_costs[0], PrefillCost::default());
        assert!(c.fit_prefill_cost);
        // The mirror's capacity follows the block size unless given: 3M tokens' worth.
        assert_eq!(c.engine_cache_blocks, 11_719);
        let small = T::try_parse_from(["t", "--block-size", "16"]).unwrap();
        assert_eq!(
            conductor_config(&small.a).unwrap().engine_cache_blocks,
            187_500
        );
        let given = T::try_parse_from(["t", "--block-size", "16", "--engine-cache-blocks", "7"]);
        assert_eq!(
            conductor_config(&given.unwrap().a)
                .unwrap()
                .engine_cache_blocks,
            7
        );
        let profiled = T::try_parse_from([
            "t",
            "--prefill",
            "http://a",
            "--decode",
            "http://b",
            "--prefill-cost",
            "0.1, 5e-4,2e-8",
            "--fit-prefill-cost",
            "false",
        ])
        .unwrap();
        let p = conductor_config(&profiled.a).unwrap();
        assert_eq!(
            p.scheduler.prefill_costs,
            vec![PrefillCost {
                fixed_s: 0.1,
                linear_s: 5e-4,
                quadratic_s: 2e-8
            }]
        );
        assert!(!p.fit_prefill_cost);
        for bad in ["1,2", "1,2,3,4", "1,-2,3", "1,x,3", "1,nan,3"] {
            assert!(
                T::try_parse_from(["t", "--prefill-cost", bad]).is_err(),
                "{bad}"
            );
        }
        let bad =
            T::try_parse_from(["t", "--prefill", "127.0.0.1:1", "--decode", "http://x"]).unwrap();
        let err = conductor_config(&bad.a).unwrap_err();
        assert!(
            err.to_string().starts_with("--prefill: `127.0.0.1:1`"),
            "{err}"
        );
        let bad = T::try_parse_from([
            "t",
            "--prefill",
            "http://a",
            "--decode",
            "http://b",
            "--ttft-slo",
            "0s",
        ])
        .unwrap();
        assert!(
            conductor_config(&bad.a)
                .unwrap_err()
                .to_string()
                .starts_with("--ttft-slo")
        );
        let none = conductor_config(&T::try_parse_from(["t"]).unwrap().a).unwrap();
        assert!(!none.has_engines());
        let half =
            conductor_config(&T::try_parse_from(["t", "--decode", "http://b"]).unwrap().a).unwrap();
        assert!(!half.has_engines());
        assert!(c.has_engines());
    }

    #[test]
    fn tokenizer_flag_loads_the_file_or_names_it() {
        let base = ["t", "--prefill", "http://a", "--decode", "http://b"];
        let c = conductor_config(&T::try_parse_from(base).unwrap().a).unwrap();
        assert_eq!(c.tokenizer.kind(), "chunks");
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing-tokenizer.json");
        let mut args = base.map(String::from).to_vec();
        args.extend(["--tokenizer".into(), missing.display().to_string()]);
        let err = conductor_config(&T::try_parse_from(&args).unwrap().a).unwrap_err();
        let msg = err.to_string();
        assert!(msg.starts_with("--tokenizer: "), "{msg}");
        assert!(msg.contains("missing-tokenizer.json"), "{msg}");
        let file = dir.path().join("tokenizer.json");
        std::fs::write(
            &file,
            br#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,"model":{"type":"WordLevel","vocab":{"[UNK]":0,"hi":1},"unk_token":"[UNK]"}}"#,
        )
        .unwrap();
        let args: Vec<String> = base
            .iter()
            .map(|s| s.to_string())
            .chain(["--tokenizer".into(), file.display().to_string()])
            .collect();
        let c = conductor_config(&T::try_parse_from(&args).unwrap().a).unwrap();
        assert_eq!(c.tokenizer.kind(), "huggingface");
        assert_eq!(c.tokenizer.tokens("hi there hi").unwrap(), vec![1, 0, 1]);
    }

    #[test]
    fn master_flags_need_a_readable_key_and_a_positive_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key");
        std::fs::write(&key, b"kvpool-test-pool-key-0123456789").unwrap();
        let key = key.to_str().unwrap().to_owned();
        let base = ["t", "--prefill", "http://a", "--decode", "http://b"];
        let with = |extra: &[&str]| {
            let mut argv: Vec<&str> = base.to_vec();
            argv.extend_from_slice(extra);
            conductor_config(&T::try_parse_from(argv).unwrap().a)
        };
        let c = with(&[
            "--master",
            "127.0.0.1:1,127.0.0.1:2",
            "--auth-key-file",
            &key,
        ])
        .unwrap();
        let pool = c.pool.expect("a pool lookup");
        assert_eq!(pool.timeout, std::time::Duration::from_millis(100));
        let c = with(&[
            "--master",
            "127.0.0.1:1",
            "--auth-key-file",
            &key,
            "--pool-lookup-timeout",
            "250ms",
            "--pool-bandwidth",
            "10",
        ])
        .unwrap();
        assert_eq!(
            c.pool.map(|p| p.timeout),
            Some(std::time::Duration::from_millis(250))
        );
        assert!((c.scheduler.pool_bandwidth_bps - 10e9).abs() < 1.0);
        let name = |extra: &[&str]| match with(extra) {
            Err(ConductorError::Flag(FlagError { flag, .. })) => flag,
            other => panic!("{extra:?}: {other:?}"),
        };
        assert_eq!(name(&["--master", "127.0.0.1:1"]), "auth-key-file");
        assert_eq!(
            name(&[
                "--master",
                "127.0.0.1:1",
                "--auth-key-file",
                "/nonexistent/key"
            ]),
            "auth-key-file"
        );
        assert_eq!(
            name(&[
                "--master",
                "127.0.0.1:1",
                "--auth-key-file",
                &key,
                "--pool-lookup-timeout",
                "0s"
            ]),
            "pool-lookup-timeout"
        );
        assert!(T::try_parse_from(["t", "--pool-bandwidth", "0"]).is_err());
    }
}

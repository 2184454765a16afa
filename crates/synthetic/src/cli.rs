//! `kvpool engine --synthetic`: flags of the synthetic engine and its process wiring (Tokio
//! runtime, signals, engine and admin listeners, the node agent's session). I/O boundary:
//! sockets, signals and the model config file.

pub use kvpool_proto::openai::EngineProtocol;
use std::num::NonZeroU32;
use std::path::PathBuf;

use super::agent::{AgentKv, AgentKvError};
use super::kv::{self, KvError, KvGeometry};
use super::server::{self, ServerError};
use super::{EngineConfig, SglangMode, SglangRole};
use kvpool_core::flags::{FlagError, non_negative};
use kvpool_core::sched::{BlockHashKind, CostFlags};
use kvpool_runtime::listen::ListenArgs;
use kvpool_runtime::wiring::{self, Wired, WiringError};

/// Flags of `kvpool engine`.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// Run the synthetic engine (timing from the cost model, no GPU). The only mode so far.
    #[arg(long)]
    pub synthetic: bool,
    /// `--listen` (the OpenAI-compatible API) and `--admin-listen`.
    #[command(flatten)]
    pub addrs: ListenArgs<EngineArgs>,
    /// Model name served.
    #[arg(long, default_value = "kvpool-synthetic")]
    pub model: String,
    /// Tokens per KV block (the pool's block size where the operator starts the engine).
    #[arg(long, default_value_t = 256, env = "KVPOOL_BLOCK_SIZE_TOKENS")]
    pub block_size: u32,
    /// Prefix cache capacity, blocks.
    #[arg(long, default_value_t = 11_718)]
    pub cache_blocks: usize,
    /// Bytes of prompt text per stand-in token (no tokenizer configured).
    #[arg(long, default_value_t = 4)]
    pub chunk_bytes: usize,
    /// Multiply every modelled duration by this (0.001 runs 1000x faster).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    #[command(flatten)]
    pub cost: CostFlags,
    /// Node agent's engine-API socket: keep real KV blocks in the pool through it. Without it
    /// the engine keeps no KV bytes (only its prefix cache's bookkeeping).
    #[arg(long, env = "KVPOOL_AGENT_SOCKET")]
    pub agent_socket: Option<PathBuf>,
    /// KV bytes per token (all layers), before --kv-scale.
    #[arg(long, env = "KVPOOL_KV_BYTES_PER_TOKEN")]
    pub kv_bytes_per_token: Option<u64>,
    /// Hugging Face model config.json: KV bytes per token = 2 x layers x KV heads x head dim x
    /// dtype bytes, before --kv-scale. Wins over --kv-bytes-per-token.
    #[arg(long, env = "KVPOOL_MODEL_CONFIG")]
    pub model_config: Option<PathBuf>,
    /// Multiply the KV bytes per token by this (e.g. 0.001 keeps a 70B model's blocks small in
    /// tests).
    #[arg(long, default_value_t = 1.0)]
    pub kv_scale: f64,
    /// Disaggregation protocol: `vllm` (each request's `kv_transfer_params` names its role) or
    /// `sglang` (this engine has one role, --disaggregation-mode, and requests carry a
    /// `bootstrap_room`; the KV hand-off goes through the pool, so --agent-socket is needed).
    #[arg(long, value_enum, default_value_t = EngineProtocol::Vllm, env = "KVPOOL_ENGINE_PROTOCOL")]
    pub protocol: EngineProtocol,
    /// With --protocol sglang: this engine's half (SGLang's flag of the same name).
    #[arg(long, value_enum, env = "KVPOOL_DISAGGREGATION_MODE")]
    pub disaggregation_mode: Option<SglangRole>,
    /// With --protocol sglang, on a decode engine: longest wait for a room's KV to arrive.
    #[arg(long, default_value = "30s", value_parser = kvpool_core::flags::parse_duration)]
    pub bootstrap_timeout: std::time::Duration,
    /// How prompt blocks are keyed: `vllm` (vLLM's sha256_cbor block hashes, full blocks
    /// only) or `kvpool` (kvpool's own xxh3 chain); the conductor must use the same.
    #[arg(long, value_enum, default_value_t = BlockHashKind::Vllm, env = "KVPOOL_BLOCK_HASH")]
    pub block_hash: BlockHashKind,
    /// PYTHONHASHSEED of the block hashes (with --block-hash vllm).
    #[arg(long, env = "PYTHONHASHSEED", default_value = "0")]
    pub hash_seed: String,
    /// vLLM's `--kv-events-config` JSON: with `"enable_kv_cache_events": true` the engine
    /// publishes its prefix cache's stored and removed blocks on ZMQ (`endpoint`, and
    /// `replay_endpoint` for replays), in vLLM's wire format.
    #[arg(long, env = "KVPOOL_KV_EVENTS_CONFIG")]
    pub kv_events_config: Option<String>,
}

// The defaults of `--listen` and `--admin-listen`; the variables follow from the role name.
kvpool_runtime::listen_defaults!(EngineArgs, "ENGINE", "127.0.0.1:8000", "127.0.0.1:9100");

/// Errors of `kvpool engine`.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Flag(#[from] FlagError),
    #[error("process wiring")]
    Wiring(#[from] WiringError),
    #[error("engine server")]
    Server(#[source] ServerError),
    #[error("cannot read --model-config {path}")]
    ModelConfigRead {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--model-config {path}")]
    ModelConfig {
        path: PathBuf,
        #[source]
        source: KvError,
    },
    #[error("--kv-scale")]
    KvScale(#[source] KvError),
    #[error("node agent at {path}")]
    Agent {
        path: PathBuf,
        #[source]
        source: AgentKvError,
    },
}

impl EngineError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        match self {
            EngineError::Flag(_) => "flag",
            EngineError::Wiring(e) => e.category(),
            EngineError::Server(_) => "server",
            EngineError::ModelConfigRead { .. } => "model_config_read",
            EngineError::ModelConfig { .. } => "model_config",
            EngineError::KvScale(_) => "kv_scale",
            EngineError::Agent { .. } => "agent",
        }
    }
}

fn flag(flag: &'static str, problem: impl Into<String>) -> EngineError {
    FlagError::new(flag, problem).into()
}

/// Validates the flags.
pub fn engine_config(args: &EngineArgs) -> Result<EngineConfig, EngineError> {
    if !args.synthetic {
        return Err(flag(
            "synthetic",
            "is required: only the synthetic engine is implemented",
        ));
    }
    if args.model.is_empty() {
        return Err(flag("model", "must not be empty"));
    }
    if args.chunk_bytes == 0 {
        return Err(flag("chunk-bytes", "must be at least 1"));
    }
    let time_scale = non_negative("time-scale", args.time_scale)?;
    let sglang = match (args.protocol, args.disaggregation_mode) {
        (EngineProtocol::Vllm, None) => None,
        (EngineProtocol::Vllm, Some(_)) => {
            return Err(flag(
                "disaggregation-mode",
                "applies to --protocol sglang only (vLLM requests name their role)",
            ));
        }
        (EngineProtocol::Sglang, None) => {
            return Err(flag(
                "disaggregation-mode",
                "is required with --protocol sglang (prefill or decode)",
            ));
        }
        (EngineProtocol::Sglang, Some(role)) => {
            if args.agent_socket.is_none() {
                return Err(flag(
                    "agent-socket",
                    "is required with --protocol sglang: the KV hand-off goes through the pool",
                ));
            }
            if args.bootstrap_timeout.is_zero() {
                return Err(flag("bootstrap-timeout", "must be more than 0"));
            }
            Some(SglangMode {
                role,
                bootstrap_timeout: args.bootstrap_timeout,
            })
        }
    };
    Ok(EngineConfig {
        model: args.model.clone(),
        prefill_cost: args.cost.prefill()?,
        decode_cost: args.cost.decode()?,
        block_size: NonZeroU32::new(args.block_size)
            .ok_or_else(|| flag("block-size", "must be at least 1"))?,
        cache_blocks: args.cache_blocks,
        chunk_bytes: args.chunk_bytes,
        time_scale,
        sglang,
        hashing: args.block_hash.hashing(&args.hash_seed),
    })
}

/// KV block shape from the flags, when an agent socket is given (reads `--model-config`).
pub fn kv_geometry(args: &EngineArgs) -> Result<Option<KvGeometry>, EngineError> {
    if args.agent_socket.is_none() {
        return Ok(None);
    }
    let raw = match (&args.model_config, args.kv_bytes_per_token) {
        (Some(path), _) => {
            let bytes = std::fs::read(path).map_err(|source| EngineError::ModelConfigRead {
                path: path.clone(),
                source,
            })?;
            kv::bytes_per_token_from_config(&bytes).map_err(|source| EngineError::ModelConfig {
                path: path.clone(),
                source,
            })?
        }
        (None, Some(0)) => return Err(flag("kv-bytes-per-token", "must be at least 1")),
        (None, Some(n)) => n,
        (None, None) => {
            return Err(flag(
                "agent-socket",
                "needs --kv-bytes-per-token or --model-config to size the KV blocks",
            ));
        }
    };
    Ok(Some(KvGeometry {
        bytes_per_token: kv::scale_bytes(raw, args.kv_scale).map_err(EngineError::KvScale)?,
        block_tokens: args.block_size.max(1),
    }))
}

/// Entry point of `kvpool engine`: serves until SIGTERM or SIGINT.
pub fn run(args: &EngineArgs) -> Result<(), EngineError> {
    let config = engine_config(args)?;
    let geometry = kv_geometry(args)?;
    let listening = args.addrs.listening().map_err(|(f, p)| flag(f, p))?;
    let events = match &args.kv_events_config {
        Some(json) => server::KvEventsConfig::parse(json)
            .map_err(|e| flag("kv-events-config", e.to_string()))?,
        None => None,
    };
    if let Some(g) = geometry {
        tracing::info!(
            bytes_per_token = g.bytes_per_token,
            block_bytes = g.block_bytes(),
            "KV blocks go through the node agent"
        );
    }
    tracing::info!(
        listen = %args.addrs.listen,
        admin = %args.addrs.admin_listen,
        model = %config.model,
        block_size = config.block_size.get(),
        cache_blocks = config.cache_blocks,
        time_scale = config.time_scale,
        sglang = ?config.sglang.map(|m| m.role),
        agent = args.agent_socket.is_some(),
        "starting synthetic engine"
    );
    tracing::debug!(?config, "synthetic engine configuration, every field");
    let setup = |wired: Wired| async move {
        let kv = match (&args.agent_socket, geometry) {
            (Some(path), Some(g)) => Some(AgentKv::connect(path, g, &config.model).await.map_err(
                |source| EngineError::Agent {
                    path: path.clone(),
                    source,
                },
            )?),
            _ => None,
        };
        server::router_publishing(config, kv, &wired.registry, events, wired.shutdown.clone())
            .await
            .map_err(EngineError::Server)
    };
    let serve = |router, listener, wired: Wired| async move {
        wired.readiness.set_ready(true);
        wired
            .serve(listener, router)
            .await
            .map_err(|e| EngineError::Server(ServerError::Serve(e)))
    };
    wiring::run(listening, setup, serve)
}

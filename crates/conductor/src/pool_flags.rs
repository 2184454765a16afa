//! The pool key flags of `kvpool conductor`: the contract the per-request pool lookup asks the
//! master under (`--pool-keys` and the `--engine-*` settings; docs/engine-contract.md, "Pool
//! keys"). I/O boundary: reading the model directory's `config.json`.

use std::path::Path;

use kvpool_core::flags::FlagError;
use kvpool_core::sched::{BlockHashKind, PoolKeys, VllmKeys};

/// The flags of the pool key contract.
#[derive(Debug, Clone, clap::Args)]
pub struct PoolKeyArgs {
    /// The names under which the engines store blocks in the pool, which the conductor asks
    /// the master for (docs/engine-contract.md, "Pool keys"): `vllm` (kvpool's vLLM
    /// connector: the engines' block hashes under their model, KV dtype, block size and
    /// parallel layout; needs --block-hash vllm) or `synthetic` (kvpool's synthetic engines).
    #[arg(long, value_enum, default_value_t = PoolKeyKind::Vllm, env = "KVPOOL_POOL_KEYS")]
    pub pool_keys: PoolKeyKind,
    /// With --pool-keys vllm: the model's name in the engines' keys (a served model name,
    /// directory or hub name: its last path component is used). Default: each request's
    /// `model`, which is what the engines' connectors use (vLLM's served model name). A
    /// directory here is also where the KV dtype is read from.
    #[arg(long, env = "KVPOOL_ENGINE_MODEL")]
    pub engine_model: Option<String>,
    /// With --pool-keys vllm: the element type of the engines' KV cache (`bfloat16`,
    /// `float16`, or vLLM's --kv-cache-dtype such as `fp8_e4m3`). Default: the dtype in the
    /// model directory's config.json (--engine-model or --tokenizer), resolved as vLLM
    /// resolves `--dtype auto`; without one, bfloat16 (with a warning).
    #[arg(long, env = "KVPOOL_ENGINE_KV_DTYPE")]
    pub engine_kv_dtype: Option<String>,
    /// With --pool-keys vllm: the engines' tensor-parallel size.
    #[arg(long, default_value_t = 1, env = "KVPOOL_ENGINE_TENSOR_PARALLEL_SIZE")]
    pub engine_tensor_parallel_size: u32,
    /// With --pool-keys vllm: the engines' pipeline-parallel size.
    #[arg(
        long,
        default_value_t = 1,
        env = "KVPOOL_ENGINE_PIPELINE_PARALLEL_SIZE"
    )]
    pub engine_pipeline_parallel_size: u32,
    /// With --pool-keys vllm: the connector's `cache_prefix` (its key namespace), if set.
    #[arg(long, env = "KVPOOL_ENGINE_CACHE_PREFIX")]
    pub engine_cache_prefix: Option<String>,
}

fn flag(flag: &'static str, problem: impl Into<String>) -> FlagError {
    FlagError::new(flag, problem)
}

/// Which pool key contract the conductor asks the master under (`--pool-keys`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PoolKeyKind {
    /// kvpool's vLLM connector.
    Vllm,
    /// kvpool's synthetic engines.
    Synthetic,
}

/// The pool key contract of the flags (`--pool-keys` and the `--engine-*` settings), for engines
/// with `block_size`-token blocks hashed as `block_hash`, whose tokenizer is `tokenizer`.
pub fn pool_keys(
    args: &PoolKeyArgs,
    block_size: u32,
    block_hash: BlockHashKind,
    tokenizer: Option<&Path>,
) -> Result<PoolKeys, FlagError> {
    if args.pool_keys == PoolKeyKind::Synthetic {
        return Ok(PoolKeys::Synthetic);
    }
    if block_hash != BlockHashKind::Vllm {
        return Err(flag(
            "pool-keys",
            "vllm needs --block-hash vllm (the connector names blocks by vLLM's block hashes)",
        ));
    }
    let kv_dtype = match &args.engine_kv_dtype {
        Some(d) => d.clone(),
        None => {
            // The model directory: --engine-model when it is one, else --tokenizer's.
            let dir = args
                .engine_model
                .as_deref()
                .map(Path::new)
                .filter(|p| p.is_dir())
                .or(tokenizer.filter(|p| p.is_dir()));
            match dir {
                Some(d) if d.join("config.json").is_file() => {
                    crate::model_config::kv_dtype(d).map_err(|e| flag("engine-kv-dtype", e))?
                }
                _ => {
                    tracing::warn!(
                        "no model directory with a config.json to read the engines' KV dtype \
                         from (--engine-model, --tokenizer); assuming bfloat16 for pool keys \
                         (set --engine-kv-dtype)"
                    );
                    "bfloat16".to_owned()
                }
            }
        }
    };
    VllmKeys::new(
        args.engine_model.as_deref(),
        &kv_dtype,
        block_size,
        args.engine_tensor_parallel_size,
        args.engine_pipeline_parallel_size,
        args.engine_cache_prefix.as_deref(),
    )
    .map(PoolKeys::Vllm)
    .map_err(|e| flag("pool-keys", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use kvpool_core::sched::EngineHash;

    #[derive(Debug, Parser)]
    struct T {
        #[command(flatten)]
        a: crate::cli::ConductorArgs,
    }

    fn keys(extra: &[&str]) -> Result<PoolKeys, FlagError> {
        let argv = std::iter::once("t").chain(extra.iter().copied());
        let a = T::try_parse_from(argv).expect("parses").a;
        pool_keys(
            &a.keys,
            a.block_size,
            a.block_hash,
            a.model_files.tokenizer.as_deref(),
        )
    }

    fn name(k: &PoolKeys, model: &str) -> String {
        let h = [EngineHash([7; 32])];
        let names = k.names(model, &[1], Some(&h)).expect("named");
        String::from_utf8(names[0].clone()).expect("utf8")
    }

    #[test]
    fn vllm_keys_follow_the_model_directory_and_the_flags() {
        let dir = tempfile::tempdir().expect("tempdir");
        let model = dir.path().join("tiny");
        std::fs::create_dir(&model).unwrap();
        std::fs::write(model.join("config.json"), r#"{"torch_dtype":"float16"}"#).unwrap();
        let m = model.display().to_string();
        // The dtype comes from the model directory; the model's name from each request.
        let k = keys(&["--engine-model", &m, "--block-size", "32"]).expect("valid");
        assert!(name(&k, "ignored").starts_with("tiny@kvpool-vllm@float16@bs32@tp0of1@pp0of1@"));
        let k = keys(&["--tokenizer", &m, "--block-size", "16"]).expect("valid");
        assert!(name(&k, "served").starts_with("served@kvpool-vllm@float16@bs16@"));
        let k = keys(&[
            "--engine-kv-dtype",
            "fp8_e4m3",
            "--engine-tensor-parallel-size",
            "4",
            "--engine-cache-prefix",
            "team",
        ])
        .expect("valid");
        assert!(name(&k, "m").starts_with("team@m@kvpool-vllm@fp8_e4m3@bs256@tp0of4@pp0of1@"));
        // No model directory and no dtype: bfloat16, as vLLM gives most models.
        assert!(name(&keys(&[]).expect("valid"), "m").starts_with("m@kvpool-vllm@bfloat16@"));
        assert_eq!(
            keys(&["--pool-keys", "synthetic"]).expect("valid"),
            PoolKeys::Synthetic
        );
    }

    #[test]
    fn bad_contract_settings_name_the_flag() {
        let e = keys(&["--block-hash", "kvpool"]).expect_err("needs vLLM hashes");
        assert!(e.to_string().contains("pool-keys"), "{e}");
        let e = keys(&["--engine-tensor-parallel-size", "0"]).expect_err("zero ranks");
        assert!(e.to_string().contains("tensor parallel"), "{e}");
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("config.json"), "{not json").unwrap();
        let m = dir.path().display().to_string();
        let e = keys(&["--engine-model", &m]).expect_err("bad config");
        assert!(e.to_string().contains("engine-kv-dtype"), "{e}");
    }
}

//! `kvpool blocks`: a prompt's block hashes as the engine computes them (vLLM's chained
//! SHA-256 over CBOR, see `kvpool_core::sched::engine_hash`), with the pool key each maps to:
//! what a user runs to check that their engine, its KV events and kvpool agree. I/O boundary:
//! the tokenizer file and stdout.

use std::num::NonZeroU32;
use std::path::PathBuf;

use kvpool_core::sched::{EngineHash, ExtraKeys, VllmHasher, pool_key};
use serde_json::json;

use crate::tokenize::PromptTokenizer;

/// Flags of `kvpool blocks`.
#[derive(Debug, Clone, clap::Args)]
pub struct BlocksArgs {
    /// The prompt's token ids, comma separated.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["tokenizer", "prompt"])]
    pub token_ids: Option<Vec<u32>>,
    /// Hugging Face tokenizer.json to tokenise --prompt with (no special tokens added).
    #[arg(long, requires = "prompt")]
    pub tokenizer: Option<PathBuf>,
    /// Prompt text (with --tokenizer).
    #[arg(long, requires = "tokenizer")]
    pub prompt: Option<String>,
    /// Tokens per block (vLLM's default is 16).
    #[arg(long, default_value_t = kvpool_core::sched::engine_hash::VLLM_DEFAULT_BLOCK_SIZE)]
    pub block_size: u32,
    /// The engines' PYTHONHASHSEED (vLLM seeds the first block's parent hash with it).
    #[arg(long, env = "PYTHONHASHSEED", default_value = "0")]
    pub hash_seed: String,
    /// The LoRA adapter the request uses (vLLM keys its blocks by the adapter's name).
    #[arg(long)]
    pub lora_name: Option<String>,
    /// Model name of the pool keys.
    #[arg(long, default_value = "kvpool-synthetic")]
    pub model: String,
    /// Print JSON: `{"blocks": [{"hash_hex", "hash_u64", "pool_key"}, ...], ...}`.
    #[arg(long)]
    pub json: bool,
}

/// Errors of `kvpool blocks`.
#[derive(Debug, thiserror::Error)]
pub enum BlocksError {
    #[error("give the prompt as --token-ids or as --tokenizer with --prompt")]
    NoPrompt,
    #[error("--block-size must be at least 1")]
    BlockSize,
    #[error(transparent)]
    Tokenize(#[from] crate::tokenize::TokenizeError),
}

/// The report of `kvpool blocks`, as text or JSON.
pub fn report(args: &BlocksArgs) -> Result<String, BlocksError> {
    let block_size = NonZeroU32::new(args.block_size).ok_or(BlocksError::BlockSize)?;
    let tokens = match (&args.token_ids, &args.tokenizer, &args.prompt) {
        (Some(ids), _, _) => ids.clone(),
        (None, Some(path), Some(prompt)) => PromptTokenizer::from_file(path)?.tokens(prompt)?,
        _ => return Err(BlocksError::NoPrompt),
    };
    let extra = ExtraKeys {
        lora_name: args.lora_name.as_deref(),
    };
    let hashes = VllmHasher::new(&args.hash_seed).block_hashes(&tokens, block_size, extra);
    let key =
        |h: &EngineHash| String::from_utf8_lossy(&pool_key(&args.model, h.as_u64())).into_owned();
    if args.json {
        let blocks: Vec<_> = hashes
            .iter()
            .map(|h| json!({"hash_hex": h.to_hex(), "hash_u64": h.as_u64(), "pool_key": key(h)}))
            .collect();
        return Ok(json!({
            "algorithm": "vllm-sha256_cbor",
            "block_size": block_size.get(),
            "hash_seed": args.hash_seed,
            "tokens": tokens.len(),
            "blocks": blocks,
        })
        .to_string());
    }
    let mut out = format!(
        "{} tokens, {} full blocks of {} (vLLM sha256_cbor, PYTHONHASHSEED={})\n",
        tokens.len(),
        hashes.len(),
        block_size,
        args.hash_seed
    );
    for (i, h) in hashes.iter().enumerate() {
        out.push_str(&format!(
            "{i:>4}  {}  {:>20}  {}\n",
            h.to_hex(),
            h.as_u64(),
            key(h)
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: BlocksArgs,
    }

    fn parse(args: &[&str]) -> BlocksArgs {
        Cli::try_parse_from(std::iter::once("blocks").chain(args.iter().copied()))
            .expect("flags")
            .args
    }

    #[test]
    fn token_ids_give_one_entry_per_full_block() {
        let ids: Vec<String> = (0..40).map(|i| i.to_string()).collect();
        let args = parse(&["--token-ids", &ids.join(","), "--json", "--hash-seed", "0"]);
        let v: serde_json::Value =
            serde_json::from_str(&report(&args).expect("report")).expect("json");
        let blocks = v["blocks"].as_array().expect("blocks");
        assert_eq!(blocks.len(), 2, "40 tokens make two full blocks of 16");
        let h = blocks[0]["hash_hex"].as_str().expect("hex");
        assert_eq!(h.len(), 64);
        let tail = u64::from_str_radix(&h[48..], 16).expect("hex");
        assert_eq!(blocks[0]["hash_u64"].as_u64(), Some(tail));
        assert!(
            blocks[0]["pool_key"]
                .as_str()
                .expect("key")
                .ends_with(&format!("{tail:016x}"))
        );
    }

    #[test]
    fn a_missing_prompt_or_zero_block_size_is_named() {
        let none = parse(&[]);
        assert!(matches!(report(&none), Err(BlocksError::NoPrompt)));
        let zero = parse(&["--token-ids", "1", "--block-size", "0"]);
        assert!(matches!(report(&zero), Err(BlocksError::BlockSize)));
    }
}

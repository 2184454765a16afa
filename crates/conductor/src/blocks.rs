//! `kvpool blocks`: a prompt's block hashes as the engine computes them (vLLM's chained
//! SHA-256 over CBOR, see `kvpool_core::sched::engine_hash`), with the pool key each maps to:
//! what a user runs to check that their engine, its KV events and kvpool agree. I/O boundary:
//! the tokenizer file and stdout.

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};

use kvpool_core::sched::{EngineHash, ExtraKeys, VllmHasher, pool_key};
use kvpool_proto::openai::{Endpoint, parse_request};
use serde_json::json;

use crate::chat::ChatTemplate;
use crate::tokenize::PromptTokenizer;

/// Flags of `kvpool blocks`.
#[derive(Debug, Clone, clap::Args)]
pub struct BlocksArgs {
    /// The prompt's token ids, comma separated.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["tokenizer", "prompt"])]
    pub token_ids: Option<Vec<u32>>,
    /// The model's Hugging Face tokenizer.json, or its directory (whose chat template --chat
    /// uses), to tokenise --prompt or --messages with.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Prompt text (with --tokenizer): tokenised as vLLM tokenises a completion request's
    /// prompt (special tokens added), or with --chat as one user message.
    #[arg(long, requires = "tokenizer", conflicts_with = "messages")]
    pub prompt: Option<String>,
    /// Render the prompt with the model's chat template first (as a chat request): --prompt
    /// becomes one user message, with the generation prompt added.
    #[arg(long, requires = "tokenizer")]
    pub chat: bool,
    /// A chat request's `messages` as JSON (`[{"role": "user", "content": "..."}, ...]`),
    /// rendered with the chat template (implies --chat).
    #[arg(long, requires = "tokenizer")]
    pub messages: Option<String>,
    /// The chat template (a Jinja file or a tokenizer_config.json) instead of the model
    /// directory's.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Whether the tokenizer adds the model's special tokens (vLLM's `add_special_tokens`:
    /// by default true for a prompt, false for a chat request).
    #[arg(long)]
    pub add_special_tokens: Option<bool>,
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
    #[error(transparent)]
    Chat(#[from] crate::chat::ChatError),
    #[error("--chat needs a chat template: a --tokenizer directory with one, or --chat-template")]
    NoTemplate,
    #[error("--messages: {0}")]
    Messages(String),
}

/// The token ids of --prompt or --messages, rendered and tokenised as the engine does.
fn text_tokens(args: &BlocksArgs, tokenizer: &Path) -> Result<Vec<u32>, BlocksError> {
    let body = match (&args.messages, &args.prompt) {
        (Some(m), _) => {
            let messages: serde_json::Value =
                serde_json::from_str(m).map_err(|e| BlocksError::Messages(e.to_string()))?;
            json!({"model": "m", "messages": messages})
        }
        (None, Some(p)) if args.chat => {
            json!({"model": "m", "messages": [{"role": "user", "content": p}]})
        }
        (None, Some(p)) => json!({"model": "m", "prompt": p}),
        (None, None) => return Err(BlocksError::NoPrompt),
    };
    let mut body = body;
    if let Some(special) = args.add_special_tokens {
        body["add_special_tokens"] = json!(special);
    }
    let endpoint = if body.get("messages").is_some() {
        Endpoint::ChatCompletions
    } else {
        Endpoint::Completions
    };
    let req = parse_request(endpoint, body.to_string().as_bytes(), &|_| true)
        .map_err(|e| BlocksError::Messages(e.to_string()))?;
    let dir = Some(tokenizer).filter(|p| p.is_dir());
    let template = match endpoint {
        Endpoint::ChatCompletions => Some(
            ChatTemplate::load(args.chat_template.as_deref(), dir)?
                .ok_or(BlocksError::NoTemplate)?,
        ),
        Endpoint::Completions => None,
    };
    Ok(PromptTokenizer::from_path(tokenizer)?.request_tokens(template.as_ref(), &req)?)
}

/// The report of `kvpool blocks`, as text or JSON.
pub fn report(args: &BlocksArgs) -> Result<String, BlocksError> {
    let block_size = NonZeroU32::new(args.block_size).ok_or(BlocksError::BlockSize)?;
    let tokens = match (&args.token_ids, &args.tokenizer) {
        (Some(ids), _) => ids.clone(),
        (None, Some(path)) => text_tokens(args, path)?,
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

    /// A word-level tokenizer with a BOS post-processor and a chat template beside it.
    fn model_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let words = ["<s>", "[UNK]", "user", "assistant", "hi", "there", ":"];
        let vocab: serde_json::Map<String, serde_json::Value> = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), json!(i)))
            .collect();
        let tokenizer = json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "decoder": null,
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}
            },
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
        });
        std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
        let config = json!({
            "bos_token": "<s>",
            "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.role }} : {{ m.content }} {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"
        });
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        dir
    }

    fn token_count(args: &[&str]) -> u64 {
        let v: serde_json::Value =
            serde_json::from_str(&report(&parse(args)).expect("report")).expect("json");
        v["tokens"].as_u64().expect("tokens")
    }

    #[test]
    fn prompts_and_chats_are_tokenised_as_vllm_does() {
        let dir = model_dir();
        let t = dir.path().to_str().unwrap();
        let base = ["--json", "--block-size", "1", "--tokenizer", t];
        let with = |extra: &[&str]| token_count(&[&base[..], extra].concat());
        // A prompt: BOS + 2 words.
        assert_eq!(with(&["--prompt", "hi there"]), 3);
        assert_eq!(
            with(&["--prompt", "hi there", "--add-special-tokens", "false"]),
            2
        );
        // A chat: the template writes the BOS; no second one is added.
        // "<s> user : hi there assistant :" = 7 tokens.
        assert_eq!(with(&["--prompt", "hi there", "--chat"]), 7);
        assert_eq!(
            with(&["--messages", r#"[{"role":"user","content":"hi"}]"#]),
            6
        );
        let bad = parse(&[&base[..], &["--messages", "[{"]].concat());
        assert!(matches!(report(&bad), Err(BlocksError::Messages(_))));
    }

    #[test]
    fn a_chat_without_a_template_is_refused() {
        let dir = model_dir();
        std::fs::remove_file(dir.path().join("tokenizer_config.json")).unwrap();
        let args = parse(&[
            "--tokenizer",
            dir.path().to_str().unwrap(),
            "--prompt",
            "hi",
            "--chat",
        ]);
        assert!(matches!(report(&args), Err(BlocksError::NoTemplate)));
    }

    #[test]
    fn a_missing_prompt_or_zero_block_size_is_named() {
        let none = parse(&[]);
        assert!(matches!(report(&none), Err(BlocksError::NoPrompt)));
        let zero = parse(&["--token-ids", "1", "--block-size", "0"]);
        assert!(matches!(report(&zero), Err(BlocksError::BlockSize)));
    }
}

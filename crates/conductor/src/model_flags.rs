//! The served model's flags of `kvpool conductor` ([`ModelArgs`]): its directory, tokenizer and
//! chat template, and the KV bytes per token the transfer terms of the TTFT estimate count,
//! computed from the directory's `config.json` unless given ([`kv_bytes_per_token`]). I/O boundary: looking at and reading the model directory.

use std::path::{Path, PathBuf};

use kvpool_core::flags::FlagError;

use crate::pool_flags::PoolKeyArgs;

/// KV bytes per token without a model directory or `--kv-bytes-per-token`: a 70B-class model
/// (2 x 80 layers x 8 KV heads x 128 x 2 bytes; docs/scheduling.md).
pub const DEFAULT_KV_BYTES_PER_TOKEN: u64 = 327_680;

/// The flags of the served model.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// The served model's directory (what the engines serve: vLLM's model path): its
    /// `config.json` gives the KV bytes per token (with --engine-tensor-parallel-size and
    /// --engine-kv-dtype), its `tokenizer.json` the prompts' tokens and its chat template the
    /// rendering of chat requests, unless --kv-bytes-per-token or --tokenizer say otherwise.
    #[arg(long, value_name = "DIR", env = "KVPOOL_CONDUCTOR_MODEL_DIR")]
    pub model_dir: Option<PathBuf>,
    /// The model's Hugging Face `tokenizer.json`, or the model's directory holding it (and its
    /// `tokenizer_config.json` or `chat_template.jinja`, whose chat template then renders chat
    /// requests): block keys then follow the engine's tokens. `engine`: ask a prefill engine's
    /// `/tokenize` (vLLM's) for each request's tokens instead, with no file here. Default: the
    /// --model-dir when it holds a `tokenizer.json`, `engine` for a --model-dir without one;
    /// without --model-dir, prompts are cut into --chunk-bytes stand-in tokens.
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
    /// The chat template to render chat requests with (a Jinja file, or a
    /// `tokenizer_config.json`), as vLLM's `--chat-template`; overrides the model directory's.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// KV bytes one token takes in one engine rank's cache (`--bytes-per-token` is its old
    /// spelling). Default: computed from the model directory's `config.json` (--model-dir,
    /// else a --tokenizer or --engine-model directory holding one); without one, 327,680 (a
    /// 70B-class model).
    #[arg(long, alias = "bytes-per-token")]
    pub kv_bytes_per_token: Option<u64>,
}

/// Where the KV bytes per token came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvBytesSource {
    /// `--kv-bytes-per-token`.
    Flag,
    /// Computed from this directory's `config.json`.
    ModelConfig(PathBuf),
    /// [`DEFAULT_KV_BYTES_PER_TOKEN`].
    Default,
}

impl KvBytesSource {
    pub fn name(&self) -> &'static str {
        match self {
            KvBytesSource::Flag => "flag",
            KvBytesSource::ModelConfig(_) => "model_config",
            KvBytesSource::Default => "default",
        }
    }
}

/// `--tokenizer engine`: tokens from the engines' own `/tokenize`.
pub const ENGINE_TOKENIZER: &str = "engine";

fn flag(name: &'static str, problem: impl Into<String>) -> FlagError {
    FlagError::new(name, problem)
}

/// The model directory of the flags: `--model-dir`, else `--tokenizer` when it is a directory,
/// else `--engine-model` when it is one.
pub fn model_dir<'a>(model: &'a ModelArgs, keys: &'a PoolKeyArgs) -> Option<&'a Path> {
    model
        .model_dir
        .as_deref()
        .or(model.tokenizer.as_deref().filter(|p| p.is_dir()))
        .or(keys
            .engine_model
            .as_deref()
            .map(Path::new)
            .filter(|p| p.is_dir()))
}

/// The tokenizer to load: `--tokenizer`, else `--model-dir` when it holds a `tokenizer.json`
/// (then its chat template too), else the engines' own (`engine`) for a `--model-dir` without
/// one (the served model has a tokenizer the conductor cannot read: stand-in chunks would
/// match no engine's blocks); `None`: stand-in chunks.
pub fn tokenizer_path(model: &ModelArgs) -> Option<&Path> {
    model
        .tokenizer
        .as_deref()
        .or(model.model_dir.as_deref().map(|d| {
            if d.join("tokenizer.json").is_file() {
                d
            } else {
                Path::new(ENGINE_TOKENIZER)
            }
        }))
}

/// The KV bytes per token of the flags and where they came from. A `--model-dir` whose
/// `config.json` cannot be read or sized is an error; a directory only named by --tokenizer or
/// --engine-model without a usable `config.json` leaves the default, with a warning.
pub fn kv_bytes_per_token(
    model: &ModelArgs,
    keys: &PoolKeyArgs,
) -> Result<(u64, KvBytesSource), FlagError> {
    if let Some(n) = model.kv_bytes_per_token {
        if n == 0 {
            return Err(flag("kv-bytes-per-token", "must be at least 1"));
        }
        return Ok((n, KvBytesSource::Flag));
    }
    let layout = |dir: &Path| {
        crate::model_config::dir_kv_layout(
            dir,
            keys.engine_tensor_parallel_size,
            keys.engine_kv_dtype.as_deref(),
        )
    };
    if let Some(dir) = model.model_dir.as_ref().filter(|d| !d.is_file()) {
        let l = layout(dir).map_err(|e| flag("model-dir", e))?;
        return Ok((l.bytes_per_token, KvBytesSource::ModelConfig(dir.clone())));
    }
    if let Some(file) = &model.model_dir {
        // A single-file model (GGUF): no config.json to size it by.
        tracing::warn!(path = %file.display(), default = DEFAULT_KV_BYTES_PER_TOKEN,
            "--model-dir names a file, not a model directory; assuming the default KV bytes \
             per token (set --kv-bytes-per-token)");
        return Ok((DEFAULT_KV_BYTES_PER_TOKEN, KvBytesSource::Default));
    }
    match model_dir(model, keys).filter(|d| d.join("config.json").is_file()) {
        Some(dir) => match layout(dir) {
            Ok(l) => Ok((
                l.bytes_per_token,
                KvBytesSource::ModelConfig(dir.to_path_buf()),
            )),
            Err(problem) => {
                tracing::warn!(
                    %problem,
                    default = DEFAULT_KV_BYTES_PER_TOKEN,
                    "cannot size the model's KV cache; assuming the default KV bytes per token \
                     (set --kv-bytes-per-token)"
                );
                Ok((DEFAULT_KV_BYTES_PER_TOKEN, KvBytesSource::Default))
            }
        },
        None => Ok((DEFAULT_KV_BYTES_PER_TOKEN, KvBytesSource::Default)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct T {
        #[command(flatten)]
        a: crate::cli::ConductorArgs,
    }

    fn kv(extra: &[&str]) -> Result<(u64, KvBytesSource), FlagError> {
        let mut argv = vec!["t"];
        argv.extend_from_slice(extra);
        let a = T::try_parse_from(argv).unwrap().a;
        kv_bytes_per_token(&a.model_files, &a.keys)
    }

    #[test]
    fn the_model_directory_sizes_the_kv_unless_the_flag_does() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap().to_owned();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"num_hidden_layers":4,"num_attention_heads":8,"num_key_value_heads":4,
                "hidden_size":256,"torch_dtype":"float32"}"#,
        )
        .unwrap();
        // 2 x 4 layers x 4 KV heads x 32 x 2 (bfloat16).
        let from_dir = KvBytesSource::ModelConfig(dir.path().to_path_buf());
        assert_eq!(kv(&["--model-dir", &d]).unwrap(), (2048, from_dir.clone()));
        // Two ranks hold two heads each; an fp8 cache halves the element.
        let split = ["--model-dir", &d, "--engine-tensor-parallel-size", "2"];
        assert_eq!(kv(&split).unwrap().0, 1024);
        let fp8 = ["--model-dir", &d, "--engine-kv-dtype", "fp8"];
        assert_eq!(kv(&fp8).unwrap().0, 1024);
        // A --tokenizer directory counts as the model's.
        assert_eq!(kv(&["--tokenizer", &d]).unwrap(), (2048, from_dir));
        let given = kv(&["--model-dir", &d, "--kv-bytes-per-token", "7"]).unwrap();
        assert_eq!(given, (7, KvBytesSource::Flag));
        assert_eq!(
            kv(&[]).unwrap(),
            (DEFAULT_KV_BYTES_PER_TOKEN, KvBytesSource::Default)
        );
        assert_eq!(
            kv(&["--kv-bytes-per-token", "0"]).unwrap_err().flag,
            "kv-bytes-per-token"
        );
        // A named model directory that cannot be sized is refused, naming the file.
        std::fs::write(dir.path().join("config.json"), "{}").unwrap();
        let err = kv(&["--model-dir", &d]).unwrap_err();
        assert_eq!(err.flag, "model-dir");
        assert!(err.to_string().contains("config.json"), "{err}");
        // Only implied by --tokenizer: the default, with a warning.
        assert_eq!(kv(&["--tokenizer", &d]).unwrap().1, KvBytesSource::Default);
        let missing = kv(&["--model-dir", "/nonexistent/model"]).unwrap_err();
        assert!(missing.to_string().contains("cannot read"), "{missing}");
        // A single-file model (GGUF) has no config.json: the default, with a warning.
        let gguf = dir.path().join("model.gguf");
        std::fs::write(&gguf, b"GGUF").unwrap();
        let file = kv(&["--model-dir", gguf.to_str().unwrap()]).unwrap();
        assert_eq!(file, (DEFAULT_KV_BYTES_PER_TOKEN, KvBytesSource::Default));
    }

    #[test]
    fn a_model_directory_without_a_tokenizer_leaves_tokenising_to_the_engines() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["t"];
            argv.extend_from_slice(extra);
            T::try_parse_from(argv).unwrap().a.model_files
        };
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap().to_owned();
        let bare = parse(&["--model-dir", &d]);
        assert_eq!(tokenizer_path(&bare), Some(Path::new(ENGINE_TOKENIZER)));
        std::fs::write(dir.path().join("tokenizer.json"), "{}").unwrap();
        assert_eq!(
            tokenizer_path(&parse(&["--model-dir", &d])),
            Some(dir.path())
        );
        let chunks = parse(&[]);
        assert_eq!(tokenizer_path(&chunks), None);
    }
}

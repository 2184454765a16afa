//! Prompt tokenisation for block keys: a Hugging Face `tokenizer.json` when one is configured
//! (`--tokenizer FILE`), otherwise the fixed-size text chunks of `sched::text_tokens`. The I/O
//! boundary is `PromptTokenizer::from_file`, which reads the file once at start; tokenising is
//! pure.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvpool_core::sched::text_tokens;

/// How prompt text becomes token ids.
#[derive(Clone, Debug)]
pub enum PromptTokenizer {
    /// Stand-in ids: the UTF-8 bytes in chunks of this many bytes (must match the engines').
    Chunks { bytes: usize },
    /// A Hugging Face tokenizer loaded from a `tokenizer.json`.
    HuggingFace(Arc<tokenizers::Tokenizer>),
}

/// Errors of loading a tokenizer or tokenising a prompt.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum TokenizeError {
    #[error("cannot load tokenizer file {path}")]
    Load {
        path: PathBuf,
        #[source]
        source: tokenizers::Error,
    },
    #[error("cannot tokenise the prompt")]
    Encode(#[source] tokenizers::Error),
    #[error("the tokenising task failed")]
    Task(#[source] tokio::task::JoinError),
}

impl TokenizeError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

impl PromptTokenizer {
    /// Loads a `tokenizer.json` (no download: the file must be local).
    pub fn from_file(path: &Path) -> Result<Self, TokenizeError> {
        let tokenizer =
            tokenizers::Tokenizer::from_file(path).map_err(|source| TokenizeError::Load {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(PromptTokenizer::HuggingFace(Arc::new(tokenizer)))
    }

    /// Token ids of `text` (no special tokens added: the key must depend on the text only).
    pub fn tokens(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        match self {
            PromptTokenizer::Chunks { bytes } => Ok(text_tokens(text, *bytes)),
            PromptTokenizer::HuggingFace(t) => t
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(TokenizeError::Encode),
        }
    }

    /// `tokens` for async callers: a Hugging Face tokenizer runs on the blocking pool (a long
    /// prompt takes milliseconds), text chunks run inline.
    pub async fn tokens_off_runtime(&self, text: String) -> Result<Vec<u32>, TokenizeError> {
        match self {
            PromptTokenizer::Chunks { .. } => self.tokens(&text),
            PromptTokenizer::HuggingFace(_) => {
                let this = self.clone();
                tokio::task::spawn_blocking(move || this.tokens(&text))
                    .await
                    .map_err(TokenizeError::Task)?
            }
        }
    }

    /// Short name for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            PromptTokenizer::Chunks { .. } => "chunks",
            PromptTokenizer::HuggingFace(_) => "huggingface",
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use kvpool_core::sched::{block_count, block_keys};

    /// Writes a small word-level tokenizer (whitespace pre-tokeniser, 12 words plus [UNK]).
    fn tiny_tokenizer(dir: &Path) -> PathBuf {
        let words = [
            "[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "and", "then",
            "stopped",
        ];
        let vocab: serde_json::Map<String, serde_json::Value> = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), serde_json::json!(i)))
            .collect();
        let json = serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [],
            "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null,
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
        });
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
        path
    }

    #[test]
    fn huggingface_tokens_follow_the_vocabulary() {
        let dir = tempfile::tempdir().unwrap();
        let t = PromptTokenizer::from_file(&tiny_tokenizer(dir.path())).unwrap();
        assert_eq!(t.kind(), "huggingface");
        assert_eq!(t.tokens("the cat sat").unwrap(), vec![1, 2, 3]);
        // Unknown words map to [UNK]; whitespace runs do not make tokens.
        assert_eq!(t.tokens("the   zebra").unwrap(), vec![1, 0]);
    }

    #[test]
    fn equal_prefixes_give_equal_keys_and_blocks_follow_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let t = PromptTokenizer::from_file(&tiny_tokenizer(dir.path())).unwrap();
        let bs = NonZeroU32::new(4).unwrap();
        // 8 tokens of shared prefix (two full blocks), then different tails.
        let prefix = "the cat sat on the mat and then ";
        let a = t.tokens(&format!("{prefix}a dog ran far")).unwrap();
        let b = t.tokens(&format!("{prefix}the cat stopped")).unwrap();
        assert_eq!((a.len(), b.len()), (12, 11));
        let (ka, kb) = (block_keys(&a, bs), block_keys(&b, bs));
        // Block count follows the token count, not the text length.
        assert_eq!(ka.len() as u64, block_count(a.len() as u64, bs));
        assert_eq!((ka.len(), kb.len()), (3, 3));
        assert_eq!(ka[..2], kb[..2]);
        assert_ne!(ka[2], kb[2]);
        // More whitespace changes the text but not the tokens, so not the keys either.
        let c = t
            .tokens("the  cat   sat on the mat and then a dog ran far")
            .unwrap();
        assert_eq!(block_keys(&c, bs), ka);
    }

    #[tokio::test]
    async fn off_runtime_tokens_equal_inline_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let t = PromptTokenizer::from_file(&tiny_tokenizer(dir.path())).unwrap();
        let text = "a dog ran far and then stopped";
        assert_eq!(
            t.tokens_off_runtime(text.into()).await.unwrap(),
            t.tokens(text).unwrap()
        );
        assert_eq!(t.tokens(text).unwrap(), vec![6, 7, 8, 9, 10, 11, 12]);
    }

    #[test]
    fn a_missing_or_bad_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.json");
        let err = PromptTokenizer::from_file(&missing).unwrap_err();
        assert_eq!(err.category(), "load");
        assert!(err.to_string().contains("nope.json"), "{err}");
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, b"{\"model\": 3}").unwrap();
        assert!(matches!(
            PromptTokenizer::from_file(&bad),
            Err(TokenizeError::Load { .. })
        ));
    }

    #[test]
    fn without_a_tokenizer_text_chunks_are_used() {
        let t = PromptTokenizer::Chunks { bytes: 4 };
        assert_eq!(t.kind(), "chunks");
        assert_eq!(
            t.tokens("abcdefghij").unwrap(),
            text_tokens("abcdefghij", 4)
        );
        assert_eq!(t.tokens("abcdefghij").unwrap().len(), 3);
    }
}

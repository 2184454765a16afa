//! Prompt tokenisation for block keys: a Hugging Face `tokenizer.json` when one is configured
//! (`--tokenizer FILE` or a model directory holding one), otherwise the fixed-size text chunks
//! of `sched::text_tokens`; a chat request is first rendered with the model's chat template
//! (`chat`) when one is known. The I/O boundary is `PromptTokenizer::from_path`, which reads
//! the file once at start; tokenising is pure.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvpool_core::sched::text_tokens;
use kvpool_proto::openai::{GenerateRequest, Prompt};

use crate::chat::{ChatError, ChatTemplate};

/// How prompt text becomes token ids.
#[derive(Clone, Debug)]
pub enum PromptTokenizer {
    /// Stand-in ids: the UTF-8 bytes in chunks of this many bytes (must match the engines').
    Chunks { bytes: usize },
    /// A Hugging Face tokenizer loaded from a `tokenizer.json`.
    HuggingFace(Arc<tokenizers::Tokenizer>),
    /// The engines' own tokenizer, asked per request through a prefill engine's `/tokenize`
    /// (`--tokenizer engine`; `server::engine_tokenize`); where that fails, stand-in chunks of
    /// this many bytes, as [`PromptTokenizer::Chunks`].
    Engine { bytes: usize },
}

/// The token ids of a request's prompts as the scheduler needs them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PromptTokens {
    /// The first prompt's ids: its block keys route the request.
    pub first: Vec<u32>,
    /// Tokens of all the prompts (a batch's), which the engine prefills.
    pub total: u64,
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
    #[error(transparent)]
    Chat(#[from] ChatError),
}

kvpool_runtime::error_category!(TokenizeError);

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

    /// The tokenizer of `path`: a `tokenizer.json`, or a model directory holding one.
    pub fn from_path(path: &Path) -> Result<Self, TokenizeError> {
        if path.is_dir() {
            Self::from_file(&path.join("tokenizer.json"))
        } else {
            Self::from_file(path)
        }
    }

    /// Token ids of `text`, no special tokens added.
    pub fn tokens(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.tokens_with(text, false)
    }

    /// Token ids of `text`; with `special`, the tokenizer's post-processor adds the model's
    /// special tokens (a Llama BOS, for example), as vLLM's `add_special_tokens` does.
    /// Stand-in chunks have no special tokens.
    pub fn tokens_with(&self, text: &str, special: bool) -> Result<Vec<u32>, TokenizeError> {
        match self {
            PromptTokenizer::Chunks { bytes } | PromptTokenizer::Engine { bytes } => {
                Ok(text_tokens(text, *bytes))
            }
            PromptTokenizer::HuggingFace(t) => t
                .encode(text, special)
                .map(|e| e.get_ids().to_vec())
                .map_err(TokenizeError::Encode),
        }
    }

    /// The token ids the engine sees for the first prompt of `req` (the one a batch is routed
    /// by): a chat request rendered with `chat` (when the model's template is known; else its
    /// `role: content` lines), a text tokenised with the request's `add_special_tokens`, token
    /// ids as they are.
    pub fn request_tokens(
        &self,
        chat: Option<&ChatTemplate>,
        req: &GenerateRequest,
    ) -> Result<Vec<u32>, TokenizeError> {
        Ok(self.prompt_tokens(chat, req)?.first)
    }

    /// The first prompt's token ids (see [`PromptTokenizer::request_tokens`]) and the token
    /// count of all the request's prompts.
    pub fn prompt_tokens(
        &self,
        chat: Option<&ChatTemplate>,
        req: &GenerateRequest,
    ) -> Result<PromptTokens, TokenizeError> {
        let rendered = match (&req.chat, chat) {
            (Some(input), Some(template)) => Some(template.render(input)?),
            _ => None,
        };
        let mut out = PromptTokens::default();
        for (i, prompt) in req.prompts.iter().enumerate() {
            let ids = match (&rendered, prompt) {
                (Some(text), _) if i == 0 => self.tokens_with(text, req.add_special_tokens)?,
                (_, Prompt::Text(text)) => self.tokens_with(text, req.add_special_tokens)?,
                (_, Prompt::Tokens(ids)) if i == 0 => ids.clone(),
                (_, Prompt::Tokens(ids)) => {
                    out.total += ids.len() as u64;
                    continue;
                }
            };
            out.total += ids.len() as u64;
            if i == 0 {
                out.first = ids;
            }
        }
        Ok(out)
    }

    /// `prompt_tokens` for async callers: a Hugging Face tokenizer or a chat template runs on
    /// the blocking pool (a long prompt takes milliseconds), text chunks and token ids run
    /// inline.
    pub async fn prompt_tokens_off_runtime(
        &self,
        chat: Option<Arc<ChatTemplate>>,
        req: Arc<GenerateRequest>,
    ) -> Result<PromptTokens, TokenizeError> {
        let needs_template = req.chat.is_some() && chat.is_some();
        let only_ids = req.prompts.iter().all(|p| matches!(p, Prompt::Tokens(_)));
        match self {
            _ if only_ids => self.prompt_tokens(None, &req),
            PromptTokenizer::Chunks { .. } | PromptTokenizer::Engine { .. } if !needs_template => {
                self.prompt_tokens(None, &req)
            }
            _ => {
                let this = self.clone();
                tokio::task::spawn_blocking(move || this.prompt_tokens(chat.as_deref(), &req))
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
            PromptTokenizer::Engine { .. } => "engine",
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use kvpool_core::sched::{block_count, block_keys};
    use kvpool_proto::openai::Endpoint;

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

    fn request(body: &str, endpoint: Endpoint) -> GenerateRequest {
        kvpool_proto::openai::parse_request(endpoint, body.as_bytes(), &|_| true).unwrap()
    }

    #[tokio::test]
    async fn off_runtime_tokens_equal_inline_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let t = PromptTokenizer::from_path(dir.path())
            .map(|_| ())
            .unwrap_err();
        assert!(t.to_string().contains("tokenizer.json"), "{t}");
        let t = PromptTokenizer::from_file(&tiny_tokenizer(dir.path())).unwrap();
        let text = "a dog ran far and then stopped";
        let req = request(
            &format!(r#"{{"model":"m","prompt":"{text}"}}"#),
            Endpoint::Completions,
        );
        assert_eq!(
            t.prompt_tokens_off_runtime(None, Arc::new(req.clone()))
                .await
                .unwrap()
                .first,
            t.request_tokens(None, &req).unwrap()
        );
        assert_eq!(t.tokens(text).unwrap(), vec![6, 7, 8, 9, 10, 11, 12]);
        // A model directory works as well as its tokenizer.json.
        let from_dir = PromptTokenizer::from_path(dir.path()).unwrap();
        assert_eq!(from_dir.tokens(text).unwrap(), t.tokens(text).unwrap());
    }

    #[tokio::test]
    async fn chat_requests_are_rendered_with_the_template_first() {
        let dir = tempfile::tempdir().unwrap();
        let t = PromptTokenizer::from_file(&tiny_tokenizer(dir.path())).unwrap();
        let template = Arc::new(
            ChatTemplate::new(
                "{% for m in messages %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}then{% endif %}".into(),
                String::new(),
                String::new(),
            )
            .unwrap(),
        );
        let req = request(
            r#"{"model":"m","messages":[{"role":"user","content":"the cat"},{"role":"assistant","content":"sat"}]}"#,
            Endpoint::ChatCompletions,
        );
        let got = t
            .prompt_tokens_off_runtime(Some(template.clone()), Arc::new(req.clone()))
            .await
            .unwrap()
            .first;
        assert_eq!(got, t.tokens("the cat sat then").unwrap());
        // Without the template: the role lines (words the vocabulary lacks are [UNK]).
        assert_eq!(
            t.request_tokens(None, &req).unwrap(),
            t.tokens("user: the cat\nassistant: sat\n").unwrap()
        );
        // A template that refuses the conversation is an error, not a guess.
        let refusing = ChatTemplate::new(
            "{{ raise_exception('no') }}".into(),
            String::new(),
            String::new(),
        )
        .unwrap();
        assert!(matches!(
            t.request_tokens(Some(&refusing), &req),
            Err(TokenizeError::Chat(_))
        ));
    }

    #[test]
    fn special_tokens_follow_the_request() {
        let dir = tempfile::tempdir().unwrap();
        // The tiny tokenizer with a post-processor that adds a BOS ("[UNK]" stands in, id 0).
        let path = tiny_tokenizer(dir.path());
        let mut json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        json["post_processor"] = serde_json::json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "[UNK]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"[UNK]": {"id": "[UNK]", "ids": [0], "tokens": ["[UNK]"]}}
        });
        std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
        let t = PromptTokenizer::from_file(&path).unwrap();
        let completion = request(r#"{"model":"m","prompt":"the cat"}"#, Endpoint::Completions);
        assert_eq!(t.request_tokens(None, &completion).unwrap(), vec![0, 1, 2]);
        let bare = request(
            r#"{"model":"m","prompt":"the cat","add_special_tokens":false}"#,
            Endpoint::Completions,
        );
        assert_eq!(t.request_tokens(None, &bare).unwrap(), vec![1, 2]);
    }

    #[tokio::test]
    async fn batches_are_routed_by_their_first_prompt_and_counted_whole() {
        let dir = tempfile::tempdir().unwrap();
        let t = PromptTokenizer::from_file(&tiny_tokenizer(dir.path())).unwrap();
        let batch = request(
            r#"{"model":"m","prompt":["the cat sat","a dog"],"add_special_tokens":false}"#,
            Endpoint::Completions,
        );
        let got = t
            .prompt_tokens_off_runtime(None, Arc::new(batch))
            .await
            .unwrap();
        assert_eq!(got.first, vec![1, 2, 3]);
        assert_eq!(got.total, 5);
        // Token ids go through as they are, whatever the tokenizer.
        let ids = request(
            r#"{"model":"m","prompt":[[7,8,9,1000000],[1]]}"#,
            Endpoint::Completions,
        );
        let got = t.prompt_tokens(None, &ids).unwrap();
        assert_eq!(
            got,
            PromptTokens {
                first: vec![7, 8, 9, 1_000_000],
                total: 5
            }
        );
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

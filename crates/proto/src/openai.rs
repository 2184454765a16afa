//! OpenAI-compatible request parsing and response bodies (`/v1/completions`,
//! `/v1/chat/completions`, `/v1/models`, errors): the HTTP contract the conductor and the
//! engines both speak. Pure: JSON values in, JSON values out; the HTTP server owns the I/O.
//! Validation errors name the offending field.

use serde_json::{Value, json};

use kvpool_core::sched::BlockKey;

/// Largest `max_tokens` accepted.
pub const MAX_TOKENS_LIMIT: u64 = 1 << 20;
/// `max_tokens` when the request does not say (the OpenAI completions default).
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// Response header: prompt blocks the engine read from the pool for the request.
pub const KV_LOAD_BLOCKS_HEADER: &str = "x-kvpool-kv-load-blocks";
/// Response header: wall-clock seconds that read took (absent when no block was read).
pub const KV_LOAD_SECONDS_HEADER: &str = "x-kvpool-kv-load-seconds";

/// How an engine learns its part in disaggregated serving: vLLM's `kv_transfer_params` per
/// request, or SGLang's bootstrap fields with a role fixed per instance (docs/engine-contract.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum EngineProtocol {
    Vllm,
    Sglang,
}

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
}

/// What the request asks of this engine in disaggregated serving, from its
/// `kv_transfer_params` (vLLM's convention, see docs/engine-contract.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvRole {
    /// No `kv_transfer_params`: prefill and decode here.
    #[default]
    Standalone,
    /// `do_remote_decode: true`: prefill, keep the KV cache for a decode engine.
    Prefill,
    /// `do_remote_prefill: true`: the KV cache was computed elsewhere; load it, then decode.
    Decode,
}

/// A validated generation request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GenerateRequest {
    pub endpoint: Endpoint,
    pub model: String,
    /// The prompt text (chat messages rendered as `role: content` lines: the stand-in for
    /// engines whose chat template is not known).
    pub prompt: String,
    /// For chat requests: what the model's chat template renders.
    pub chat: Option<ChatInput>,
    /// vLLM's `add_special_tokens`: whether the tokenizer adds the model's special tokens (a
    /// BOS) to the prompt. vLLM's default is true for completions, false for chat requests
    /// (their template writes the special tokens itself).
    pub add_special_tokens: bool,
    pub max_tokens: u32,
    pub stream: bool,
    pub kv_role: KvRole,
    /// SGLang's disaggregation fields, when the request carries them.
    pub bootstrap: Option<Bootstrap>,
}

/// The parts of a chat request its chat template sees (as vLLM hands them to `transformers`'
/// `apply_chat_template`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatInput {
    /// The `messages`, with text-part lists joined into one string per message.
    pub messages: Value,
    /// The request's `tools`, when it has some.
    pub tools: Option<Value>,
    /// `add_generation_prompt` (default true).
    pub add_generation_prompt: bool,
    /// `chat_template_kwargs`: extra template variables (for example `enable_thinking`).
    pub template_kwargs: serde_json::Map<String, Value>,
}

/// The fields by which SGLang's prefill/decode router pairs the two halves of one request: the
/// prefill instance's host and bootstrap port, and a random room id (0 to 2^63 - 1) that both
/// instances get (docs/engine-contract.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bootstrap {
    pub host: Option<String>,
    pub port: Option<u16>,
    pub room: u64,
}

/// Largest bootstrap room id (SGLang draws them from 0 to 2^63 - 1).
pub const MAX_BOOTSTRAP_ROOM: u64 = (1 << 63) - 1;

/// A request the server refuses, with the OpenAI-style error fields.
#[derive(Debug, thiserror::Error, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum ApiError {
    #[error("request body is not valid JSON: {0}")]
    Json(String),
    #[error("{field}: {problem}")]
    Invalid {
        field: &'static str,
        problem: String,
    },
    #[error("The model `{0}` does not exist.")]
    UnknownModel(String),
}

impl ApiError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }

    /// HTTP status code.
    pub fn status(&self) -> u16 {
        match self {
            ApiError::Json(_) | ApiError::Invalid { .. } => 400,
            ApiError::UnknownModel(_) => 404,
        }
    }

    /// OpenAI-style error body.
    pub fn body(&self) -> Value {
        let (param, code) = match self {
            ApiError::Json(_) => (None, None),
            ApiError::Invalid { field, .. } => (Some(*field), None),
            ApiError::UnknownModel(_) => (Some("model"), Some("model_not_found")),
        };
        error_body(&self.to_string(), "invalid_request_error", param, code)
    }
}

/// An OpenAI-style error body, `{"error": {"message", "type", "param", "code"}}`; `param` and
/// `code` are `null` where `None`.
pub fn error_body(message: &str, kind: &str, param: Option<&str>, code: Option<&str>) -> Value {
    json!({"error": {"message": message, "type": kind, "param": param, "code": code}})
}

fn invalid(field: &'static str, problem: impl Into<String>) -> ApiError {
    ApiError::Invalid {
        field,
        problem: problem.into(),
    }
}

/// Parses and validates a request body for `endpoint`; `served` tells whether a model name is
/// served here.
pub fn parse_request(
    endpoint: Endpoint,
    body: &[u8],
    served: &dyn Fn(&str) -> bool,
) -> Result<GenerateRequest, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| ApiError::Json(e.to_string()))?;
    let obj = value
        .as_object()
        .ok_or_else(|| invalid("body", "must be a JSON object"))?;
    let requested = match obj.get("model") {
        Some(Value::String(m)) => m.clone(),
        Some(_) => return Err(invalid("model", "must be a string")),
        None => return Err(invalid("model", "is required")),
    };
    if !served(&requested) {
        return Err(ApiError::UnknownModel(requested));
    }
    let prompt = match endpoint {
        Endpoint::Completions => match obj.get("prompt") {
            Some(Value::String(p)) => p.clone(),
            Some(Value::Array(items)) => match items.as_slice() {
                [Value::String(p)] => p.clone(),
                [_] => return Err(invalid("prompt", "must be a string")),
                _ => {
                    return Err(invalid(
                        "prompt",
                        "must be a string or an array of exactly one string (batched prompts are not supported)",
                    ));
                }
            },
            Some(_) => return Err(invalid("prompt", "must be a string")),
            None => return Err(invalid("prompt", "is required")),
        },
        Endpoint::ChatCompletions => chat_prompt(obj)?,
    };
    let chat = match endpoint {
        Endpoint::Completions => None,
        Endpoint::ChatCompletions => Some(chat_input(obj)?),
    };
    let add_special_tokens = match obj.get("add_special_tokens") {
        None | Some(Value::Null) => endpoint == Endpoint::Completions,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(invalid("add_special_tokens", "must be a boolean")),
    };
    let max_tokens = match obj
        .get("max_tokens")
        .or_else(|| obj.get("max_completion_tokens"))
    {
        None | Some(Value::Null) => DEFAULT_MAX_TOKENS,
        Some(v) => match v.as_u64() {
            Some(n) if (1..=MAX_TOKENS_LIMIT).contains(&n) => n as u32,
            _ => {
                return Err(invalid(
                    "max_tokens",
                    format!("must be an integer between 1 and {MAX_TOKENS_LIMIT}, got {v}"),
                ));
            }
        },
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(invalid("stream", "must be a boolean")),
    };
    let kv_role = parse_kv_role(obj.get("kv_transfer_params"))?;
    let bootstrap = parse_bootstrap(obj)?;
    Ok(GenerateRequest {
        endpoint,
        model: requested,
        prompt,
        chat,
        add_special_tokens,
        max_tokens,
        stream,
        kv_role,
        bootstrap,
    })
}

/// The validated `messages` of a chat request, each `content` a string (a list of text parts
/// is joined with newlines, as vLLM does for string-content templates).
fn chat_messages(obj: &serde_json::Map<String, Value>) -> Result<Vec<(String, String)>, ApiError> {
    let messages = match obj.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => return Err(invalid("messages", "must not be empty")),
        Some(_) => return Err(invalid("messages", "must be an array")),
        None => return Err(invalid("messages", "is required")),
    };
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid("messages", format!("message {i} needs a string `role`")))?;
            let content = match m.get("content") {
                Some(Value::String(c)) => c.clone(),
                Some(Value::Array(parts)) => text_parts(parts).ok_or_else(|| {
                    invalid(
                        "messages",
                        format!("message {i}: only text content parts are supported"),
                    )
                })?,
                _ => {
                    return Err(invalid(
                        "messages",
                        format!("message {i} needs a string `content` or a list of text parts"),
                    ));
                }
            };
            Ok((role.to_owned(), content))
        })
        .collect()
}

/// `[{"type": "text", "text": ...}, ...]` joined with newlines; `None` for any other part.
fn text_parts(parts: &[Value]) -> Option<String> {
    let texts: Option<Vec<&str>> = parts
        .iter()
        .map(|p| match p.get("type").and_then(Value::as_str) {
            Some("text") => p.get("text").and_then(Value::as_str),
            _ => None,
        })
        .collect();
    Some(texts?.join("\n"))
}

/// Chat messages as `role: content` lines.
fn chat_prompt(obj: &serde_json::Map<String, Value>) -> Result<String, ApiError> {
    Ok(chat_messages(obj)?
        .iter()
        .map(|(role, content)| format!("{role}: {content}\n"))
        .collect())
}

/// What the chat template of a chat request sees: its messages (contents flattened, every
/// other field of a message kept), tools, `add_generation_prompt` and `chat_template_kwargs`.
fn chat_input(obj: &serde_json::Map<String, Value>) -> Result<ChatInput, ApiError> {
    let flat = chat_messages(obj)?;
    let mut messages = obj.get("messages").cloned().unwrap_or(Value::Null);
    if let Value::Array(items) = &mut messages {
        for (m, (_, content)) in items.iter_mut().zip(flat) {
            if let Some(o) = m.as_object_mut() {
                o.insert("content".into(), Value::String(content));
            }
        }
    }
    let tools = obj.get("tools").filter(|t| !t.is_null()).cloned();
    let add_generation_prompt = match obj.get("add_generation_prompt") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(invalid("add_generation_prompt", "must be a boolean")),
    };
    let template_kwargs = match obj.get("chat_template_kwargs") {
        None | Some(Value::Null) => Default::default(),
        Some(Value::Object(o)) => o.clone(),
        Some(_) => return Err(invalid("chat_template_kwargs", "must be an object")),
    };
    Ok(ChatInput {
        messages,
        tools,
        add_generation_prompt,
        template_kwargs,
    })
}

/// SGLang's `bootstrap_host`, `bootstrap_port` and `bootstrap_room`: absent (or null) all
/// together, or at least a room.
fn parse_bootstrap(obj: &serde_json::Map<String, Value>) -> Result<Option<Bootstrap>, ApiError> {
    let field = |name: &str| obj.get(name).filter(|v| !v.is_null());
    let host = match field("bootstrap_host") {
        None => None,
        Some(Value::String(h)) if !h.is_empty() => Some(h.clone()),
        Some(_) => return Err(invalid("bootstrap_host", "must be a non-empty string")),
    };
    let port = match field("bootstrap_port") {
        None => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|p| u16::try_from(p).ok())
                .ok_or_else(|| {
                    invalid(
                        "bootstrap_port",
                        format!("must be an integer port from 0 to 65535, got {v}"),
                    )
                })?,
        ),
    };
    let room = match field("bootstrap_room") {
        None => None,
        Some(v) => Some(
            v.as_u64()
                .filter(|&r| r <= MAX_BOOTSTRAP_ROOM)
                .ok_or_else(|| {
                    invalid(
                        "bootstrap_room",
                        format!("must be an integer from 0 to 2^63 - 1, got {v}"),
                    )
                })?,
        ),
    };
    match (room, host.is_some() || port.is_some()) {
        (Some(room), _) => Ok(Some(Bootstrap { host, port, room })),
        (None, true) => Err(invalid(
            "bootstrap_room",
            "is required with bootstrap_host or bootstrap_port",
        )),
        (None, false) => Ok(None),
    }
}

fn parse_kv_role(params: Option<&Value>) -> Result<KvRole, ApiError> {
    let obj = match params {
        None | Some(Value::Null) => return Ok(KvRole::Standalone),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(invalid("kv_transfer_params", "must be an object")),
    };
    let flag = |name: &'static str| match obj.get(name) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(invalid(
            "kv_transfer_params",
            format!("`{name}` must be a boolean"),
        )),
    };
    match (flag("do_remote_decode")?, flag("do_remote_prefill")?) {
        (true, true) => Err(invalid(
            "kv_transfer_params",
            "`do_remote_decode` and `do_remote_prefill` cannot both be true",
        )),
        (true, false) => Ok(KvRole::Prefill),
        (false, true) => Ok(KvRole::Decode),
        (false, false) => Ok(KvRole::Standalone),
    }
}

/// `kv_transfer_params` of a prefill response: tells the decode engine that the prompt's KV
/// blocks (`blocks` full blocks) are in the pool under the keys both sides derive from it.
pub fn prefill_kv_params(blocks: u64) -> Value {
    json!({"do_remote_prefill": true, "do_remote_decode": false, "kvpool_blocks": blocks})
}

/// Identity and timing fields shared by a response and its chunks.
#[derive(Clone, Debug)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
}

/// Non-streaming response body.
pub fn response_body(
    meta: &ResponseMeta,
    text: &str,
    prompt_tokens: u64,
    completion_tokens: u64,
) -> Value {
    let usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    });
    match meta.endpoint {
        Endpoint::Completions => json!({
            "id": meta.id, "object": "text_completion", "created": meta.created,
            "model": meta.model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": "length"}],
            "usage": usage,
        }),
        Endpoint::ChatCompletions => json!({
            "id": meta.id, "object": "chat.completion", "created": meta.created,
            "model": meta.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "length"}],
            "usage": usage,
        }),
    }
}

/// One streamed chunk carrying `text`; `last` sets the finish reason.
pub fn chunk_body(meta: &ResponseMeta, text: &str, first: bool, last: bool) -> Value {
    let finish = if last { json!("length") } else { Value::Null };
    match meta.endpoint {
        Endpoint::Completions => json!({
            "id": meta.id, "object": "text_completion", "created": meta.created,
            "model": meta.model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
        }),
        Endpoint::ChatCompletions => {
            let delta = if first {
                json!({"role": "assistant", "content": text})
            } else {
                json!({"content": text})
            };
            json!({
                "id": meta.id, "object": "chat.completion.chunk", "created": meta.created,
                "model": meta.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            })
        }
    }
}

/// `/v1/models` body listing `models`.
pub fn models_body<S: AsRef<str>>(models: &[S], created: u64) -> Value {
    let data: Vec<Value> = models
        .iter()
        .map(|m| json!({"id": m.as_ref(), "object": "model", "created": created, "owned_by": "kvpool"}))
        .collect();
    json!({"object": "list", "data": data})
}

/// Path of the optional prefetch endpoint: `POST {"keys": ["<16 hex digits>", ...]}` asks the
/// engine to read those prompt blocks (first block first) from the pool into its local cache.
/// Answers 200 `{"loaded": N}` (the leading blocks now held locally), 400 for a bad body, and
/// 404 from an engine that cannot prefetch (docs/engine-contract.md).
pub const PREFETCH_PATH: &str = "/kvpool/v1/prefetch";

/// Most blocks one prefetch request may name.
pub const MAX_PREFETCH_BLOCKS: usize = 65_536;

/// The prefetch request body for `keys` (hex strings: JSON numbers lose bits past 2^53).
pub fn prefetch_body(keys: &[BlockKey]) -> Value {
    json!({"keys": keys.iter().map(|k| format!("{k:016x}")).collect::<Vec<_>>()})
}

/// The block keys of a prefetch request body.
pub fn parse_prefetch(body: &[u8]) -> Result<Vec<BlockKey>, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ApiError::Json(e.to_string()))?;
    let keys = v
        .get("keys")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("keys", "must be an array of block keys (hex strings)"))?;
    if keys.len() > MAX_PREFETCH_BLOCKS {
        return Err(invalid(
            "keys",
            format!("at most {MAX_PREFETCH_BLOCKS} blocks, got {}", keys.len()),
        ));
    }
    keys.iter()
        .enumerate()
        .map(|(i, k)| {
            k.as_str()
                .filter(|s| !s.is_empty() && s.len() <= 16)
                .and_then(|s| u64::from_str_radix(s, 16).ok())
                .ok_or_else(|| {
                    invalid(
                        "keys",
                        format!("entry {i} must be a block key of 1 to 16 hex digits"),
                    )
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(endpoint: Endpoint, body: &str) -> Result<GenerateRequest, ApiError> {
        parse_request(endpoint, body.as_bytes(), &|m| m == "m")
    }

    #[test]
    fn sglang_bootstrap_fields_parse_and_bad_ones_name_the_field() {
        let r = parse(
            Endpoint::Completions,
            r#"{"model":"m","prompt":"hi","bootstrap_host":"10.0.0.1","bootstrap_port":8998,"bootstrap_room":9223372036854775807}"#,
        )
        .unwrap();
        assert_eq!(
            r.bootstrap,
            Some(Bootstrap {
                host: Some("10.0.0.1".into()),
                port: Some(8998),
                room: MAX_BOOTSTRAP_ROOM,
            })
        );
        let r = parse(
            Endpoint::Completions,
            r#"{"model":"m","prompt":"hi","bootstrap_room":7}"#,
        )
        .unwrap();
        assert_eq!(
            r.bootstrap.map(|b| (b.host, b.port, b.room)),
            Some((None, None, 7))
        );
        let r = parse(
            Endpoint::Completions,
            r#"{"model":"m","prompt":"hi","bootstrap_room":null}"#,
        )
        .unwrap();
        assert_eq!(r.bootstrap, None);
        let field = |body: &str| match parse(Endpoint::Completions, body) {
            Err(ApiError::Invalid { field, .. }) => field,
            other => panic!("{body}: {other:?}"),
        };
        assert_eq!(
            field(r#"{"model":"m","prompt":"hi","bootstrap_room":9223372036854775808}"#),
            "bootstrap_room"
        );
        assert_eq!(
            field(r#"{"model":"m","prompt":"hi","bootstrap_room":-1}"#),
            "bootstrap_room"
        );
        assert_eq!(
            field(r#"{"model":"m","prompt":"hi","bootstrap_room":"7"}"#),
            "bootstrap_room"
        );
        assert_eq!(
            field(r#"{"model":"m","prompt":"hi","bootstrap_host":"h"}"#),
            "bootstrap_room"
        );
        assert_eq!(
            field(r#"{"model":"m","prompt":"hi","bootstrap_room":1,"bootstrap_port":70000}"#),
            "bootstrap_port"
        );
        assert_eq!(
            field(r#"{"model":"m","prompt":"hi","bootstrap_room":1,"bootstrap_host":""}"#),
            "bootstrap_host"
        );
    }

    #[test]
    fn parses_completions_and_chat() {
        let r = parse(
            Endpoint::Completions,
            r#"{"model":"m","prompt":"hi","max_tokens":3,"stream":true}"#,
        )
        .unwrap();
        assert_eq!((r.prompt.as_str(), r.max_tokens, r.stream), ("hi", 3, true));
        let r = parse(Endpoint::Completions, r#"{"model":"m","prompt":["x"]}"#).unwrap();
        assert_eq!(
            (r.prompt.as_str(), r.max_tokens, r.stream),
            ("x", 16, false)
        );
        let r = parse(
            Endpoint::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]}"#,
        )
        .unwrap();
        assert_eq!(r.prompt, "system: be brief\nuser: hi\n");
        assert_eq!(r.kv_role, KvRole::Standalone);
        let r = parse(
            Endpoint::Completions,
            r#"{"model":"m","prompt":"x","kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false}}"#,
        )
        .unwrap();
        assert_eq!(r.kv_role, KvRole::Prefill);
        let body = format!(
            r#"{{"model":"m","prompt":"x","kv_transfer_params":{}}}"#,
            prefill_kv_params(3)
        );
        assert_eq!(
            parse(Endpoint::Completions, &body).unwrap().kv_role,
            KvRole::Decode
        );
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (Endpoint::Completions, "{", "json"),
            (Endpoint::Completions, "[]", "body"),
            (Endpoint::Completions, r#"{"prompt":"x"}"#, "model"),
            (Endpoint::Completions, r#"{"model":"m"}"#, "prompt"),
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":["a","b"]}"#,
                "prompt",
            ),
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":"a","max_tokens":0}"#,
                "max_tokens",
            ),
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":"a","max_tokens":-1}"#,
                "max_tokens",
            ),
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":"a","stream":"yes"}"#,
                "stream",
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":[]}"#,
                "messages",
            ),
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":"a","kv_transfer_params":[]}"#,
                "kv_transfer_params",
            ),
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":"a","kv_transfer_params":{"do_remote_decode":1}}"#,
                "kv_transfer_params",
            ),
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":"a","kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":true}}"#,
                "kv_transfer_params",
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":[{"role":"user"}]}"#,
                "messages",
            ),
        ];
        for (endpoint, body, field) in cases {
            let err = parse(endpoint, body).unwrap_err();
            assert_eq!(err.status(), 400, "{body}");
            match &err {
                ApiError::Json(_) => assert_eq!(field, "json"),
                ApiError::Invalid { field: f, .. } => assert_eq!(*f, field, "{body}"),
                other => panic!("{other:?}"),
            }
            assert_eq!(err.body()["error"]["type"], "invalid_request_error");
        }
        let err = parse(Endpoint::Completions, r#"{"model":"other","prompt":"a"}"#).unwrap_err();
        assert_eq!(err.status(), 404);
        assert_eq!(err.body()["error"]["code"], "model_not_found");
    }

    #[test]
    fn bodies_have_openai_shape() {
        let meta = ResponseMeta {
            id: "cmpl-1".into(),
            created: 5,
            model: "m".into(),
            endpoint: Endpoint::ChatCompletions,
        };
        let b = response_body(&meta, "ok", 3, 2);
        assert_eq!(b["choices"][0]["message"]["content"], "ok");
        assert_eq!(b["usage"]["total_tokens"], 5);
        let c = chunk_body(&meta, "a", true, false);
        assert_eq!(c["choices"][0]["delta"]["role"], "assistant");
        assert!(c["choices"][0]["finish_reason"].is_null());
        let c = chunk_body(&meta, "b", false, true);
        assert_eq!(c["choices"][0]["finish_reason"], "length");
        assert_eq!(models_body(&["m"], 1)["data"][0]["id"], "m");
        assert_eq!(models_body::<&str>(&[], 1)["data"], json!([]));
    }

    #[test]
    fn prefetch_bodies_round_trip_and_bad_ones_name_the_field() {
        let keys = [0, 1, u64::MAX, 0x0123_4567_89ab_cdef];
        let body = prefetch_body(&keys).to_string();
        assert!(body.contains("\"ffffffffffffffff\""), "{body}");
        assert_eq!(parse_prefetch(body.as_bytes()).unwrap(), keys);
        for bad in [
            r#"{"keys": [1]}"#,
            r#"{"keys": ["xyz"]}"#,
            r#"{"keys": ["00000000000000001"]}"#,
            r#"{"keys": [""]}"#,
            r#"{"key": []}"#,
        ] {
            match parse_prefetch(bad.as_bytes()) {
                Err(ApiError::Invalid { field, .. }) => assert_eq!(field, "keys", "{bad}"),
                other => panic!("{bad}: {other:?}"),
            }
        }
        assert!(matches!(parse_prefetch(b"{"), Err(ApiError::Json(_))));
    }

    #[test]
    fn chat_requests_keep_what_the_template_needs() {
        let r = parse(
            Endpoint::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}],"name":"x"}],"tools":[{"type":"function"}],"add_generation_prompt":false,"chat_template_kwargs":{"enable_thinking":false}}"#,
        )
        .unwrap();
        assert_eq!(r.prompt, "user: a\nb\n");
        assert!(
            !r.add_special_tokens,
            "chat requests default to no special tokens"
        );
        let chat = r.chat.expect("chat input");
        assert_eq!(
            chat.messages,
            json!([{"role": "user", "content": "a\nb", "name": "x"}])
        );
        assert_eq!(chat.tools, Some(json!([{"type": "function"}])));
        assert!(!chat.add_generation_prompt);
        assert_eq!(chat.template_kwargs["enable_thinking"], json!(false));
        let plain = parse(
            Endpoint::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"user","content":"q"}],"add_special_tokens":true}"#,
        )
        .unwrap();
        assert!(plain.add_special_tokens);
        assert!(plain.chat.expect("chat").add_generation_prompt);
    }

    #[test]
    fn completions_add_special_tokens_unless_told_not_to() {
        let r = parse(Endpoint::Completions, r#"{"model":"m","prompt":"x"}"#).unwrap();
        assert!(r.add_special_tokens);
        assert!(r.chat.is_none());
        let off = parse(
            Endpoint::Completions,
            r#"{"model":"m","prompt":"x","add_special_tokens":false}"#,
        )
        .unwrap();
        assert!(!off.add_special_tokens);
        for (endpoint, body, field) in [
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":"x","add_special_tokens":1}"#,
                "add_special_tokens",
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":[{"role":"u","content":[{"type":"image_url"}]}]}"#,
                "messages",
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":[{"role":"u","content":"q"}],"chat_template_kwargs":[]}"#,
                "chat_template_kwargs",
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":[{"role":"u","content":"q"}],"add_generation_prompt":"yes"}"#,
                "add_generation_prompt",
            ),
        ] {
            match parse(endpoint, body) {
                Err(ApiError::Invalid { field: f, .. }) => assert_eq!(f, field, "{body}"),
                other => panic!("{body}: {other:?}"),
            }
        }
    }
}

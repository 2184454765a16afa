//! OpenAI-compatible request parsing and errors (`/v1/completions`, `/v1/chat/completions`):
//! the HTTP contract the conductor and the engines both speak, with every request shape the
//! OpenAI API and vLLM's server take (docs/openai.md); the response bodies are in
//! `openai_bodies`. Pure: JSON values in, JSON values out; the HTTP server owns the I/O.
//! Validation errors name the offending field.

use serde_json::{Value, json};

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
/// Its name as the command line and logs spell it: `<&str>::from(p)` (`vllm`, `sglang`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
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

/// A validated generation request: the typed view of the fields the conductor and the engines
/// act on. Every other field stays in the request's JSON object (the conductor forwards that
/// object untouched; see docs/openai.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GenerateRequest {
    pub endpoint: Endpoint,
    pub model: String,
    /// The prompts, at least one: a completions request's (several when batched), or a chat
    /// request's messages as `role: content` lines (the stand-in for engines whose chat template
    /// is not known).
    pub prompts: Vec<Prompt>,
    /// For chat requests: what the model's chat template renders.
    pub chat: Option<ChatInput>,
    /// vLLM's `add_special_tokens`: whether the tokenizer adds the model's special tokens (a
    /// BOS) to a text prompt. vLLM's default is true for completions, false for chat requests
    /// (their template writes the special tokens itself). Token-id prompts are taken as they are.
    pub add_special_tokens: bool,
    /// Tokens generated per choice at most.
    pub max_tokens: u32,
    /// `n`: choices generated for each prompt.
    pub n: u32,
    pub stream: bool,
    /// `stream_options.include_usage`: a streamed response ends with a chunk that carries the
    /// usage (and no choice).
    pub include_usage: bool,
    pub kv_role: KvRole,
    /// SGLang's disaggregation fields, when the request carries them.
    pub bootstrap: Option<Bootstrap>,
}

impl GenerateRequest {
    /// Choices the response carries: `n` for each prompt.
    pub fn choices(&self) -> u64 {
        self.prompts.len() as u64 * u64::from(self.n)
    }

    /// Output tokens the request generates at most, over all its choices.
    pub fn output_tokens(&self) -> u64 {
        self.choices() * u64::from(self.max_tokens)
    }
}

/// One prompt: text, or token ids that the engine takes as they are (no tokenizer, no special
/// tokens added).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// The message roles a chat request may use (OpenAI's, with vLLM's `function`).
pub const CHAT_ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

/// Most choices per prompt (`n`), as OpenAI allows.
pub const MAX_N: u64 = 128;

/// The parts of a chat request its chat template sees (as vLLM hands them to `transformers`'
/// `apply_chat_template`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatInput {
    /// The `messages`, with content-part lists joined into one string of their text parts per
    /// message (a `null` or absent `content` stays so).
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

/// A request body as its JSON object (what the conductor forwards), or why it is not one.
pub fn parse_body(body: &[u8]) -> Result<serde_json::Map<String, Value>, ApiError> {
    match serde_json::from_slice(body).map_err(|e| ApiError::Json(e.to_string()))? {
        Value::Object(obj) => Ok(obj),
        _ => Err(invalid("body", "must be a JSON object")),
    }
}

/// Parses and validates a request body for `endpoint`; `served` tells whether a model name is
/// served here.
pub fn parse_request(
    endpoint: Endpoint,
    body: &[u8],
    served: &dyn Fn(&str) -> bool,
) -> Result<GenerateRequest, ApiError> {
    parse_object(endpoint, &parse_body(body)?, served)
}

/// Validates a request's JSON object for `endpoint` into its typed view; `served` tells
/// whether a model name is served here. Fields it does not know are left alone.
pub fn parse_object(
    endpoint: Endpoint,
    obj: &serde_json::Map<String, Value>,
    served: &dyn Fn(&str) -> bool,
) -> Result<GenerateRequest, ApiError> {
    let requested = match obj.get("model") {
        Some(Value::String(m)) => m.clone(),
        Some(_) => return Err(invalid("model", "must be a string")),
        None => return Err(invalid("model", "is required")),
    };
    if !served(&requested) {
        return Err(ApiError::UnknownModel(requested));
    }
    let (prompts, chat) = match endpoint {
        Endpoint::Completions => (completion_prompts(obj)?, None),
        Endpoint::ChatCompletions => {
            let flat = chat_messages(obj)?;
            let lines = flat
                .iter()
                .map(|(role, content)| format!("{role}: {}\n", content.as_deref().unwrap_or("")))
                .collect();
            (vec![Prompt::Text(lines)], Some(chat_input(obj, flat)?))
        }
    };
    let add_special_tokens = flag(obj, "add_special_tokens", endpoint == Endpoint::Completions)?;
    let max_tokens = obj
        .get("max_tokens")
        .filter(|v| !v.is_null())
        .or_else(|| obj.get("max_completion_tokens"));
    let max_tokens = count(
        max_tokens,
        "max_tokens",
        DEFAULT_MAX_TOKENS,
        MAX_TOKENS_LIMIT,
    )?;
    let n = count(obj.get("n"), "n", 1, MAX_N)?;
    let stream = flag(obj, "stream", false)?;
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(_)) if !stream => {
            return Err(invalid(
                "stream_options",
                "is only allowed with `stream: true`",
            ));
        }
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(invalid(
                    "stream_options",
                    "`include_usage` must be a boolean",
                ));
            }
        },
        Some(_) => return Err(invalid("stream_options", "must be an object")),
    };
    sampling(obj)?;
    let kv_role = parse_kv_role(obj.get("kv_transfer_params"))?;
    let bootstrap = parse_bootstrap(obj)?;
    Ok(GenerateRequest {
        endpoint,
        model: requested,
        prompts,
        chat,
        add_special_tokens,
        max_tokens,
        n,
        stream,
        include_usage,
        kv_role,
        bootstrap,
    })
}

/// The sampling fields the engines would refuse, refused here first with the same bounds as
/// OpenAI and vLLM: `temperature` 0 to 2, `top_p` above 0 up to 1, `top_k` -1 (off) or a
/// positive integer, `presence_penalty` and `frequency_penalty` -2 to 2,
/// `repetition_penalty` above 0, `min_p` 0 to 1. Absent or null fields are left alone.
fn sampling(obj: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    let number =
        |field: &'static str, ok: &dyn Fn(f64) -> bool, range: &str| -> Result<(), ApiError> {
            match obj.get(field) {
                None | Some(Value::Null) => Ok(()),
                Some(v) => match v.as_f64() {
                    Some(x) if x.is_finite() && ok(x) => Ok(()),
                    _ => Err(invalid(field, format!("must be a number {range}, got {v}"))),
                },
            }
        };
    number("temperature", &|x| (0.0..=2.0).contains(&x), "from 0 to 2")?;
    number("top_p", &|x| x > 0.0 && x <= 1.0, "above 0 and at most 1")?;
    number(
        "presence_penalty",
        &|x| (-2.0..=2.0).contains(&x),
        "from -2 to 2",
    )?;
    number(
        "frequency_penalty",
        &|x| (-2.0..=2.0).contains(&x),
        "from -2 to 2",
    )?;
    number("repetition_penalty", &|x| x > 0.0, "above 0")?;
    number("min_p", &|x| (0.0..=1.0).contains(&x), "from 0 to 1")?;
    match obj.get("top_k") {
        None | Some(Value::Null) => Ok(()),
        Some(v) => match v.as_i64() {
            Some(k) if k == -1 || k > 0 => Ok(()),
            _ => Err(invalid(
                "top_k",
                format!("must be -1 or a positive integer, got {v}"),
            )),
        },
    }
}

/// A boolean field; `default` when absent or null.
fn flag(
    obj: &serde_json::Map<String, Value>,
    field: &'static str,
    default: bool,
) -> Result<bool, ApiError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(invalid(field, "must be a boolean")),
    }
}

/// An integer field between 1 and `max`; `default` when absent or null.
fn count(v: Option<&Value>, field: &'static str, default: u32, max: u64) -> Result<u32, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(default),
        Some(v) => match v.as_u64() {
            Some(n) if (1..=max).contains(&n) => Ok(n as u32),
            _ => Err(invalid(
                field,
                format!("must be an integer between 1 and {max}, got {v}"),
            )),
        },
    }
}

/// The prompts of a completions request: a string, an array of strings (a batch), an array
/// of token ids, or an array of token-id arrays (a batch), as OpenAI and vLLM take them.
fn completion_prompts(obj: &serde_json::Map<String, Value>) -> Result<Vec<Prompt>, ApiError> {
    const SHAPES: &str = "must be a string, an array of strings, an array of token ids or an \
                          array of token-id arrays";
    let items = match obj.get("prompt") {
        Some(Value::String(p)) => return Ok(vec![Prompt::Text(p.clone())]),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(invalid("prompt", SHAPES)),
        None => return Err(invalid("prompt", "is required")),
    };
    let bad_item = |i: usize| invalid("prompt", format!("item {i}: {SHAPES}, of one kind"));
    match items.first() {
        None => Err(invalid("prompt", "must not be an empty array")),
        Some(Value::String(_)) => items
            .iter()
            .enumerate()
            .map(|(i, p)| match p {
                Value::String(s) => Ok(Prompt::Text(s.clone())),
                _ => Err(bad_item(i)),
            })
            .collect(),
        Some(Value::Number(_)) => Ok(vec![Prompt::Tokens(token_ids(items, None)?)]),
        Some(Value::Array(_)) => items
            .iter()
            .enumerate()
            .map(|(i, p)| match p {
                Value::Array(ids) if !ids.is_empty() => token_ids(ids, Some(i)).map(Prompt::Tokens),
                _ => Err(bad_item(i)),
            })
            .collect(),
        Some(_) => Err(bad_item(0)),
    }
}

/// Token ids (each 0 to 2^32 - 1) of a prompt; `batch` is the prompt's place in a batch.
fn token_ids(items: &[Value], batch: Option<usize>) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(j, t)| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| {
                    let at = batch.map_or(String::new(), |i| format!("prompt {i}, "));
                    invalid(
                        "prompt",
                        format!(
                            "{at}token {j}: a token id is an integer from 0 to 2^32 - 1, got {t}"
                        ),
                    )
                })
        })
        .collect()
}

/// The validated `messages` of a chat request: each role (one of [`CHAT_ROLES`]) and its text
/// content: a string, the text parts of a content-part list joined with newlines (as vLLM does
/// for string-content templates; other parts such as images are the engine's), or `None` for a
/// `null` or absent `content` (an assistant turn that only calls tools).
fn chat_messages(
    obj: &serde_json::Map<String, Value>,
) -> Result<Vec<(String, Option<String>)>, ApiError> {
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
            let role = match m.get("role") {
                Some(Value::String(r)) if CHAT_ROLES.contains(&r.as_str()) => r,
                Some(Value::String(r)) => {
                    return Err(invalid(
                        "messages",
                        format!(
                            "messages[{i}].role: `{r}` is not one of {}",
                            CHAT_ROLES.join(", ")
                        ),
                    ));
                }
                _ => {
                    return Err(invalid(
                        "messages",
                        format!("messages[{i}] needs a string `role`"),
                    ));
                }
            };
            let content = match m.get("content") {
                None | Some(Value::Null) => None,
                Some(Value::String(c)) => Some(c.clone()),
                Some(Value::Array(parts)) => Some(text_parts(parts).map_err(|j| {
                    invalid(
                        "messages",
                        format!(
                            "messages[{i}].content[{j}] must be an object with a string `type` \
                             (a `text` part with a string `text`)"
                        ),
                    )
                })?),
                Some(_) => {
                    return Err(invalid(
                        "messages",
                        format!(
                            "messages[{i}].content must be a string, a list of content parts \
                             or null"
                        ),
                    ));
                }
            };
            Ok((role.clone(), content))
        })
        .collect()
}

/// The `text` parts of a content-part list joined with newlines; other parts (images, audio,
/// files, refusals) are skipped. `Err(j)`: part `j` is malformed.
fn text_parts(parts: &[Value]) -> Result<String, usize> {
    let mut texts = Vec::new();
    for (j, p) in parts.iter().enumerate() {
        match p.get("type").and_then(Value::as_str) {
            Some("text") => texts.push(p.get("text").and_then(Value::as_str).ok_or(j)?),
            Some(_) => {}
            None => return Err(j),
        }
    }
    Ok(texts.join("\n"))
}

/// What the chat template of a chat request sees: its messages (content-part lists flattened
/// to their text as `flat` says, every other field of a message kept), tools,
/// `add_generation_prompt` and `chat_template_kwargs`.
fn chat_input(
    obj: &serde_json::Map<String, Value>,
    flat: Vec<(String, Option<String>)>,
) -> Result<ChatInput, ApiError> {
    let mut messages = obj.get("messages").cloned().unwrap_or(Value::Null);
    if let Value::Array(items) = &mut messages {
        for (m, (_, content)) in items.iter_mut().zip(flat) {
            if let (Some(o), Some(text)) = (m.as_object_mut(), content)
                && !o.get("content").is_some_and(Value::is_string)
            {
                o.insert("content".into(), Value::String(text));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(endpoint: Endpoint, body: &str) -> Result<GenerateRequest, ApiError> {
        parse_request(endpoint, body.as_bytes(), &|m| m == "m")
    }

    /// A completions request that must parse.
    fn completion(body: &str) -> GenerateRequest {
        parse(Endpoint::Completions, body).unwrap()
    }

    fn text(t: &str) -> Vec<Prompt> {
        vec![Prompt::Text(t.into())]
    }

    fn invalid_field(endpoint: Endpoint, body: &str) -> &'static str {
        match parse(endpoint, body) {
            Err(ApiError::Invalid { field, .. }) => field,
            other => panic!("{body}: {other:?}"),
        }
    }

    #[test]
    fn completions_take_batched_and_token_id_prompts() {
        let r = completion(r#"{"model":"m","prompt":["a","b"],"n":3}"#);
        assert_eq!(
            r.prompts,
            vec![Prompt::Text("a".into()), Prompt::Text("b".into())]
        );
        assert_eq!((r.n, r.choices(), r.output_tokens()), (3, 6, 96));
        let r = completion(r#"{"model":"m","prompt":[1,2,3]}"#);
        assert_eq!(r.prompts, vec![Prompt::Tokens(vec![1, 2, 3])]);
        let r = completion(r#"{"model":"m","prompt":[[1],[4294967295,0]]}"#);
        assert_eq!(
            r.prompts,
            vec![Prompt::Tokens(vec![1]), Prompt::Tokens(vec![u32::MAX, 0])]
        );
        for bad in [
            r#"{"model":"m","prompt":[]}"#,
            r#"{"model":"m","prompt":[1,"a"]}"#,
            r#"{"model":"m","prompt":[-1]}"#,
            r#"{"model":"m","prompt":[4294967296]}"#,
            r#"{"model":"m","prompt":[[1],[]]}"#,
            r#"{"model":"m","prompt":[[1],2]}"#,
            r#"{"model":"m","prompt":[{"a":1}]}"#,
            r#"{"model":"m","prompt":3}"#,
        ] {
            assert_eq!(invalid_field(Endpoint::Completions, bad), "prompt", "{bad}");
        }
        for (bad, field) in [
            (r#"{"model":"m","prompt":"a","n":0}"#, "n"),
            (r#"{"model":"m","prompt":"a","n":129}"#, "n"),
            (
                r#"{"model":"m","prompt":"a","stream_options":{"include_usage":true}}"#,
                "stream_options",
            ),
            (
                r#"{"model":"m","prompt":"a","stream":true,"stream_options":{"include_usage":1}}"#,
                "stream_options",
            ),
            (
                r#"{"model":"m","prompt":"a","stream":true,"stream_options":[]}"#,
                "stream_options",
            ),
        ] {
            assert_eq!(invalid_field(Endpoint::Completions, bad), field, "{bad}");
        }
    }

    #[test]
    fn stream_options_and_unknown_fields_are_read_or_left_alone() {
        let r = completion(
            r#"{"model":"m","prompt":"a","stream":true,"stream_options":{"include_usage":true},"stop":["x"],"echo":true,"logprobs":2,"seed":1,"something_new":{"a":1}}"#,
        );
        assert!(r.stream && r.include_usage);
        let r = completion(r#"{"model":"m","prompt":"a","stream":true,"stream_options":{}}"#);
        assert!(!r.include_usage);
        let r =
            completion(r#"{"model":"m","prompt":"a","max_tokens":null,"max_completion_tokens":5}"#);
        assert_eq!(r.max_tokens, 5);
    }

    #[test]
    fn chat_takes_every_role_content_parts_and_tool_call_turns() {
        let r = parse(
            Endpoint::ChatCompletions,
            r#"{"model":"m","messages":[
                {"role":"developer","content":"d"},
                {"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"data:x"}},{"type":"text","text":"here"}]},
                {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},
                {"role":"tool","tool_call_id":"c1","content":"42"},
                {"role":"function","name":"f","content":"1"},
                {"role":"assistant"}],
              "tools":[{"type":"function","function":{"name":"f","parameters":{}}}],
              "response_format":{"type":"json_object"}}"#,
        )
        .unwrap();
        assert_eq!(
            r.prompts,
            text(
                "developer: d\nuser: look\nhere\nassistant: \ntool: 42\nfunction: 1\nassistant: \n"
            )
        );
        let chat = r.chat.expect("chat");
        // The template sees the text of the parts, and a tool-call turn as it came.
        assert_eq!(chat.messages[1]["content"], "look\nhere");
        assert!(chat.messages[2]["content"].is_null());
        assert_eq!(chat.messages[2]["tool_calls"][0]["id"], "c1");
        assert!(chat.messages[5].get("content").is_none());
        for bad in [
            r#"{"model":"m","messages":[{"role":"robot","content":"x"}]}"#,
            r#"{"model":"m","messages":[{"content":"x"}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":3}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text"}]}]}"#,
            r#"{"model":"m","messages":"hi"}"#,
        ] {
            assert_eq!(
                invalid_field(Endpoint::ChatCompletions, bad),
                "messages",
                "{bad}"
            );
        }
        let err = parse(
            Endpoint::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"robot","content":"x"}]}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("messages[0].role"), "{err}");
    }

    #[test]
    fn sglang_bootstrap_fields_parse_and_bad_ones_name_the_field() {
        let r = completion(
            r#"{"model":"m","prompt":"hi","bootstrap_host":"10.0.0.1","bootstrap_port":8998,"bootstrap_room":9223372036854775807}"#,
        );
        assert_eq!(
            r.bootstrap,
            Some(Bootstrap {
                host: Some("10.0.0.1".into()),
                port: Some(8998),
                room: MAX_BOOTSTRAP_ROOM,
            })
        );
        let r = completion(r#"{"model":"m","prompt":"hi","bootstrap_room":7}"#);
        assert_eq!(
            r.bootstrap.map(|b| (b.host, b.port, b.room)),
            Some((None, None, 7))
        );
        let r = completion(r#"{"model":"m","prompt":"hi","bootstrap_room":null}"#);
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
        let r = completion(r#"{"model":"m","prompt":"hi","max_tokens":3,"stream":true}"#);
        assert_eq!((r.prompts, r.max_tokens, r.stream), (text("hi"), 3, true));
        let r = completion(r#"{"model":"m","prompt":["x"]}"#);
        assert_eq!((r.prompts, r.max_tokens, r.stream), (text("x"), 16, false));
        let r = parse(
            Endpoint::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]}"#,
        )
        .unwrap();
        assert_eq!(r.prompts, text("system: be brief\nuser: hi\n"));
        assert_eq!(r.kv_role, KvRole::Standalone);
        let r = completion(
            r#"{"model":"m","prompt":"x","kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false}}"#,
        );
        assert_eq!(r.kv_role, KvRole::Prefill);
        let body = format!(
            r#"{{"model":"m","prompt":"x","kv_transfer_params":{}}}"#,
            prefill_kv_params(3)
        );
        assert_eq!(completion(&body).kv_role, KvRole::Decode);
    }

    #[test]
    fn errors_name_the_field() {
        // (body, the field the error names), per endpoint.
        let completions = [
            ("{", "json"),
            ("[]", "body"),
            (r#"{"prompt":"x"}"#, "model"),
            (r#"{"model":"m"}"#, "prompt"),
            (r#"{"model":"m","prompt":["a",1]}"#, "prompt"),
            (r#"{"model":"m","prompt":"a","max_tokens":0}"#, "max_tokens"),
            (
                r#"{"model":"m","prompt":"a","max_tokens":-1}"#,
                "max_tokens",
            ),
            (r#"{"model":"m","prompt":"a","stream":"yes"}"#, "stream"),
            (
                r#"{"model":"m","prompt":"a","temperature":-0.5}"#,
                "temperature",
            ),
            (
                r#"{"model":"m","prompt":"a","temperature":"hot"}"#,
                "temperature",
            ),
            (r#"{"model":"m","prompt":"a","top_p":0}"#, "top_p"),
            (r#"{"model":"m","prompt":"a","top_k":0}"#, "top_k"),
            (
                r#"{"model":"m","prompt":"a","presence_penalty":3}"#,
                "presence_penalty",
            ),
            (
                r#"{"model":"m","prompt":"a","frequency_penalty":-2.5}"#,
                "frequency_penalty",
            ),
            (
                r#"{"model":"m","prompt":"a","repetition_penalty":0}"#,
                "repetition_penalty",
            ),
            (r#"{"model":"m","prompt":"a","min_p":1.5}"#, "min_p"),
            (
                r#"{"model":"m","prompt":"a","kv_transfer_params":[]}"#,
                "kv_transfer_params",
            ),
            (
                r#"{"model":"m","prompt":"a","kv_transfer_params":{"do_remote_decode":1}}"#,
                "kv_transfer_params",
            ),
            (
                r#"{"model":"m","prompt":"a","kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":true}}"#,
                "kv_transfer_params",
            ),
        ];
        let chat = [
            (r#"{"model":"m","messages":[]}"#, "messages"),
            (
                r#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
                "messages",
            ),
        ];
        let cases = (completions.map(|(body, field)| (Endpoint::Completions, body, field)))
            .into_iter()
            .chain(chat.map(|(body, field)| (Endpoint::ChatCompletions, body, field)));
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
    fn chat_requests_keep_what_the_template_needs() {
        let r = parse(
            Endpoint::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}],"name":"x"}],"tools":[{"type":"function"}],"add_generation_prompt":false,"chat_template_kwargs":{"enable_thinking":false}}"#,
        )
        .unwrap();
        assert_eq!(r.prompts, text("user: a\nb\n"));
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
        let r = completion(r#"{"model":"m","prompt":"x"}"#);
        assert!(r.add_special_tokens);
        assert!(r.chat.is_none());
        let off = completion(r#"{"model":"m","prompt":"x","add_special_tokens":false}"#);
        assert!(!off.add_special_tokens);
        for (endpoint, body, field) in [
            (
                Endpoint::Completions,
                r#"{"model":"m","prompt":"x","add_special_tokens":1}"#,
                "add_special_tokens",
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":[{"role":"user","content":[{"text":"no type"}]}]}"#,
                "messages",
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":[{"role":"user","content":"q"}],"chat_template_kwargs":[]}"#,
                "chat_template_kwargs",
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"model":"m","messages":[{"role":"user","content":"q"}],"add_generation_prompt":"yes"}"#,
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

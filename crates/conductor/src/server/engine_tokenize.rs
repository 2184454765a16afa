//! Prompt tokens from the engines themselves (`--tokenizer engine`): the first prompt of each
//! request is sent to a prefill engine's `/tokenize` (vLLM's endpoint: the served model's own
//! tokenizer and chat template, with the request's `add_special_tokens` and chat settings), so
//! that the block keys the conductor computes follow the engines' tokens without a tokenizer
//! file at the conductor: the operator's conductor, which the engine pools' model directory
//! never reaches, uses it. A failed, refused or slow call (an engine without `/tokenize`, such
//! as the synthetic one) falls back to stand-in chunks for that request and is counted in
//! `kvpool_conductor_engine_tokenize_total{outcome}`. I/O boundary: the engine call.

use std::time::Duration;

use serde_json::{Map, Value};

use super::shared::Shared;
use super::upstream::{engine_url, read_body};

/// Longest wait for an engine's `/tokenize`.
pub const ENGINE_TOKENIZE_TIMEOUT: Duration = Duration::from_secs(2);

/// Fields of a chat or completion request that change how vLLM's `/tokenize` tokenises it.
const CARRIED: [&str; 6] = [
    "add_special_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
];

/// The `/tokenize` body for the first prompt of a client request: its model and messages (a
/// chat request) or its first text prompt, with the settings of [`CARRIED`]; `None` when the
/// first prompt is token ids already (nothing to ask) or there is no prompt.
pub fn tokenize_body(body: &Map<String, Value>) -> Option<Value> {
    let mut out = Map::new();
    out.insert("model".into(), body.get("model")?.clone());
    if let Some(messages) = body.get("messages") {
        out.insert("messages".into(), messages.clone());
        // vLLM's chat completions add the assistant's prompt unless told otherwise.
        out.insert("add_generation_prompt".into(), Value::Bool(true));
    } else {
        let text = match body.get("prompt")? {
            Value::String(s) => s.clone(),
            Value::Array(items) => items.first()?.as_str()?.to_owned(),
            _ => return None,
        };
        out.insert("prompt".into(), Value::String(text));
    }
    for k in CARRIED {
        if let Some(v) = body.get(k) {
            out.insert(k.into(), v.clone());
        }
    }
    Some(Value::Object(out))
}

/// The token ids of `/tokenize`'s answer (`{"tokens": [...]}`).
pub fn tokens_of(answer: &[u8]) -> Option<Vec<u32>> {
    let v: Value = serde_json::from_slice(answer).ok()?;
    v.get("tokens")?
        .as_array()?
        .iter()
        .map(|t| t.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

/// The first prompt's token ids as `engine` tokenises them, or `None` (counted by outcome)
/// when it cannot say.
pub(super) async fn engine_tokens(
    shared: &Shared,
    engine: &str,
    body: &Map<String, Value>,
) -> Option<Vec<u32>> {
    let count = |outcome: &str| {
        shared
            .metrics
            .engine_tokenize
            .with_label_values(&[outcome])
            .inc()
    };
    let ask = tokenize_body(body)?;
    let url = engine_url(engine, "/tokenize");
    let call = async {
        let resp = shared.upstream.post(url.clone(), &ask).await.ok()?;
        if !resp.status().is_success() {
            return Some(None);
        }
        Some(tokens_of(
            &read_body(url.clone(), resp.into_body()).await.ok()?,
        ))
    };
    match tokio::time::timeout(ENGINE_TOKENIZE_TIMEOUT, call).await {
        Ok(Some(Some(ids))) => {
            count("ok");
            Some(ids)
        }
        Ok(Some(None)) => {
            count("refused");
            None
        }
        Ok(None) => {
            count("error");
            None
        }
        Err(_) => {
            count("timeout");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().expect("object")
    }

    #[test]
    fn completion_and_chat_bodies_carry_what_changes_the_tokens() {
        let b = tokenize_body(&obj(json!({"model": "m", "prompt": "hi", "max_tokens": 3,
            "add_special_tokens": false})))
        .expect("text prompt");
        assert_eq!(
            b,
            json!({"model": "m", "prompt": "hi", "add_special_tokens": false})
        );
        let b = tokenize_body(&obj(json!({"model": "m", "prompt": ["a", "b"]}))).expect("batch");
        assert_eq!(b["prompt"], "a");
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let b = tokenize_body(&obj(json!({"model": "m", "messages": msgs,
            "chat_template_kwargs": {"x": 1}, "temperature": 0})))
        .expect("chat");
        assert_eq!(
            b,
            json!({"model": "m", "messages": msgs, "add_generation_prompt": true,
                   "chat_template_kwargs": {"x": 1}})
        );
        let b = tokenize_body(&obj(json!({"model": "m", "messages": msgs,
            "add_generation_prompt": false})))
        .expect("chat");
        assert_eq!(b["add_generation_prompt"], false);
        // Token ids need no tokenising; nothing to tokenise without a model or prompt.
        assert_eq!(
            tokenize_body(&obj(json!({"model": "m", "prompt": [1, 2]}))),
            None
        );
        assert_eq!(tokenize_body(&obj(json!({"prompt": "x"}))), None);
        assert_eq!(tokenize_body(&obj(json!({"model": "m"}))), None);
    }

    #[test]
    fn answers_are_read_strictly() {
        assert_eq!(
            tokens_of(br#"{"count":2,"tokens":[1,4096]}"#),
            Some(vec![1, 4096])
        );
        assert_eq!(tokens_of(br#"{"tokens":[1,-2]}"#), None);
        assert_eq!(tokens_of(br#"{"tokens":[1,4294967296]}"#), None);
        assert_eq!(tokens_of(br#"{"detail":"Not Found"}"#), None);
        assert_eq!(tokens_of(b"not json"), None);
    }
}

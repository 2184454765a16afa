//! OpenAI-compatible response bodies: completions and chat completions (whole, or as streamed
//! chunks with the final usage chunk), the model list and one model, and the response ids.
//! Pure: values in, JSON values out (ids from the thread's random generator).

use serde_json::{Value, json};

use crate::openai::Endpoint;

/// Identity and timing fields shared by a response and its chunks.
#[derive(Clone, Debug)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
}

/// A response id that no other response of any process shares: `cmpl-` (completions) or
/// `chatcmpl-` (chat) and 128 random bits in hex.
pub fn response_id(endpoint: Endpoint) -> String {
    let prefix = match endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::ChatCompletions => "chatcmpl",
    };
    format!("{prefix}-{:032x}", rand::random::<u128>())
}

fn usage(prompt_tokens: u64, completion_tokens: u64) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// Non-streaming response body: `choices` choices (indexed from 0) with the same `text`.
pub fn response_body(
    meta: &ResponseMeta,
    text: &str,
    choices: u64,
    prompt_tokens: u64,
    completion_tokens: u64,
) -> Value {
    let (object, choices): (&str, Vec<Value>) = match meta.endpoint {
        Endpoint::Completions => (
            "text_completion",
            (0..choices)
                .map(|i| json!({"index": i, "text": text, "logprobs": null, "finish_reason": "length"}))
                .collect(),
        ),
        Endpoint::ChatCompletions => (
            "chat.completion",
            (0..choices)
                .map(|i| {
                    json!({"index": i, "message": {"role": "assistant", "content": text},
                           "logprobs": null, "finish_reason": "length"})
                })
                .collect(),
        ),
    };
    json!({
        "id": meta.id, "object": object, "created": meta.created, "model": meta.model,
        "choices": choices, "usage": usage(prompt_tokens, completion_tokens),
    })
}

/// One streamed chunk carrying `text` for choice `index`; `first` adds the chat role, `last`
/// sets the finish reason.
pub fn chunk_body(meta: &ResponseMeta, index: u64, text: &str, first: bool, last: bool) -> Value {
    let finish = if last { json!("length") } else { Value::Null };
    match meta.endpoint {
        Endpoint::Completions => json!({
            "id": meta.id, "object": "text_completion", "created": meta.created,
            "model": meta.model,
            "choices": [{"index": index, "text": text, "logprobs": null, "finish_reason": finish}],
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
                "choices": [{"index": index, "delta": delta, "logprobs": null,
                             "finish_reason": finish}],
            })
        }
    }
}

/// The last chunk of a stream whose request asked for `stream_options.include_usage`: no
/// choice, the usage of the whole response.
pub fn usage_chunk(meta: &ResponseMeta, prompt_tokens: u64, completion_tokens: u64) -> Value {
    let object = match meta.endpoint {
        Endpoint::Completions => "text_completion",
        Endpoint::ChatCompletions => "chat.completion.chunk",
    };
    json!({
        "id": meta.id, "object": object, "created": meta.created, "model": meta.model,
        "choices": [], "usage": usage(prompt_tokens, completion_tokens),
    })
}

/// One model object of `/v1/models` (and the body of `/v1/models/{id}`).
pub fn model_body(id: &str, created: u64) -> Value {
    json!({"id": id, "object": "model", "created": created, "owned_by": "kvpool"})
}

/// `/v1/models` body listing `models`.
pub fn models_body<S: AsRef<str>>(models: &[S], created: u64) -> Value {
    let data: Vec<Value> = models
        .iter()
        .map(|m| model_body(m.as_ref(), created))
        .collect();
    json!({"object": "list", "data": data})
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Response `cmpl-1` of model `m`, created at 5, on `endpoint`.
    fn meta(endpoint: Endpoint) -> ResponseMeta {
        ResponseMeta {
            id: "cmpl-1".into(),
            created: 5,
            model: "m".into(),
            endpoint,
        }
    }

    #[test]
    fn bodies_have_openai_shape() {
        let meta = meta(Endpoint::ChatCompletions);
        let b = response_body(&meta, "ok", 1, 3, 2);
        assert_eq!(b["choices"][0]["message"]["content"], "ok");
        assert_eq!(b["usage"]["total_tokens"], 5);
        let c = chunk_body(&meta, 0, "a", true, false);
        assert_eq!(c["choices"][0]["delta"]["role"], "assistant");
        assert!(c["choices"][0]["finish_reason"].is_null());
        let c = chunk_body(&meta, 2, "b", false, true);
        assert_eq!(c["choices"][0]["finish_reason"], "length");
        assert_eq!(c["choices"][0]["index"], 2);
        assert_eq!(models_body(&["m"], 1)["data"][0]["id"], "m");
        assert_eq!(models_body::<&str>(&[], 1)["data"], json!([]));
        assert_eq!(model_body("m", 1)["object"], "model");
    }

    #[test]
    fn several_choices_are_indexed_and_the_usage_chunk_has_none() {
        let meta = meta(Endpoint::Completions);
        let b = response_body(&meta, "t", 3, 4, 6);
        let indices: Vec<_> = b["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["index"].as_u64().unwrap())
            .collect();
        assert_eq!(indices, [0, 1, 2]);
        let u = usage_chunk(&meta, 4, 6);
        assert_eq!(u["choices"], json!([]));
        assert_eq!(u["usage"]["total_tokens"], 10);
    }

    #[test]
    fn response_ids_are_random_and_prefixed() {
        let a = response_id(Endpoint::Completions);
        let b = response_id(Endpoint::Completions);
        assert_ne!(a, b);
        assert!(a.starts_with("cmpl-") && a.len() == 5 + 32, "{a}");
        assert!(response_id(Endpoint::ChatCompletions).starts_with("chatcmpl-"));
    }
}

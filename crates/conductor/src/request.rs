//! The conductor's OpenAI request layer ([`ClientRequest`]): a client's body is parsed once,
//! into its JSON object as it came (what the engines get: unknown fields, `tools`,
//! `response_format`, `stop`, `logprobs`, content parts and all, untouched) beside the typed
//! view of the fields the conductor acts on (`kvpool_proto::openai::GenerateRequest`: model,
//! prompts, `max_tokens`, `n`, `stream`). Which shapes are taken: docs/openai.md. Pure.

use std::sync::Arc;

use serde_json::{Map, Value};

use kvpool_proto::openai::{self as api, ApiError, Endpoint, GenerateRequest};

/// One client request: the body's JSON object and its typed view.
#[derive(Clone, Debug)]
pub struct ClientRequest {
    /// The body as it came; the routing conventions add their own fields to it.
    pub body: Map<String, Value>,
    /// The fields the conductor reads (shared with the tokenising task).
    pub view: Arc<GenerateRequest>,
}

/// A body whose model is not served (yet): the parsed object is kept, so that a caller that
/// learns model names from the engines can ask them and validate again without parsing again.
#[derive(Debug)]
pub struct UnknownModel {
    pub body: Map<String, Value>,
    pub error: ApiError,
}

impl ClientRequest {
    /// Parses `body` for `endpoint`; `served` tells whether a model name is served.
    pub fn parse(
        endpoint: Endpoint,
        body: &[u8],
        served: &dyn Fn(&str) -> bool,
    ) -> Result<Result<Self, UnknownModel>, ApiError> {
        Self::from_object(endpoint, api::parse_body(body)?, served)
    }

    /// Validates a parsed body: the request, or (inner `Err`) the body of a request for a model
    /// not served, or (outer `Err`) why the body is refused.
    pub fn from_object(
        endpoint: Endpoint,
        body: Map<String, Value>,
        served: &dyn Fn(&str) -> bool,
    ) -> Result<Result<Self, UnknownModel>, ApiError> {
        match api::parse_object(endpoint, &body, served) {
            Ok(view) => Ok(Ok(Self {
                body,
                view: Arc::new(view),
            })),
            Err(error @ ApiError::UnknownModel(_)) => Ok(Err(UnknownModel { body, error })),
            Err(e) => Err(e),
        }
    }

    /// Output tokens to book on the decode instance: `max_tokens` for every choice of every
    /// prompt (a batch is decoded on one instance), at most `u32::MAX`.
    pub fn booked_output_tokens(&self) -> u32 {
        u32::try_from(self.view.output_tokens()).unwrap_or(u32::MAX)
    }

    /// The body to forward, as a JSON value (no copy).
    pub fn into_body(self) -> Value {
        Value::Object(self.body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(endpoint: Endpoint, body: &str) -> ClientRequest {
        ClientRequest::parse(endpoint, body.as_bytes(), &|m| m == "m")
            .unwrap()
            .unwrap()
    }

    #[test]
    fn the_body_is_kept_as_it_came_beside_its_view() {
        let text = r#"{"model":"m","prompt":[[1,2],[3]],"n":2,"max_tokens":5,"stop":["\n"],"echo":true,"logprobs":1,"vendor_field":{"x":[1,null]}}"#;
        let req = parse(Endpoint::Completions, text);
        assert_eq!(req.view.choices(), 4);
        assert_eq!(req.booked_output_tokens(), 20);
        let original: Value = serde_json::from_str(text).unwrap();
        assert_eq!(req.into_body(), original);
        let chat = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}},{"type":"text","text":"hi"}]}],"tools":[],"response_format":{"type":"json_object"}}"#;
        let original: Value = serde_json::from_str(chat).unwrap();
        assert_eq!(parse(Endpoint::ChatCompletions, chat).into_body(), original);
    }

    #[test]
    fn an_unknown_model_keeps_the_parsed_body_and_bad_bodies_are_refused() {
        let unknown = ClientRequest::parse(
            Endpoint::Completions,
            br#"{"model":"other","prompt":"x"}"#,
            &|m| m == "m",
        )
        .unwrap()
        .unwrap_err();
        assert_eq!(unknown.error.status(), 404);
        // Known now: validated from the kept object.
        let again = ClientRequest::from_object(Endpoint::Completions, unknown.body, &|_| true)
            .unwrap()
            .unwrap();
        assert_eq!(again.view.model, "other");
        let huge = format!(
            r#"{{"model":"m","prompt":"x","max_tokens":{},"n":128}}"#,
            1 << 20
        );
        assert_eq!(
            parse(Endpoint::Completions, &huge).booked_output_tokens(),
            128 << 20
        );
        assert!(matches!(
            ClientRequest::parse(Endpoint::Completions, b"[1]", &|_| true),
            Err(ApiError::Invalid { field: "body", .. })
        ));
    }
}

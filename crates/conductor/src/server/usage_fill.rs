//! `usage.prompt_tokens_details.cached_tokens` in the decode response the client gets, where
//! the engine left it out: the prompt tokens the prefill engine did not compute (what the
//! prefill engine reported, or the placement's cached blocks), never more than the prompt.
//! A JSON body is rewritten whole at its end; an SSE stream event by event (only events that
//! carry a `usage` object are parsed). Pure.

use axum::body::Bytes;
use serde_json::Value;

/// Largest JSON body rewritten; a larger one passes unchanged.
const MAX_JSON_BODY: usize = 16 << 20;

/// The cached prompt tokens a prefill engine's answer reports, if it does.
pub(super) fn reported_cached_tokens(prefill_body: &[u8]) -> Option<u64> {
    serde_json::from_slice::<Value>(prefill_body)
        .ok()?
        .pointer("/usage/prompt_tokens_details/cached_tokens")?
        .as_u64()
}

/// Fill `cached` into a `usage` object of `v` that lacks it (capped at its `prompt_tokens`);
/// whether `v` changed.
fn fill(v: &mut Value, cached: u64) -> bool {
    let Some(usage) = v.get_mut("usage").and_then(Value::as_object_mut) else {
        return false;
    };
    let prompt = usage.get("prompt_tokens").and_then(Value::as_u64);
    let details = usage.entry("prompt_tokens_details").or_insert(Value::Null);
    if details.is_null() {
        *details = Value::Object(Default::default());
    }
    let Some(details) = details.as_object_mut() else {
        return false;
    };
    if details.get("cached_tokens").is_some_and(|c| !c.is_null()) {
        return false;
    }
    let cached = prompt.map_or(cached, |p| cached.min(p));
    details.insert("cached_tokens".into(), cached.into());
    true
}

/// The rewriter of one response body.
pub(super) struct UsageFill {
    cached: u64,
    sse: bool,
    /// SSE: bytes of an event not ended yet. JSON: the body so far.
    pending: Vec<u8>,
    /// JSON past [`MAX_JSON_BODY`]: passed through from then on.
    gave_up: bool,
}

impl UsageFill {
    /// For a body of `content_type` whose prompt had `cached` tokens cached.
    pub(super) fn new(content_type: Option<&str>, cached: u64) -> Self {
        Self {
            cached,
            sse: content_type.is_some_and(|c| c.starts_with("text/event-stream")),
            pending: Vec::new(),
            gave_up: false,
        }
    }

    /// Whether the body's length may change (a JSON body's `Content-Length` no longer holds).
    pub(super) fn rewrites_whole_body(&self) -> bool {
        !self.sse
    }

    /// The bytes to pass on for `chunk` (none while an event or the JSON body is incomplete).
    pub(super) fn feed(&mut self, chunk: &[u8]) -> Bytes {
        if self.gave_up {
            return Bytes::copy_from_slice(chunk);
        }
        self.pending.extend_from_slice(chunk);
        if !self.sse {
            if self.pending.len() > MAX_JSON_BODY {
                self.gave_up = true;
                return Bytes::from(std::mem::take(&mut self.pending));
            }
            return Bytes::new();
        }
        let Some(end) = last_event_end(&self.pending) else {
            return Bytes::new();
        };
        let rest = self.pending.split_off(end);
        let events = std::mem::replace(&mut self.pending, rest);
        Bytes::from(self.events(&events))
    }

    /// What is left at the end of the body.
    pub(super) fn finish(&mut self) -> Bytes {
        let rest = std::mem::take(&mut self.pending);
        if self.sse || self.gave_up || rest.is_empty() {
            return Bytes::from(rest);
        }
        let filled = serde_json::from_slice::<Value>(&rest)
            .ok()
            .and_then(|mut v| fill(&mut v, self.cached).then_some(v));
        match filled {
            Some(v) => Bytes::from(v.to_string()),
            None => Bytes::from(rest),
        }
    }

    /// Whole SSE events, with the `usage` of any that carries one filled.
    fn events(&self, bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(bytes.len() + 32);
        for event in bytes.split_inclusive(|&b| b == b'\n') {
            let line = event.strip_suffix(b"\n").unwrap_or(event);
            let data = line.strip_prefix(b"data:").map(<[u8]>::trim_ascii_start);
            let filled = data
                .filter(|d| contains(d, b"\"usage\""))
                .and_then(|d| serde_json::from_slice::<Value>(d).ok())
                .and_then(|mut v| fill(&mut v, self.cached).then_some(v));
            match filled {
                Some(v) => {
                    out.extend_from_slice(b"data: ");
                    out.extend_from_slice(v.to_string().as_bytes());
                    out.push(b'\n');
                }
                None => out.extend_from_slice(event),
            }
        }
        out
    }
}

/// The end of the last whole event in `buf` (after its blank line), if any.
fn last_event_end(buf: &[u8]) -> Option<usize> {
    buf.windows(2).rposition(|w| w == b"\n\n").map(|i| i + 2)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_json_body_gets_cached_tokens_capped_at_the_prompt() {
        let mut f = UsageFill::new(Some("application/json"), 96);
        let body =
            br#"{"id":"c","usage":{"prompt_tokens":64,"completion_tokens":4,"total_tokens":68}}"#;
        assert!(f.feed(&body[..20]).is_empty() && f.feed(&body[20..]).is_empty());
        let out: Value = serde_json::from_slice(&f.finish()).expect("json");
        assert_eq!(out["usage"]["prompt_tokens_details"]["cached_tokens"], 64);
        assert_eq!(out["usage"]["completion_tokens"], 4);
        // An engine's own figure stays.
        let mut f = UsageFill::new(Some("application/json"), 32);
        let own = br#"{"usage":{"prompt_tokens":64,"prompt_tokens_details":{"cached_tokens":48}}}"#;
        f.feed(own);
        assert_eq!(&f.finish()[..], &own[..]);
        // Not JSON, or no usage: unchanged.
        let mut f = UsageFill::new(None, 8);
        f.feed(b"not json");
        assert_eq!(&f.finish()[..], b"not json");
    }

    #[test]
    fn an_sse_stream_fills_only_the_usage_event_and_keeps_the_rest_byte_for_byte() {
        let mut f = UsageFill::new(Some("text/event-stream"), 16);
        let first = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n";
        assert_eq!(&f.feed(first)[..], &first[..]);
        // An event split across chunks passes once whole.
        let usage = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n";
        assert!(f.feed(&usage[..30]).is_empty());
        let out = f.feed(&usage[30..]);
        let text = String::from_utf8(out.to_vec()).expect("utf8");
        let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events.len(), 2, "{text}");
        let v: Value = serde_json::from_str(events[0].trim_start_matches("data: ")).expect("json");
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 16);
        assert_eq!(events[1], "data: [DONE]");
        assert!(f.finish().is_empty());
        assert_eq!(
            reported_cached_tokens(br#"{"usage":{"prompt_tokens_details":{"cached_tokens":7}}}"#),
            Some(7)
        );
        assert_eq!(reported_cached_tokens(b"{}"), None);
    }
}

//! Counts the tokens a decode engine has generated from its response as it passes through the
//! conductor ([`TokenCounter`]): in a streamed (SSE) response every `data:` event with a choice is one
//! token; a whole JSON response says `usage.completion_tokens` at its end. Pure: bytes in,
//! counts out.

/// Bytes of a non-streamed response kept to read its usage; a longer body is not counted.
const MAX_JSON_BYTES: usize = 4 << 20;

/// The generated tokens of one decode response so far.
#[derive(Debug, Default)]
pub struct TokenCounter {
    sse: bool,
    /// SSE: the bytes after the last full line; JSON: the body so far.
    pending: Vec<u8>,
    tokens: u32,
    /// A JSON body longer than [`MAX_JSON_BYTES`] (not counted), or one already counted.
    overflow: bool,
}

impl TokenCounter {
    /// A counter for a response of `content_type` (`text/event-stream` is streamed).
    pub fn new(content_type: Option<&str>) -> Self {
        Self {
            sse: content_type.is_some_and(|c| c.starts_with("text/event-stream")),
            ..Self::default()
        }
    }

    /// Tokens counted so far.
    pub fn tokens(&self) -> u32 {
        self.tokens
    }

    /// The next bytes of the body; returns the tokens they completed.
    pub fn feed(&mut self, bytes: &[u8]) -> u32 {
        if !self.sse {
            if self.overflow || self.pending.len() + bytes.len() > MAX_JSON_BYTES {
                self.pending = Vec::new();
                self.overflow = true;
                return 0;
            }
            self.pending.extend_from_slice(bytes);
            // The server may stop reading once the body's length is reached, so a body that
            // is already a whole JSON object is counted now rather than at its end.
            if self.pending.trim_ascii_end().ends_with(b"}") {
                return self.finish();
            }
            return 0;
        }
        self.pending.extend_from_slice(bytes);
        let mut new = 0;
        while let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=end).collect();
            if event_has_choice(&line) {
                new += 1;
            }
        }
        self.tokens = self.tokens.saturating_add(new);
        new
    }

    /// The body ended: a JSON response's `usage.completion_tokens`; returns the tokens it adds.
    pub fn finish(&mut self) -> u32 {
        if self.sse || self.overflow || self.pending.is_empty() {
            return 0;
        }
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&self.pending) else {
            return 0;
        };
        let n = v
            .pointer("/usage/completion_tokens")
            .and_then(|t| t.as_u64())
            .map_or(0, |t| u32::try_from(t).unwrap_or(u32::MAX));
        // Counted once: later bytes (none, for a whole object) are ignored.
        self.pending = Vec::new();
        self.overflow = true;
        self.tokens = n;
        n
    }
}

/// Whether an SSE line is a `data:` event carrying a choice (a token), not `[DONE]` or a
/// usage-only chunk.
fn event_has_choice(line: &[u8]) -> bool {
    let Some(data) = line.strip_prefix(b"data:") else {
        return false;
    };
    let data = data.trim_ascii();
    if data == b"[DONE]" {
        return false;
    }
    serde_json::from_slice::<serde_json::Value>(data)
        .ok()
        .and_then(|v| {
            v.get("choices")
                .and_then(|c| c.as_array())
                .map(|c| !c.is_empty())
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_sse_events_with_a_choice_across_chunk_boundaries() {
        let mut c = TokenCounter::new(Some("text/event-stream"));
        let a = "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"cho";
        let b =
            "ices\":[{\"delta\":{\"content\":\"b\"}}]}\n\ndata: {\"choices\":[],\"usage\":{}}\n\n";
        assert_eq!(c.feed(a.as_bytes()), 1);
        assert_eq!(c.feed(b.as_bytes()), 1);
        assert_eq!(c.feed(b"data: [DONE]\n\n: comment\n"), 0);
        assert_eq!(c.finish(), 0);
        assert_eq!(c.tokens(), 2);
    }

    #[test]
    fn a_json_response_counts_its_usage_at_the_end() {
        let mut c = TokenCounter::new(Some("application/json"));
        assert_eq!(c.feed(br#"{"choices":[{"text":"a b"}],"usage":{"comp"#), 0);
        // Counted as soon as the object is whole, once.
        assert_eq!(c.feed(br#"letion_tokens":7}}"#), 7);
        assert_eq!(c.finish(), 0);
        assert_eq!(c.tokens(), 7);
        let mut bad = TokenCounter::new(None);
        bad.feed(b"not json");
        assert_eq!(bad.finish(), 0);
    }
}

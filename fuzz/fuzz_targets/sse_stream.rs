//! The conductor's reading of a decode engine's response as it streams through
//! (`TokenCounter`: SSE events, or a whole JSON body's usage). The first input byte picks the
//! content type, the next two where the body is cut in two chunks. In a streamed response the
//! count does not depend on where the chunks end, never exceeds the lines seen, and is what
//! the calls returned.
#![no_main]

use kvpool_proto::stream_tokens::TokenCounter;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [kind, c0, c1, body @ ..] = data else {
        return;
    };
    let sse = kind & 1 == 0;
    let content_type = if sse {
        "text/event-stream"
    } else {
        "application/json"
    };
    let cut = usize::from(u16::from_le_bytes([*c0, *c1])) % (body.len() + 1);
    let mut whole = TokenCounter::new(Some(content_type));
    let returned = whole.feed(body) + whole.finish();
    assert_eq!(returned, whole.tokens());
    let mut split = TokenCounter::new(Some(content_type));
    let returned = split.feed(&body[..cut]) + split.feed(&body[cut..]) + split.finish();
    assert_eq!(returned, split.tokens());
    if sse {
        assert_eq!(
            whole.tokens(),
            split.tokens(),
            "the count depends on the chunks"
        );
        let lines = body.iter().filter(|&&b| b == b'\n').count();
        assert!(whole.tokens() as usize <= lines);
    }
});

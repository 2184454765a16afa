//! The OpenAI-compatible request bodies as the conductor's front door reads them
//! (`openai::parse_body`, then `parse_object`, which is all `ClientRequest::parse` does) and
//! kvpool's prefetch body between conductor and engines. The first input byte picks the
//! endpoint, whether every model is served, and whether the body is also read as a prefetch
//! request. A body taken is the JSON object exactly as it came; one refused gets a client
//! error (4xx); prefetch keys round-trip.
#![no_main]

use kvpool_proto::openai::{Endpoint, parse_body, parse_object};
use kvpool_proto::prefetch::{MAX_PREFETCH_BLOCKS, parse_prefetch, prefetch_body};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&flags, body)) = data.split_first() else {
        return;
    };
    let endpoint = if flags & 1 == 0 {
        Endpoint::Completions
    } else {
        Endpoint::ChatCompletions
    };
    let all_served = flags & 2 != 0;
    let served = |m: &str| all_served || m == "m";
    match parse_body(body) {
        Ok(obj) => {
            let original: serde_json::Value =
                serde_json::from_slice(body).expect("a body taken is JSON");
            match parse_object(endpoint, &obj, &served) {
                Ok(view) => {
                    assert!(view.choices() >= 1, "{view:?}");
                }
                Err(e) => assert!((400..500).contains(&e.status()), "{e:?}"),
            }
            assert_eq!(
                serde_json::Value::Object(obj),
                original,
                "the body was changed"
            );
        }
        Err(e) => assert_eq!(e.status(), 400, "{e:?}"),
    }
    if flags & 4 != 0
        && let Ok(keys) = parse_prefetch(body)
    {
        assert!(keys.len() <= MAX_PREFETCH_BLOCKS);
        let again = prefetch_body(&keys).to_string();
        assert_eq!(parse_prefetch(again.as_bytes()).ok(), Some(keys));
    }
});

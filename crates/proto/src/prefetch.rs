//! kvpool's prefetch endpoint between the conductor and the engines: its path, its request
//! body (block keys as hex strings) and the parsing of that body. Pure.

use serde_json::{Value, json};

use crate::openai::ApiError;
use kvpool_core::sched::BlockKey;

fn invalid(field: &'static str, problem: impl Into<String>) -> ApiError {
    ApiError::Invalid {
        field,
        problem: problem.into(),
    }
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
}

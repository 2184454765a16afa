//! What the engine reports once a prompt's KV is in place ([`PrefillReport`]) and the response
//! headers that carry it, [`KV_LOAD_BLOCKS_HEADER`] and [`KV_LOAD_SECONDS_HEADER`], from which
//! the conductor learns the measured pool bandwidth. Pure.

use axum::http::HeaderValue;
use axum::response::Response;

use kvpool_proto::openai::{KV_LOAD_BLOCKS_HEADER, KV_LOAD_SECONDS_HEADER};

/// What the engine tells the client once the prompt's KV is in place (before the first token):
/// the leading blocks it loaded from the pool, and the wall time the pool read took (headers
/// [`KV_LOAD_BLOCKS_HEADER`] and [`KV_LOAD_SECONDS_HEADER`], which the conductor turns into its
/// measured pool bandwidth).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct PrefillReport {
    pub(super) prompt_tokens: u64,
    pub(super) loaded_blocks: usize,
    pub(super) load_seconds: f64,
}

/// `resp` with the report's headers (the load time only when blocks were loaded).
pub(super) fn with_report_headers(mut resp: Response, report: &PrefillReport) -> Response {
    let mut values = vec![(KV_LOAD_BLOCKS_HEADER, report.loaded_blocks.to_string())];
    if report.loaded_blocks > 0 {
        values.push((
            KV_LOAD_SECONDS_HEADER,
            format!("{:.6}", report.load_seconds),
        ));
    }
    for (name, value) in values {
        if let Ok(v) = HeaderValue::from_str(&value) {
            resp.headers_mut().insert(name, v);
        }
    }
    resp
}

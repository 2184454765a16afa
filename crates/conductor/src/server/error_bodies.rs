//! The answers the conductor gives itself instead of an engine's, as OpenAI-style error bodies,
//! each counted by outcome: a refused request (400/404), an early rejection (429 with
//! `Retry-After`), a prompt the tokenizer refuses, a failed upstream call (502) and no engines
//! yet (503). Pure but for the metrics and the log line of a failed upstream call.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Json, Response};

use super::shared::Shared;
use super::upstream::UpstreamError;
use crate::tokenize::TokenizeError;
use kvpool_core::sched::RejectReason;
use kvpool_proto::openai::{self as api, ApiError};

/// `status` with an OpenAI-style error body whose `param` is null.
fn error_response(status: StatusCode, message: String, kind: &str, code: &str) -> Response {
    (
        status,
        Json(api::error_body(&message, kind, None, Some(code))),
    )
        .into_response()
}

/// The request was refused as it came (bad JSON, a bad field, another model).
pub(super) fn api_error(shared: &Shared, err: &ApiError) -> Response {
    shared.metrics.request(err.category());
    let status = StatusCode::from_u16(err.status()).unwrap_or(StatusCode::BAD_REQUEST);
    (status, Json(err.body())).into_response()
}

/// The policy rejected the request at arrival: 429, with a `Retry-After` from the estimate.
pub(super) fn rejected(shared: &Shared, reason: RejectReason) -> Response {
    shared.metrics.request("rejected");
    shared
        .metrics
        .rejections
        .with_label_values(&[reason.category()])
        .inc();
    let slo = shared.config.scheduler.slo;
    let (message, retry_s) = match reason {
        RejectReason::Ttft { estimate_s } => (
            format!(
                "estimated time to first token {estimate_s:.1} s exceeds the {:.1} s objective",
                slo.ttft_s
            ),
            (estimate_s - slo.ttft_s).ceil().max(1.0),
        ),
        RejectReason::Tpot { estimate_s } => (
            format!(
                "estimated time per output token {estimate_s:.3} s exceeds the {:.3} s objective",
                slo.tpot_s
            ),
            1.0,
        ),
        RejectReason::DecodeMemory => ("decode instances have no KV memory left".into(), 1.0),
        RejectReason::NoInstance => ("no serving instance available".into(), 5.0),
    };
    let mut resp = error_response(
        StatusCode::TOO_MANY_REQUESTS,
        format!("request rejected: {message}"),
        "rate_limit_exceeded",
        reason.category(),
    );
    if let Ok(v) = HeaderValue::from_str(&format!("{}", retry_s.min(3600.0) as u64)) {
        resp.headers_mut().insert(header::RETRY_AFTER, v);
    }
    resp
}

/// Tokenising the prompt failed: a prompt the tokenizer refuses is the client's (400), a
/// failed task is ours (500).
pub(super) fn tokenizer_failed(shared: &Shared, e: &TokenizeError) -> Response {
    shared.metrics.request("tokenizer");
    tracing::warn!(error = %e, source = ?std::error::Error::source(e), "tokenising failed");
    let (status, kind) = match e {
        TokenizeError::Task(_) => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
        _ => (StatusCode::BAD_REQUEST, "invalid_request_error"),
    };
    let param = match e {
        TokenizeError::Chat(_) => "messages",
        _ => "prompt",
    };
    error_response(status, format!("{e}"), kind, param)
}

/// Answers 502; the caller drops its `Finish`, which releases the request's bookings.
pub(super) fn upstream_failed(shared: &Shared, err: &UpstreamError) -> Response {
    shared.metrics.request("upstream");
    tracing::warn!(error = %err, source = ?std::error::Error::source(err), "upstream call failed");
    error_response(
        StatusCode::BAD_GATEWAY,
        err.to_string(),
        "upstream_error",
        "upstream",
    )
}

/// The answer while the conductor has no prefill or no decode engine: 503 with an OpenAI-style
/// error saying so (the admin server reports not ready meanwhile).
pub(super) fn no_engines(shared: &Shared) -> Response {
    shared.metrics.request("no_engines");
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "the conductor has no prefill or decode engines yet (start it with --prefill and \
         --decode, or let it discover engine pods with --discover-namespace)"
            .to_owned(),
        "service_unavailable",
        "no_engines",
    )
}

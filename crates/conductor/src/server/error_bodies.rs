//! The answers the conductor gives itself instead of an engine's, as OpenAI-style error bodies,
//! each counted by outcome: a refused request (400/404), an early rejection (429 with
//! `Retry-After` for overload, 400 `slo_unattainable` for a request no load would let through),
//! a prompt the tokenizer refuses, a failed upstream call (502), no engines yet (503), an
//! unknown route (404) or method (405), a body that cannot be read (413, ...), and our own
//! failure (500). Pure but for the metrics and
//! the log lines of failures.

use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Json, Response};
use kvpool_runtime::telemetry::chain;

use super::shared::Shared;
use super::upstream::UpstreamError;
use crate::state::Refusal;
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

/// What a rejection reason says, with the seconds after which a retry may succeed.
fn rejection_text(slo: kvpool_core::sched::Slo, reason: RejectReason) -> (String, f64) {
    match reason {
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
    }
}

/// Code of the 400 for a request that cannot meet its SLO on an idle pool either.
pub const SLO_UNATTAINABLE: &str = "slo_unattainable";

/// The policy rejected the request at arrival. Overload (the request could succeed later):
/// 429 with a `Retry-After` from the estimate. A request that would be refused on an idle
/// pool too: 400 with code [`SLO_UNATTAINABLE`] and no `Retry-After`, since retrying it
/// cannot help.
pub(super) fn rejected(shared: &Shared, refusal: Refusal) -> Response {
    let slo = shared.config.scheduler.slo;
    if let Some(idle) = refusal.when_idle {
        shared.metrics.request("unattainable");
        shared
            .metrics
            .rejections
            .with_label_values(&[idle.category()])
            .inc();
        let (message, _) = rejection_text(slo, idle);
        let message = match idle {
            RejectReason::DecodeMemory => {
                "the prompt is larger than a decode instance's KV memory".to_owned()
            }
            _ => format!("{message} even on an idle pool"),
        };
        return error_response(
            StatusCode::BAD_REQUEST,
            format!("request cannot meet its service level objective: {message}"),
            "invalid_request_error",
            SLO_UNATTAINABLE,
        );
    }
    shared.metrics.request("rejected");
    shared
        .metrics
        .rejections
        .with_label_values(&[refusal.reason.category()])
        .inc();
    let (message, retry_s) = rejection_text(slo, refusal.reason);
    let mut resp = error_response(
        StatusCode::TOO_MANY_REQUESTS,
        format!("request rejected: {message}"),
        "rate_limit_exceeded",
        refusal.reason.category(),
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
    tracing::warn!(error = %chain(&e), "tokenising failed");
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
    tracing::warn!(error = %chain(&err), "upstream call failed");
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

/// The request body could not be read (too large, or the connection failed): its status
/// (413, 400, ...) with an OpenAI-style body instead of axum's plain text.
pub(super) fn body_rejected(shared: &Shared, e: &BytesRejection) -> Response {
    shared.metrics.request("body");
    error_response(e.status(), e.body_text(), "invalid_request_error", "body")
}

/// A body declared as something other than JSON (`Content-Type`): 415, as the engines answer
/// it. A body with no `Content-Type` is read as JSON.
pub(super) fn not_json(shared: &Shared, content_type: &str) -> Response {
    shared.metrics.request("body");
    error_response(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        format!("the body must be JSON (Content-Type: application/json), got {content_type:?}"),
        "invalid_request_error",
        "content_type",
    )
}

/// Whether a `Content-Type` value names JSON (`application/json`, with parameters, or a
/// `+json` type).
pub(super) fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// A route the conductor does not serve: 404 with an OpenAI-style body.
pub(super) fn route_not_found(method: &Method, uri: &Uri) -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        format!("no route for {method} {}", uri.path()),
        "invalid_request_error",
        "not_found",
    )
}

/// A route served, but not with this method: 405 with an OpenAI-style body (axum adds the
/// `Allow` header).
pub(super) fn method_not_allowed(method: &Method, uri: &Uri) -> Response {
    error_response(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} does not take {method}", uri.path()),
        "invalid_request_error",
        "method_not_allowed",
    )
}

/// The conductor itself failed on this request: 500 with an OpenAI-style body, logged.
pub(super) fn internal_error(shared: &Shared, what: &str) -> Response {
    shared.metrics.request("internal");
    tracing::error!(what, "request failed inside the conductor");
    error_response(
        StatusCode::INTERNAL_SERVER_ERROR,
        format!("internal error: {what}"),
        "server_error",
        "internal",
    )
}

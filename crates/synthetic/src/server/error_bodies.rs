//! The errors the synthetic engine answers, as OpenAI-style bodies: a refused request, a failed
//! KV hand-off (504/502), the prefetch endpoint's "no agent" (404) and "agent failed"
//! (502), and unknown routes (404) and methods (405). Pure but for the request counter.

use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Json, Response};

use super::sglang::HandoffError;
use super::shared::Shared;
use crate::agent::AgentKvError;
use kvpool_proto::openai::{self as api, ApiError};

/// `status` with an OpenAI-style error body.
fn error_response(
    status: StatusCode,
    message: &str,
    kind: &str,
    param: Option<&str>,
    code: &str,
) -> Response {
    (
        status,
        Json(api::error_body(message, kind, param, Some(code))),
    )
        .into_response()
}

/// The request was refused as it came (bad JSON, a bad field, another model); counted.
pub(super) fn api_error(shared: &Shared, err: &ApiError) -> Response {
    shared.metrics.request(err.category());
    let status = StatusCode::from_u16(err.status()).unwrap_or(StatusCode::BAD_REQUEST);
    (status, Json(err.body())).into_response()
}

/// The request's KV cache did not arrive: 504 after the wait, 502 when the agent failed.
pub(super) fn handoff_failed(err: &HandoffError) -> Response {
    let (status, code) = match err {
        HandoffError::Timeout { .. } => (StatusCode::GATEWAY_TIMEOUT, "kv_handoff_timeout"),
        HandoffError::Agent { .. } => (StatusCode::BAD_GATEWAY, "kv_handoff_agent"),
    };
    let mut message = err.to_string();
    if let Some(source) = std::error::Error::source(err) {
        message = format!("{message}: {source}");
    }
    error_response(
        status,
        &message,
        "upstream_error",
        Some("bootstrap_room"),
        code,
    )
}

/// A prefetch to an engine without a node agent: 404, which tells the conductor to stop asking.
pub(super) fn prefetch_unsupported() -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        "this engine has no node agent: prefetch is not supported",
        "not_found",
        None,
        "prefetch_unsupported",
    )
}

/// A prefetch whose read from the node agent failed: 502.
pub(super) fn agent_failed(err: &AgentKvError) -> Response {
    error_response(
        StatusCode::BAD_GATEWAY,
        &format!("cannot read from the node agent: {err}"),
        "upstream_error",
        None,
        "agent",
    )
}

/// A route the engine does not serve: 404 with an OpenAI-style body.
pub(super) fn route_not_found(method: &Method, uri: &Uri) -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        &format!("no route for {method} {}", uri.path()),
        "invalid_request_error",
        None,
        "not_found",
    )
}

/// A route served, but not with this method: 405 with an OpenAI-style body (axum adds the
/// `Allow` header).
pub(super) fn method_not_allowed(method: &Method, uri: &Uri) -> Response {
    error_response(
        StatusCode::METHOD_NOT_ALLOWED,
        &format!("{} does not take {method}", uri.path()),
        "invalid_request_error",
        None,
        "method_not_allowed",
    )
}

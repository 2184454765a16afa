//! Errors of the transfer engine's public API and the per-request failure record.
//! Pure: no I/O.

use super::descriptor::{DirectoryError, Protocol};
use super::memory::MemoryError;
use super::wire::WireError;

/// Errors returned by [`super::TransferEngine`] calls.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum TransferError {
    #[error("invalid engine configuration: {0}")]
    Config(String),
    #[error("segment name {0:?} is already registered")]
    Duplicate(String),
    #[error("looking up segment {name:?} failed")]
    Lookup {
        name: String,
        #[source]
        source: DirectoryError,
    },
    #[error("segment {name:?} has no {protocol:?} endpoint")]
    NoEndpoint { name: String, protocol: Protocol },
    #[error("binding {what} failed")]
    Bind {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("connecting to {peer} failed")]
    Connect {
        peer: String,
        #[source]
        source: std::io::Error,
    },
    #[error("handshake with {peer} failed")]
    Handshake {
        peer: String,
        #[source]
        source: WireError,
    },
    #[error("opening remote segment {name:?} failed: {reason}")]
    Open { name: String, reason: String },
    #[error("invalid request #{index}: {source}")]
    InvalidRequest {
        index: usize,
        #[source]
        source: MemoryError,
    },
    #[error("mapping shared segment {name:?} failed")]
    Map {
        name: String,
        #[source]
        source: MemoryError,
    },
    #[error("notify to {peer} failed: {reason}")]
    Notify { peer: String, reason: String },
    #[error("batch did not complete within {0:?}")]
    Timeout(std::time::Duration),
    #[error("protocol {0:?} is not available in this build or on this host")]
    Unsupported(Protocol),
}

impl TransferError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// Why one request failed: a metric category and a human-readable reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub category: &'static str,
    pub reason: String,
}

impl Failure {
    pub fn new(category: &'static str, reason: impl Into<String>) -> Self {
        Failure {
            category,
            reason: reason.into(),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.category, self.reason)
    }
}

impl From<&WireError> for Failure {
    fn from(e: &WireError) -> Self {
        Failure::new(e.category(), error_chain(e))
    }
}

/// An error and its sources, joined with ": " (what logs and failure reasons show).
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    std::iter::successors(Some(e), |e| e.source())
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ")
}

//! [`ClientError`], the errors of the master client, and the master's per-item refusals turned
//! into them. Pure.

use std::sync::Arc;

use kvpool_proto::master as proto;

/// Errors of the master client.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum ClientError {
    #[error("no master endpoint given")]
    NoEndpoints,
    #[error("invalid master endpoint {endpoint:?}")]
    Endpoint {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("cannot connect to master {endpoint}")]
    Connect {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
    /// The TLS handshake with the master failed: most often the master's certificate is not
    /// signed by the CA the client trusts, or does not carry the name it was dialled by.
    #[error(
        "TLS verification with master {endpoint} failed: {reason} (check that \
         KVPOOL_MASTER_CA_FILE holds the CA that signed the master's certificate, and that the \
         certificate names {server_name:?})"
    )]
    TlsVerify {
        endpoint: String,
        server_name: String,
        reason: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("invalid master TLS settings: {0}")]
    TlsSetup(String),
    #[error("master call {method} failed")]
    Rpc {
        method: &'static str,
        #[source]
        source: tonic::Status,
    },
    #[error("master refused: {message} ({code:?})")]
    Refused {
        code: proto::ErrorCode,
        message: String,
    },
    #[error("malformed master answer: {0}")]
    Malformed(String),
    /// The batched call that carried this item failed as a whole.
    #[error("batched master call {method} failed")]
    Batch {
        method: &'static str,
        #[source]
        source: Arc<ClientError>,
    },
}

impl ClientError {
    /// Short label for metrics; an item of a failed batched call has the label of the call's
    /// own error.
    pub fn category(&self) -> &'static str {
        match self {
            ClientError::Batch { source, .. } => source.category(),
            other => other.into(),
        }
    }

    /// A copy of the error when its parts can be copied (transport errors cannot).
    pub(super) fn try_clone(&self) -> Option<ClientError> {
        Some(match self {
            ClientError::NoEndpoints => ClientError::NoEndpoints,
            ClientError::Rpc { method, source } => ClientError::Rpc {
                method,
                source: source.clone(),
            },
            ClientError::Refused { code, message } => ClientError::Refused {
                code: *code,
                message: message.clone(),
            },
            ClientError::Malformed(m) => ClientError::Malformed(m.clone()),
            ClientError::TlsSetup(m) => ClientError::TlsSetup(m.clone()),
            ClientError::Batch { method, source } => ClientError::Batch {
                method,
                source: source.clone(),
            },
            ClientError::Endpoint { .. }
            | ClientError::Connect { .. }
            | ClientError::TlsVerify { .. } => return None,
        })
    }

    /// Whether the master could not be reached, answered `UNAVAILABLE`, or has no segment
    /// mounted yet: a retry later may succeed.
    pub fn is_unavailable(&self) -> bool {
        match self {
            ClientError::NoEndpoints | ClientError::Connect { .. } => true,
            ClientError::Rpc { source, .. } => source.code() == tonic::Code::Unavailable,
            ClientError::Refused { code, .. } => *code == proto::ErrorCode::NoSegments,
            ClientError::Batch { source, .. } => source.is_unavailable(),
            _ => false,
        }
    }

    /// The master's error code when the master refused the item.
    pub fn code(&self) -> Option<proto::ErrorCode> {
        match self {
            ClientError::Refused { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// An item the master refused.
pub(super) fn refused(e: proto::Error) -> ClientError {
    ClientError::Refused {
        code: proto::ErrorCode::try_from(e.code).unwrap_or(proto::ErrorCode::Unspecified),
        message: e.message,
    }
}

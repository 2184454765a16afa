//! [`DataError`], the errors of pool puts and gets. Pure.

use crate::master::ClientError;
use kvpool_transfer::{BatchFailed, MemoryError, TransferError};

/// Errors of pool puts and gets.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum DataError {
    #[error("master call failed")]
    Master(#[source] ClientError),
    #[error("replica {segment} on {node} has no usable transport endpoint in {endpoints:?}")]
    NoEndpoint {
        node: String,
        segment: String,
        endpoints: Vec<String>,
    },
    #[error("staging buffer of {size} bytes")]
    Staging {
        size: u64,
        #[source]
        source: MemoryError,
    },
    #[error("registering a staging buffer with the transfer engine")]
    RegisterStaging(#[source] TransferError),
    #[error("opening replica segment {name}")]
    Open {
        name: String,
        #[source]
        source: TransferError,
    },
    #[error("transfer to or from replica segment {name} failed")]
    Transfer {
        name: String,
        #[source]
        source: BatchFailed,
    },
    #[error("copying to or from local segment {name}")]
    Local {
        name: String,
        #[source]
        source: MemoryError,
    },
    #[error("the master answered {got} bytes for a value of {want} bytes")]
    SizeMismatch { got: u64, want: u64 },
    #[error("the master returned no replica")]
    NoReplica,
    #[error("a value of {size} bytes does not fit the {have}-byte buffer")]
    BufferTooSmall { size: u64, have: u64 },
    #[error("striped object incomplete: part {part} of {parts} is gone (evicted or removed)")]
    StripeIncomplete {
        part: u32,
        parts: u32,
        #[source]
        source: ClientError,
    },
    #[error(
        "striped object part {part}: the master answered {got} bytes, the manifest says {want}"
    )]
    StripeMismatch { part: u32, got: u64, want: u64 },
    #[error("a transfer task was lost: {0}")]
    Join(String),
    #[error(
        "the read ended after its {ttl:?} read lease may have expired: the bytes may have been \
         overwritten and were discarded"
    )]
    LeaseExpired { ttl: std::time::Duration },
    #[error("bytes {offset}..{offset}+{len} of a value lie outside its {size} bytes")]
    OutsideValue { offset: u64, len: u64, size: u64 },
    #[error("a put stores a whole value: a part of one is for gets only")]
    PartialPut,
}

impl DataError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

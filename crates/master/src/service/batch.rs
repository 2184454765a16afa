//! The shared shape of the handlers: limits on a request's batch and keys, per-item answers,
//! and [`Answer`], a handler's reply with the category of its first refused item (the call's
//! metric label). Pure.

use tonic::Status;

use kvpool_core::master::state::MasterError;
use kvpool_core::master::types::ObjectKey;
use kvpool_proto::master::{self as proto, MAX_BATCH, MAX_KEY_BYTES};

/// A handler's reply message, and the category of the first item it refused, if any: a
/// batched call that succeeded is labelled by its first refusal in the metrics.
#[derive(Debug)]
pub(super) struct Answer<T> {
    pub(super) message: T,
    pub(super) item_error: Option<&'static str>,
}

impl<T> Answer<T> {
    /// The reply of a call without per-item results.
    pub(super) fn plain(message: T) -> Self {
        Self {
            message,
            item_error: None,
        }
    }

    /// The reply of a batched call whose item results were `results`.
    pub(super) fn items<R>(results: &[Result<R, MasterError>], message: T) -> Self {
        Self {
            message,
            item_error: first_error(results),
        }
    }
}

fn first_error<T>(results: &[Result<T, MasterError>]) -> Option<&'static str> {
    results
        .iter()
        .find_map(|r| r.as_ref().err().map(MasterError::category))
}

/// The wire form of an item's refusal.
pub(super) fn err(e: &MasterError) -> Option<proto::Error> {
    Some(e.into())
}

pub(super) fn invalid(msg: impl Into<String>) -> Status {
    Status::invalid_argument(msg.into())
}

pub(super) fn check_batch(n: usize) -> Result<(), Status> {
    if n > MAX_BATCH {
        return Err(invalid(format!("batch of {n} items exceeds {MAX_BATCH}")));
    }
    Ok(())
}

/// The keys of a batch, within the batch and key-length limits.
pub(super) fn keys_of(keys: &[Vec<u8>]) -> Result<Vec<ObjectKey>, Status> {
    check_batch(keys.len())?;
    keys.iter()
        .enumerate()
        .map(|(i, k)| {
            if k.is_empty() || k.len() > MAX_KEY_BYTES {
                Err(invalid(format!(
                    "key {i} has {} bytes; keys must have 1..={MAX_KEY_BYTES}",
                    k.len()
                )))
            } else {
                Ok(ObjectKey::from_bytes(k))
            }
        })
        .collect()
}

/// Per-item results of a batched call, with its metric label.
pub(super) fn item_results(results: Vec<Result<(), MasterError>>) -> Answer<proto::ItemResults> {
    let message = proto::ItemResults {
        results: results
            .iter()
            .map(|r| proto::ItemResult {
                error: r.as_ref().err().and_then(err),
            })
            .collect(),
    };
    Answer::items(&results, message)
}

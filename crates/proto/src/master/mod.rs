//! Generated gRPC types of `proto/master/master.proto`, the limits both ends enforce, and
//! conversions to and from the core's types. Pure; the wire boundary is in `service` and
//! `client`.
//!
//! - `convert`: tiers, replicas, segments, tasks and errors between the core and the wire.
//! - `feed`: the segment-event feed of heartbeats.

#![allow(clippy::all, missing_docs)]

tonic::include_proto!("kvpool.master.v1");

mod convert;
pub mod feed;

pub use convert::{status_of, tier_from_i32};

/// Metadata header naming the leader's gRPC address on UNAVAILABLE answers from a standby.
pub const LEADER_HEADER: &str = "x-kvpool-leader";
/// Most items accepted in one batched call.
pub const MAX_BATCH: usize = 16_384;
/// Longest accepted key.
pub const MAX_KEY_BYTES: usize = 4096;

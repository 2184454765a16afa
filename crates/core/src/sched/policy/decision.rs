//! A scheduling decision's inputs and outputs: the request as the scheduler sees it, the
//! estimated TTFT, the placement of an accepted request and the reason for a rejection. Pure
//! data.

use crate::sched::blocks::BlockKey;
use crate::sched::index::PrefixMatch;

/// The parts of an estimated TTFT.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct TtftEstimate {
    pub queue_s: f64,
    pub fetch_s: f64,
    pub prefill_s: f64,
    /// After the prefill: the KV hand-off to the decode instance and its first token
    /// ([`crate::sched::HandoffCost`]).
    pub handoff_s: f64,
}

impl TtftEstimate {
    pub fn total_s(&self) -> f64 {
        self.queue_s + self.fetch_s + self.prefill_s + self.handoff_s
    }
}

/// A request as the scheduler sees it.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    /// Chained block keys of the prompt.
    pub keys: &'a [BlockKey],
    pub input_tokens: u64,
    pub output_tokens: u32,
}

/// Where an accepted request goes and what the scheduler expects.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Placement {
    pub prefill: usize,
    pub decode: usize,
    /// The prefill instance's cached prefix (local plus pool).
    pub prefix: PrefixMatch,
    /// Prompt tokens that need no prefill.
    pub cached_tokens: u64,
    pub ttft: TtftEstimate,
    /// Seconds to move the prompt's KV cache from prefill to decode.
    pub kv_transfer_s: f64,
    /// Decode step time expected once the request joins.
    pub tpot_s: f64,
}

/// Why a request was rejected.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum RejectReason {
    /// The best TTFT estimate misses the SLO.
    Ttft { estimate_s: f64 },
    /// The decode step time would miss the TPOT SLO.
    Tpot { estimate_s: f64 },
    /// No decode instance has KV memory for the request.
    DecodeMemory,
    /// There is no prefill or no decode instance.
    NoInstance,
}

impl RejectReason {
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// Outcome of one scheduling decision.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decision {
    Accept(Placement),
    Reject(RejectReason),
}

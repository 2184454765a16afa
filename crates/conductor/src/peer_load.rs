//! The other conductor replicas' bookings on this replica's engines ([`PeerLoad`], learnt
//! through the master's `ShareLoad`; docs/adr/0010-conductor-replicas-share-bookings.md), and
//! how the policy sees them: a prefill engine is busy for its own bookings plus the peers',
//! a decode engine runs the peers' requests beside its own. Pure.

use kvpool_core::sched::{DecodeLoad, DecodeMember, PrefillLoad};

/// Most stand-in members one decode engine gets for the peers' requests (the prediction needs
/// the batch and its tokens, not every request).
const MAX_PEER_MEMBERS: u64 = 4096;

/// What is booked on one decode engine: requests, their KV tokens now, the output tokens they
/// still expect.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeBooking {
    pub requests: u64,
    pub context_tokens: u64,
    pub remaining_tokens: u64,
}

impl DecodeBooking {
    /// The booking of `load` (running and expected requests alike).
    pub fn of(load: &DecodeLoad) -> Self {
        let members = load.running.iter().chain(&load.pending);
        members.fold(Self::default(), |mut b, m| {
            b.requests += 1;
            b.context_tokens += m.context_tokens;
            b.remaining_tokens += u64::from(m.remaining_tokens);
            b
        })
    }
}

/// The other replicas' bookings, by this replica's engine indices; empty until the first
/// answer, and again when the engine set changes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PeerLoad {
    /// Per prefill instance: seconds of prefill work the peers booked and have not seen done,
    /// in full.
    pub prefill_busy_s: Vec<f64>,
    /// Per decode instance.
    pub decode: Vec<DecodeBooking>,
}

impl PeerLoad {
    /// Whether the peers booked nothing on any engine.
    pub fn is_empty(&self) -> bool {
        self.prefill_busy_s.iter().all(|s| *s <= 0.0) && self.decode.iter().all(|d| d.requests == 0)
    }

    /// `own` as the policy sees it with the peers: an instance the peers booked is free only
    /// once this replica's work on it (`own_busy_s`, seconds from `now_s`) and then the
    /// peers' are done.
    pub fn prefill_view(
        &self,
        own: &[PrefillLoad],
        own_busy_s: &[f64],
        now_s: f64,
    ) -> Vec<PrefillLoad> {
        own.iter()
            .enumerate()
            .map(|(i, load)| match self.prefill_busy_s.get(i) {
                Some(&busy) if busy > 0.0 => PrefillLoad {
                    free_at_s: now_s + own_busy_s.get(i).copied().unwrap_or(0.0) + busy,
                },
                _ => *load,
            })
            .collect()
    }

    /// `own` as the policy sees it with the peers: each decode engine also runs the peers'
    /// requests, as stand-in members sharing their tokens evenly (at most
    /// [`MAX_PEER_MEMBERS`] of them, carrying all the tokens).
    pub fn decode_view(&self, own: &[DecodeLoad], now_s: f64) -> Vec<DecodeLoad> {
        own.iter()
            .enumerate()
            .map(|(i, load)| {
                let mut view = load.clone();
                let Some(peer) = self.decode.get(i).filter(|p| p.requests > 0) else {
                    return view;
                };
                let n = peer.requests.min(MAX_PEER_MEMBERS);
                for k in 0..n {
                    // The remainders go to the first members, so that the sums are exact.
                    let share = |total: u64| total / n + u64::from(k < total % n);
                    view.running.push(DecodeMember {
                        // Ids this replica never gives its own requests (they count up from 1).
                        request: u64::MAX - k,
                        context_tokens: share(peer.context_tokens),
                        remaining_tokens: u32::try_from(share(peer.remaining_tokens))
                            .unwrap_or(u32::MAX)
                            .max(1),
                        joins_at_s: now_s,
                    });
                }
                view
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(request: u64, context: u64, remaining: u32) -> DecodeMember {
        DecodeMember {
            request,
            context_tokens: context,
            remaining_tokens: remaining,
            joins_at_s: 0.0,
        }
    }

    #[test]
    fn a_prefill_engine_is_free_once_its_own_then_the_peers_bookings_are_done() {
        let own = [
            PrefillLoad { free_at_s: 12.0 },
            PrefillLoad { free_at_s: 3.0 },
            PrefillLoad { free_at_s: 9.0 },
        ];
        let peers = PeerLoad {
            prefill_busy_s: vec![2.0, 1.5],
            decode: vec![],
        };
        // Own work 2 s from 10, then the peers' 2; none of its own (idle since 3), the peers'
        // 1.5; no peer booking: as it was.
        let view = peers.prefill_view(&own, &[2.0, 0.0, 0.5], 10.0);
        let free: Vec<f64> = view.iter().map(|l| l.free_at_s).collect();
        assert_eq!(free, [14.0, 11.5, 9.0]);
        assert!(!peers.is_empty());
        assert!(PeerLoad::default().is_empty());
        assert_eq!(PeerLoad::default().prefill_view(&own, &[2.0; 3], 10.0), own);
    }

    #[test]
    fn a_decode_engine_runs_the_peers_requests_beside_its_own_with_their_exact_tokens() {
        let own = [DecodeLoad {
            running: vec![member(1, 100, 5)],
            pending: vec![member(2, 50, 7)],
        }];
        assert_eq!(
            DecodeBooking::of(&own[0]),
            DecodeBooking {
                requests: 2,
                context_tokens: 150,
                remaining_tokens: 12
            }
        );
        let peer = DecodeBooking {
            requests: 3,
            context_tokens: 1001,
            remaining_tokens: 20,
        };
        let peers = PeerLoad {
            prefill_busy_s: vec![],
            decode: vec![peer],
        };
        let view = peers.decode_view(&own, 4.0);
        assert_eq!(view[0].pending, own[0].pending);
        let added = &view[0].running[1..];
        assert_eq!(added.len(), 3);
        assert_eq!(added.iter().map(|m| m.context_tokens).sum::<u64>(), 1001);
        assert_eq!(
            added
                .iter()
                .map(|m| u64::from(m.remaining_tokens))
                .sum::<u64>(),
            20
        );
        assert!(
            added
                .iter()
                .all(|m| m.joins_at_s == 4.0 && m.request > 1 << 60)
        );
        // Many peer requests: a bounded number of members still carrying every token.
        let many = PeerLoad {
            prefill_busy_s: vec![],
            decode: vec![DecodeBooking {
                requests: 1_000_000,
                context_tokens: 8_000_000,
                remaining_tokens: 9_999,
            }],
        };
        let view = many.decode_view(&own, 0.0);
        let added = &view[0].running[1..];
        assert_eq!(added.len() as u64, MAX_PEER_MEMBERS);
        assert_eq!(
            added.iter().map(|m| m.context_tokens).sum::<u64>(),
            8_000_000
        );
    }
}

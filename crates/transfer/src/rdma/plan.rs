//! Pure planning for the RDMA data path: cutting a request into slices striped over several
//! NICs, and the per-request retry/fallback state machine (a failed slice is retried on another
//! healthy NIC; when none is left the request goes to TCP, counted and flagged, never silently).
//! No I/O.

/// One slice of a request and the NIC (index into the ranked NIC list) that carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedSlice {
    pub nic: usize,
    pub offset: u64,
    pub len: u64,
    /// Attempts so far (0 for the first).
    pub attempt: u32,
}

/// Cut `len` bytes into slices of at most `slice_size`, assigned round robin over `nics` NICs
/// starting at `first_nic` (so that consecutive requests start on different NICs).
pub fn stripe(len: u64, slice_size: u64, nics: usize, first_nic: usize) -> Vec<PlannedSlice> {
    if nics == 0 || slice_size == 0 {
        return Vec::new();
    }
    let count = len.div_ceil(slice_size).max(1);
    (0..count)
        .map(|i| {
            let offset = i * slice_size;
            PlannedSlice {
                nic: (first_nic + i as usize) % nics,
                offset,
                len: slice_size.min(len - offset),
                attempt: 0,
            }
        })
        .collect()
}

/// What to do with a slice that failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Post it again on this NIC.
    Retry(PlannedSlice),
    /// No RDMA path is left: move it over TCP (the caller warns, counts
    /// `kvpool_transfer_fallback_total` and raises the fallback flag).
    FallbackTcp(PlannedSlice),
    /// Give up: the request fails with the slice's error.
    Fail,
}

/// Health of the NICs of one peer, shared by that peer's requests.
#[derive(Clone, Debug)]
pub struct Failover {
    healthy: Vec<bool>,
    max_attempts: u32,
    tcp_allowed: bool,
}

impl Failover {
    pub fn new(nics: usize, max_attempts: u32, tcp_allowed: bool) -> Self {
        Failover {
            healthy: vec![true; nics],
            max_attempts: max_attempts.max(1),
            tcp_allowed,
        }
    }

    pub fn healthy_count(&self) -> usize {
        self.healthy.iter().filter(|h| **h).count()
    }

    /// The NIC to use for a slice planned on `nic` (itself if healthy, else the next healthy).
    pub fn route(&self, nic: usize) -> Option<usize> {
        let n = self.healthy.len();
        (0..n).map(|k| (nic + k) % n).find(|&i| self.healthy[i])
    }

    /// A slice failed on its NIC: mark that NIC unhealthy and decide the slice's next step.
    pub fn on_failure(&mut self, slice: PlannedSlice) -> Next {
        if let Some(h) = self.healthy.get_mut(slice.nic) {
            *h = false;
        }
        let attempt = slice.attempt + 1;
        if attempt < self.max_attempts
            && let Some(nic) = self.route(slice.nic)
        {
            return Next::Retry(PlannedSlice {
                nic,
                attempt,
                ..slice
            });
        }
        if self.tcp_allowed {
            Next::FallbackTcp(PlannedSlice { attempt, ..slice })
        } else {
            Next::Fail
        }
    }

    /// A slice found no healthy NIC to go to: TCP if allowed, else fail.
    pub fn exhausted(&self, slice: PlannedSlice) -> Next {
        if self.tcp_allowed {
            Next::FallbackTcp(PlannedSlice {
                attempt: slice.attempt + 1,
                ..slice
            })
        } else {
            Next::Fail
        }
    }

    /// A NIC works again (its port came back, a reconnect succeeded).
    pub fn mark_healthy(&mut self, nic: usize) {
        if let Some(h) = self.healthy.get_mut(nic) {
            *h = true;
        }
    }
}

/// Something that moves one slice over one NIC: the verbs queue pairs in production, a fake in
/// tests. Errors are reasons (they end up in the request's `Failure`).
pub trait SliceExecutor {
    fn execute(&mut self, nic: usize, slice: &PlannedSlice) -> Result<(), String>;
}

/// How one request went through [`drive`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DriveOutcome {
    /// Bytes that moved over RDMA.
    pub rdma_bytes: u64,
    /// Slices handed to TCP because no RDMA path was left (each one is a fallback: warn,
    /// count `kvpool_transfer_fallback_total`, raise the flag).
    pub tcp_slices: Vec<PlannedSlice>,
    /// Set when a slice could go nowhere: the request fails with this reason.
    pub failed: Option<String>,
    /// Retries on another NIC.
    pub retries: u32,
}

/// Run a planned request through the failover state machine, one slice at a time: each slice
/// goes to its NIC (or the next healthy one); a failure marks the NIC down and retries the
/// slice elsewhere; when no NIC is left the slice goes to TCP or the request fails.
pub fn drive(
    plan: &[PlannedSlice],
    failover: &mut Failover,
    exec: &mut dyn SliceExecutor,
) -> DriveOutcome {
    let mut out = DriveOutcome::default();
    for planned in plan {
        let Some(nic) = failover.route(planned.nic) else {
            match failover.on_failure(PlannedSlice {
                attempt: failover.max_attempts,
                ..*planned
            }) {
                Next::FallbackTcp(s) => out.tcp_slices.push(s),
                Next::Fail | Next::Retry(_) => {
                    out.failed = Some("no healthy RDMA NIC and TCP fallback disabled".into());
                    return out;
                }
            }
            continue;
        };
        let mut slice = PlannedSlice { nic, ..*planned };
        loop {
            match exec.execute(slice.nic, &slice) {
                Ok(()) => {
                    out.rdma_bytes += slice.len;
                    break;
                }
                Err(reason) => match failover.on_failure(slice) {
                    Next::Retry(next) => {
                        out.retries += 1;
                        slice = next;
                    }
                    Next::FallbackTcp(s) => {
                        out.tcp_slices.push(s);
                        break;
                    }
                    Next::Fail => {
                        out.failed = Some(reason);
                        return out;
                    }
                },
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn stripes_cover_the_request_exactly_and_spread_over_nics(
            len in 1u64..(64 << 20), slice in 1u64..(8 << 20), nics in 1usize..5, first in 0usize..8
        ) {
            let plan = stripe(len, slice, nics, first);
            let mut next = 0;
            for (i, s) in plan.iter().enumerate() {
                prop_assert_eq!(s.offset, next);
                prop_assert!(s.len > 0 && s.len <= slice);
                prop_assert_eq!(s.nic, (first + i) % nics);
                next += s.len;
            }
            prop_assert_eq!(next, len);
        }
    }

    #[test]
    fn failed_slices_move_to_other_nics_then_to_tcp() {
        let mut f = Failover::new(3, 3, true);
        let s = stripe(4 << 20, 1 << 20, 3, 0);
        assert_eq!(f.route(1), Some(1));
        let Next::Retry(r) = f.on_failure(s[1]) else {
            panic!("expected a retry")
        };
        assert_eq!((r.nic, r.attempt), (2, 1));
        assert_eq!(
            f.route(1),
            Some(2),
            "slices planned on the dead NIC go elsewhere"
        );
        let Next::Retry(r) = f.on_failure(r) else {
            panic!("expected a retry")
        };
        assert_eq!((r.nic, r.attempt), (0, 2));
        // Third failure: attempts are used up, and no NIC is healthy anyway.
        assert_eq!(
            f.on_failure(r),
            Next::FallbackTcp(PlannedSlice { attempt: 3, ..r })
        );
        assert_eq!(f.healthy_count(), 0);
        f.mark_healthy(1);
        assert_eq!(f.route(0), Some(1));
    }

    /// A fake NIC set: NICs listed in `broken` fail every slice; records what ran where.
    struct FakeNics {
        broken: Vec<usize>,
        ran: Vec<(usize, u64)>,
    }

    impl SliceExecutor for FakeNics {
        fn execute(&mut self, nic: usize, s: &PlannedSlice) -> Result<(), String> {
            if self.broken.contains(&nic) {
                return Err(format!("nic {nic}: completion error"));
            }
            self.ran.push((nic, s.offset));
            Ok(())
        }
    }

    #[test]
    fn drive_stripes_over_healthy_nics_and_reroutes_around_a_broken_one() {
        let plan = stripe(6 << 20, 1 << 20, 3, 0);
        let mut f = Failover::new(3, 3, true);
        let mut nics = FakeNics {
            broken: vec![1],
            ran: vec![],
        };
        let out = drive(&plan, &mut f, &mut nics);
        assert_eq!(out.rdma_bytes, 6 << 20);
        assert!(out.tcp_slices.is_empty() && out.failed.is_none());
        assert_eq!(
            out.retries, 1,
            "only the first slice on the broken NIC is retried"
        );
        assert!(nics.ran.iter().all(|(nic, _)| *nic != 1));
        let mut offsets: Vec<_> = nics.ran.iter().map(|(_, o)| *o).collect();
        offsets.sort();
        assert_eq!(offsets, (0..6).map(|i| i << 20).collect::<Vec<u64>>());
    }

    #[test]
    fn drive_falls_back_to_tcp_only_when_every_nic_failed() {
        let plan = stripe(4 << 20, 1 << 20, 2, 0);
        let mut f = Failover::new(2, 3, true);
        let mut nics = FakeNics {
            broken: vec![0, 1],
            ran: vec![],
        };
        let out = drive(&plan, &mut f, &mut nics);
        assert_eq!(out.rdma_bytes, 0);
        assert_eq!(out.tcp_slices.len(), 4, "every slice ends up on TCP");
        assert_eq!(out.retries, 1);
        let mut f = Failover::new(2, 3, false);
        let out = drive(
            &plan,
            &mut f,
            &mut FakeNics {
                broken: vec![0, 1],
                ran: vec![],
            },
        );
        assert!(out.failed.is_some_and(|r| r.contains("completion error")));
    }

    #[test]
    fn without_tcp_a_slice_fails_once_no_nic_is_left() {
        let mut f = Failover::new(1, 5, false);
        let s = stripe(10, 10, 1, 0)[0];
        assert_eq!(f.on_failure(s), Next::Fail);
        assert!(stripe(10, 10, 0, 0).is_empty());
        assert_eq!(f.exhausted(s), Next::Fail);
        let f = Failover::new(1, 5, true);
        assert_eq!(
            f.exhausted(s),
            Next::FallbackTcp(PlannedSlice { attempt: 1, ..s })
        );
    }
}

//! The conductor replicas' bookings (`ShareLoad`, docs/adr/0010-conductor-replicas-share-bookings.md):
//! each replica's last report, kept until its time to live runs out, and per engine the sum
//! of the other replicas' reports, which is the answer to each report. Soft state in the
//! leader's memory, never journaled: after a failover the replicas' next reports (every few
//! tens of milliseconds) rebuild it. Pure: time is passed in (the handler is
//! `service::conductors`).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use tonic::Status;

use kvpool_proto::master as proto;

/// Most conductor replicas reporting at once.
pub const MAX_CONDUCTORS: usize = 256;
/// Most engines in one report.
pub const MAX_ENGINES: usize = 4096;
/// Longest time a report counts.
pub const MAX_TTL_MS: u32 = 60_000;
/// Longest conductor id and engine URL.
pub const MAX_NAME_LEN: usize = 2048;
/// Largest booked prefill work one report may claim for one engine, seconds (a day).
const MAX_BUSY_S: f64 = 86_400.0;

/// Each reporting replica's last report and when it stops counting.
#[derive(Debug, Default)]
pub struct ConductorLoads {
    reports: HashMap<String, (Instant, Vec<proto::EngineLoad>)>,
}

impl ConductorLoads {
    /// Takes `req` as its replica's report at `now` and answers the sum, per engine, of the
    /// other live replicas' reports. A report that breaks the limits is refused whole, with
    /// what is wrong, and changes nothing.
    pub fn share(
        &mut self,
        now: Instant,
        req: proto::ShareLoadRequest,
    ) -> Result<proto::ShareLoadResponse, Status> {
        check(&req)?;
        self.reports.retain(|_, (until, _)| *until > now);
        if !self.reports.contains_key(&req.conductor) && self.reports.len() >= MAX_CONDUCTORS {
            return Err(Status::resource_exhausted(format!(
                "{MAX_CONDUCTORS} conductor replicas are reporting already"
            )));
        }
        let until = now + Duration::from_millis(u64::from(req.ttl_ms));
        let mut sums: BTreeMap<&str, proto::EngineLoad> = BTreeMap::new();
        let mut others = 0u32;
        for (id, (_, engines)) in &self.reports {
            if *id == req.conductor {
                continue;
            }
            others += 1;
            for e in engines {
                let sum = sums
                    .entry(e.engine.as_str())
                    .or_insert_with(|| proto::EngineLoad {
                        engine: e.engine.clone(),
                        ..proto::EngineLoad::default()
                    });
                sum.prefill_busy_s += e.prefill_busy_s;
                sum.decode_requests = sum.decode_requests.saturating_add(e.decode_requests);
                sum.decode_context_tokens = sum
                    .decode_context_tokens
                    .saturating_add(e.decode_context_tokens);
                sum.decode_remaining_tokens = sum
                    .decode_remaining_tokens
                    .saturating_add(e.decode_remaining_tokens);
            }
        }
        let answer = proto::ShareLoadResponse {
            peers: sums.into_values().collect(),
            conductors: others,
        };
        self.reports.insert(req.conductor, (until, req.engines));
        Ok(answer)
    }

    /// Replicas whose reports count at `now`.
    pub fn live(&self, now: Instant) -> usize {
        self.reports
            .values()
            .filter(|(until, _)| *until > now)
            .count()
    }
}

/// What a report must be: a named replica, at most [`MAX_ENGINES`] named engines each once,
/// finite non-negative work, a time to live from 1 ms to [`MAX_TTL_MS`].
fn check(req: &proto::ShareLoadRequest) -> Result<(), Status> {
    let bad = |what: String| Err(Status::invalid_argument(what));
    if req.conductor.is_empty() || req.conductor.len() > MAX_NAME_LEN {
        return bad(format!(
            "conductor must name the replica in 1 to {MAX_NAME_LEN} bytes"
        ));
    }
    if req.ttl_ms == 0 || req.ttl_ms > MAX_TTL_MS {
        return bad(format!(
            "ttl_ms {} is not from 1 to {MAX_TTL_MS}",
            req.ttl_ms
        ));
    }
    if req.engines.len() > MAX_ENGINES {
        return bad(format!(
            "{} engines in one report, more than {MAX_ENGINES}",
            req.engines.len()
        ));
    }
    let mut seen = std::collections::HashSet::with_capacity(req.engines.len());
    for e in &req.engines {
        if e.engine.is_empty() || e.engine.len() > MAX_NAME_LEN {
            return bad(format!("an engine URL must be 1 to {MAX_NAME_LEN} bytes"));
        }
        if !seen.insert(e.engine.as_str()) {
            return bad(format!("engine {:?} is reported twice", e.engine));
        }
        if !(e.prefill_busy_s.is_finite() && (0.0..=MAX_BUSY_S).contains(&e.prefill_busy_s)) {
            return bad(format!(
                "prefill_busy_s {} of engine {:?} is not from 0 to {MAX_BUSY_S}",
                e.prefill_busy_s, e.engine
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(engine: &str, busy: f64, requests: u64) -> proto::EngineLoad {
        proto::EngineLoad {
            engine: engine.into(),
            prefill_busy_s: busy,
            decode_requests: requests,
            decode_context_tokens: 100 * requests,
            decode_remaining_tokens: 10 * requests,
        }
    }

    fn report(id: &str, engines: Vec<proto::EngineLoad>, ttl_ms: u32) -> proto::ShareLoadRequest {
        proto::ShareLoadRequest {
            conductor: id.into(),
            engines,
            ttl_ms,
        }
    }

    #[test]
    fn each_replica_gets_the_sum_of_the_others_reports() {
        let mut l = ConductorLoads::default();
        let t = Instant::now();
        let a = l
            .share(t, report("a", vec![load("http://p", 1.5, 0)], 1000))
            .unwrap();
        assert_eq!((a.conductors, a.peers.len()), (0, 0));
        l.share(
            t,
            report(
                "b",
                vec![load("http://p", 0.5, 0), load("http://d", 0.0, 2)],
                1000,
            ),
        )
        .unwrap();
        l.share(t, report("c", vec![load("http://d", 0.0, 3)], 1000))
            .unwrap();
        // a's next report replaces its first; its answer sums b and c, not itself.
        let a = l
            .share(t, report("a", vec![load("http://p", 9.0, 0)], 1000))
            .unwrap();
        assert_eq!(a.conductors, 2);
        assert_eq!(
            a.peers,
            vec![load("http://d", 0.0, 5), load("http://p", 0.5, 0)]
        );
        let b = l.share(t, report("b", vec![], 1000)).unwrap();
        assert_eq!(
            b.peers,
            vec![load("http://d", 0.0, 3), load("http://p", 9.0, 0)]
        );
        assert_eq!(l.live(t), 3);
    }

    #[test]
    fn a_replica_that_stops_reporting_drops_out_after_its_ttl() {
        let mut l = ConductorLoads::default();
        let t = Instant::now();
        l.share(t, report("gone", vec![load("http://p", 2.0, 1)], 50))
            .unwrap();
        let seen = l.share(t + Duration::from_millis(49), report("a", vec![], 1000));
        assert_eq!(seen.unwrap().conductors, 1);
        let later = l.share(t + Duration::from_millis(50), report("a", vec![], 1000));
        let later = later.unwrap();
        assert_eq!((later.conductors, later.peers.len()), (0, 0));
        assert_eq!(l.live(t + Duration::from_millis(50)), 1);
    }

    #[test]
    fn reports_that_break_the_limits_are_refused_and_change_nothing() {
        let mut l = ConductorLoads::default();
        let t = Instant::now();
        let long = "x".repeat(MAX_NAME_LEN + 1);
        let cases = [
            (report("", vec![], 10), "conductor must name"),
            (report(&long, vec![], 10), "conductor must name"),
            (report("a", vec![], 0), "ttl_ms 0"),
            (report("a", vec![], MAX_TTL_MS + 1), "ttl_ms 60001"),
            (report("a", vec![load("", 0.0, 0)], 10), "engine URL"),
            (
                report("a", vec![load("http://p", f64::NAN, 0)], 10),
                "prefill_busy_s NaN",
            ),
            (
                report("a", vec![load("http://p", -1.0, 0)], 10),
                "prefill_busy_s -1",
            ),
            (
                report("a", vec![load("http://p", 1e9, 0)], 10),
                "not from 0 to 86400",
            ),
            (
                report(
                    "a",
                    vec![load("http://p", 0.0, 0), load("http://p", 0.0, 1)],
                    10,
                ),
                "reported twice",
            ),
            (
                report("a", vec![load("http://p", 0.0, 0); MAX_ENGINES + 1], 10),
                "more than 4096",
            ),
        ];
        for (req, says) in cases {
            let err = l.share(t, req).unwrap_err();
            assert_eq!(err.code(), tonic::Code::InvalidArgument);
            assert!(err.message().contains(says), "{}", err.message());
        }
        assert_eq!(l.live(t), 0);
    }

    #[test]
    fn replicas_beyond_the_limit_are_refused_until_some_expire() {
        let mut l = ConductorLoads::default();
        let t = Instant::now();
        for i in 0..MAX_CONDUCTORS {
            l.share(t, report(&format!("c{i}"), vec![], 10)).unwrap();
        }
        let err = l.share(t, report("one-more", vec![], 10)).unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        // A replica already reporting still may.
        l.share(t, report("c0", vec![], 10)).unwrap();
        // Once the others' reports expire there is room.
        let after = t + Duration::from_millis(10);
        assert_eq!(
            l.share(after, report("one-more", vec![], 10))
                .unwrap()
                .conductors,
            0
        );
    }
}

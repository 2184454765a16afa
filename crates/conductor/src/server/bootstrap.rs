//! The bootstrap servers of vLLM `MooncakeConnector` prefill instances: their `GET /query`
//! answer (each data parallel rank's engine id), where the server is, and the answers kept a
//! few seconds ([`BootstrapCache`]). Pure but for the clock.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long a bootstrap server's answer is used before it is asked again. A prefill instance
/// that restarted registers a new engine id; its answer is also dropped when a prefill call
/// fails.
const BOOTSTRAP_TTL: Duration = Duration::from_secs(5);

/// One data parallel rank of a prefill instance, as its bootstrap server lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct PrefillRank {
    pub(super) dp_rank: i64,
    pub(super) engine_id: String,
}

/// The bootstrap servers' answers, by bootstrap URL, with when each was read.
#[derive(Default)]
pub(super) struct BootstrapCache(parking_lot::Mutex<HashMap<String, (Instant, Vec<PrefillRank>)>>);

impl BootstrapCache {
    pub(super) fn fresh(&self, url: &str) -> Option<Vec<PrefillRank>> {
        let cache = self.0.lock();
        let (read, ranks) = cache.get(url)?;
        (read.elapsed() < BOOTSTRAP_TTL).then(|| ranks.clone())
    }

    pub(super) fn store(&self, url: &str, ranks: Vec<PrefillRank>) {
        let mut cache = self.0.lock();
        // Prefill instances come and go: answers past their time are dropped on each store.
        cache.retain(|_, (read, _)| read.elapsed() < BOOTSTRAP_TTL);
        cache.insert(url.to_owned(), (Instant::now(), ranks));
    }

    pub(super) fn forget(&self, url: &str) {
        self.0.lock().remove(url);
    }
}

/// The ranks in a bootstrap server's `GET /query` answer (`{dp_rank: {engine_id, worker_addr}}`),
/// in rank order. An answer that is not that shape, or lists no rank, is an error saying so.
pub(super) fn parse_query(body: &[u8]) -> Result<Vec<PrefillRank>, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("the answer is not JSON: {e}"))?;
    let map = value
        .as_object()
        .ok_or("the answer is not a map of data parallel ranks")?;
    let mut ranks = Vec::with_capacity(map.len());
    for (rank, entry) in map {
        let dp_rank = rank
            .parse::<i64>()
            .map_err(|_| format!("rank {rank:?} is not a number"))?;
        let engine_id = entry
            .get("engine_id")
            .and_then(Value::as_str)
            .filter(|id| !id.is_empty())
            .ok_or_else(|| format!("rank {rank} has no engine_id"))?;
        ranks.push(PrefillRank {
            dp_rank,
            engine_id: engine_id.to_owned(),
        });
    }
    if ranks.is_empty() {
        return Err("no prefill worker has registered yet".to_owned());
    }
    ranks.sort_by_key(|r| r.dp_rank);
    Ok(ranks)
}

/// The bootstrap server of the prefill engine at `prefill_url`: the same host, `port`.
pub(super) fn bootstrap_url(prefill_url: &str, port: u16) -> String {
    let host = super::upstream::url_host(prefill_url).unwrap_or("127.0.0.1");
    format!("http://{host}:{port}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bootstrap_answer_lists_its_ranks_in_order() {
        let body = br#"{"1": {"engine_id": "p_dp1", "worker_addr": {"0": {"0": "tcp://h:1"}}},
                        "0": {"engine_id": "p_dp0", "worker_addr": {"0": {"0": "tcp://h:2"}}}}"#;
        assert_eq!(
            parse_query(body).unwrap(),
            vec![
                PrefillRank {
                    dp_rank: 0,
                    engine_id: "p_dp0".into()
                },
                PrefillRank {
                    dp_rank: 1,
                    engine_id: "p_dp1".into()
                },
            ]
        );
    }

    #[test]
    fn a_bootstrap_answer_that_is_not_its_shape_is_named() {
        for (body, says) in [
            (&b"{}"[..], "no prefill worker has registered"),
            (b"[]", "not a map"),
            (b"nope", "not JSON"),
            (
                br#"{"x": {"engine_id": "e"}}"#,
                "rank \"x\" is not a number",
            ),
            (br#"{"0": {"worker_addr": {}}}"#, "rank 0 has no engine_id"),
            (br#"{"0": {"engine_id": ""}}"#, "rank 0 has no engine_id"),
        ] {
            let err = parse_query(body).unwrap_err();
            assert!(err.contains(says), "{err}");
        }
    }

    #[test]
    fn the_bootstrap_server_is_on_the_prefill_engines_host() {
        assert_eq!(
            bootstrap_url("http://10.0.0.7:8000", 8998),
            "http://10.0.0.7:8998"
        );
        assert_eq!(
            bootstrap_url("http://[fd00::1]:8000/", 9000),
            "http://[fd00::1]:9000"
        );
    }

    #[test]
    fn cached_answers_expire_and_can_be_forgotten() {
        let cache = BootstrapCache::default();
        let ranks = vec![PrefillRank {
            dp_rank: 0,
            engine_id: "e".into(),
        }];
        cache.store("http://a:1", ranks.clone());
        assert_eq!(cache.fresh("http://a:1"), Some(ranks));
        cache.forget("http://a:1");
        assert_eq!(cache.fresh("http://a:1"), None);
        cache.0.lock().insert(
            "http://b:1".into(),
            (Instant::now() - BOOTSTRAP_TTL, Vec::new()),
        );
        assert_eq!(cache.fresh("http://b:1"), None);
    }
}

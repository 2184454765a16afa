//! Room for a new connection when a cap is reached ([`Evictable`]): the oldest connection that
//! has not shown it is a real client (no request answered, none in flight with its body whole:
//! a silent connection, a head or a body still trickling in) is closed to make room, from the
//! new connection's own source address when that address is at its cap. A flood of slow or
//! silent connections from one address therefore replaces itself instead of locking out a
//! well-behaved client there, whose connections either finish a request promptly or are the
//! newest. Proven connections are never evicted: at the cap with only proven ones, the new
//! connection is refused. I/O boundary: none (it cancels tokens the connections watch).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

use super::activity::Activity;

/// The open connections of one server, oldest first, that could be evicted.
#[derive(Default)]
pub(super) struct Evictable {
    inner: Mutex<(u64, BTreeMap<u64, Entry>)>,
}

struct Entry {
    source: IpAddr,
    activity: Arc<Activity>,
    evict: CancellationToken,
}

impl Evictable {
    /// Track a new connection from `source`; its id, to [`Self::remove`] it when it ends.
    pub(super) fn add(
        &self,
        source: IpAddr,
        activity: Arc<Activity>,
        evict: CancellationToken,
    ) -> u64 {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let id = g.0;
        g.0 += 1;
        g.1.insert(
            id,
            Entry {
                source,
                activity,
                evict,
            },
        );
        id
    }

    /// Forget the connection `id` (it ended).
    pub(super) fn remove(&self, id: u64) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.1.remove(&id);
    }

    /// Tell the oldest unproven connection (from `source`, when given) to close; whether there
    /// was one.
    pub(super) fn evict_oldest(&self, source: Option<IpAddr>) -> bool {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let victim =
            g.1.iter()
                .find(|(_, e)| source.is_none_or(|s| e.source == s) && !e.activity.proven())
                .map(|(id, _)| *id);
        match victim.and_then(|id| g.1.remove(&id)) {
            Some(e) => {
                e.evict.cancel();
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_unproven_connection_of_the_source_goes_first() {
        let ev = Evictable::default();
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        let b: IpAddr = "127.0.0.3".parse().unwrap();
        let conns: Vec<(IpAddr, Arc<Activity>, CancellationToken)> = [a, b, a, a]
            .into_iter()
            .map(|s| (s, Arc::new(Activity::new()), CancellationToken::new()))
            .collect();
        for (s, act, t) in &conns {
            ev.add(*s, act.clone(), t.clone());
        }
        // The first of `a` has answered a request: proven, never evicted.
        drop(conns[0].1.begin());
        assert!(ev.evict_oldest(Some(a)));
        assert!(!conns[0].2.is_cancelled() && conns[2].2.is_cancelled());
        // Any source: the oldest unproven is `b`'s.
        assert!(ev.evict_oldest(None));
        assert!(conns[1].2.is_cancelled());
        assert!(ev.evict_oldest(Some(a)));
        assert!(conns[3].2.is_cancelled());
        assert!(!ev.evict_oldest(Some(a)), "only a proven connection left");
        assert!(!ev.evict_oldest(None));
    }
}

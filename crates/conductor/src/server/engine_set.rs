//! The handle that changes a running conductor's engines ([`EngineSet`]): engine discovery (or
//! a test) replaces the set, the bookkeeping of the engines that stay is carried over, and
//! readiness follows whether the conductor can serve. I/O boundary: the watch channel of engine
//! sets and the shutdown token.

use kvpool_runtime::telemetry::chain;
use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::shared::Shared;
use crate::engines::Engines;
use crate::state::State;
use kvpool_runtime::admin::Readiness;

/// The engine set of a running conductor: replace it at any time (engine discovery does).
#[derive(Clone, derive_more::Debug)]
pub struct EngineSet(#[debug("{:?}", _0.members.lock().engines)] pub(super) Arc<Shared>);

impl EngineSet {
    /// The engines served now.
    pub fn current(&self) -> Engines {
        self.0.members.lock().engines.clone()
    }

    /// Serve `next` from now on. Engines that stay keep their cache mirror and load; new ones
    /// start empty; those that left drop out of the prefix index and the load tables. Returns
    /// whether the conductor can serve (at least one prefill and one decode engine). A set
    /// larger than the scheduler supports is refused (logged) and the previous one kept.
    pub fn set(&self, next: Engines) -> bool {
        let shared = &self.0;
        let mut m = shared.members.lock();
        let ordered = m.engines.stable_order(&next);
        if ordered == m.engines {
            return m.state.is_some();
        }
        let from = |old: &[String], new: &[String]| -> Vec<Option<usize>> {
            new.iter()
                .map(|u| old.iter().position(|o| o == u))
                .collect()
        };
        let state = if ordered.is_complete() {
            let config = shared.config.with_engines(&ordered);
            let built = match m.state.take() {
                Some(old) => old.regrouped(
                    &config,
                    &from(&m.engines.prefill, &ordered.prefill),
                    &from(&m.engines.decode, &ordered.decode),
                ),
                None => State::new(&config),
            };
            match built {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::error!(error = %chain(&e),
                        prefill = ordered.prefill.len(), decode = ordered.decode.len(),
                        "engine set refused; keeping the previous one");
                    // `take` emptied it; rebuild the previous set's state from scratch.
                    m.state = State::new(&shared.config.with_engines(&m.engines)).ok();
                    m.reenter_holdings();
                    m.apply_costs();
                    return m.state.is_some();
                }
            }
        } else {
            None
        };
        tracing::info!(prefill = ?ordered.prefill, decode = ?ordered.decode, "engine set changed");
        shared.metrics.set_engines(&ordered);
        m.engines = ordered;
        m.state = state;
        m.epoch += 1;
        m.reenter_holdings();
        m.apply_costs();
        shared
            .metrics
            .set_prefill_costs(&m.costs, &m.engines.prefill);
        let ready = m.state.is_some();
        drop(m);
        super::kv_feed::sync(shared);
        ready
    }

    /// Follow the KV event streams of the prefill engines (those `--kv-events` names, and
    /// with `--kv-events-port` every other one) until `shutdown` fires: one task per stream,
    /// each reconnecting on its own, started and stopped as engines join and leave.
    pub fn follow_kv_events(&self, shutdown: &CancellationToken) {
        self.0.feeds.lock().stop = Some(shutdown.clone());
        super::kv_feed::sync(&self.0);
    }

    /// Share this replica's bookings with the other conductor replicas through the master
    /// (with `--master` and a non-zero `--share-load-period`) until `shutdown` fires.
    pub fn share_load(&self, shutdown: &CancellationToken) {
        super::share_load::start(&self.0, shutdown);
    }

    /// Apply every engine set `updates` carries (the latest one wins) until its sender is
    /// dropped or `shutdown` fires; `readiness` follows whether the conductor can serve.
    pub async fn follow(
        self,
        mut updates: watch::Receiver<Engines>,
        readiness: Readiness,
        shutdown: CancellationToken,
    ) {
        loop {
            let next = updates.borrow_and_update().clone();
            readiness.set_ready(self.set(next));
            tokio::select! {
                changed = updates.changed() => if changed.is_err() { break },
                () = shutdown.cancelled() => break,
            }
        }
    }
}

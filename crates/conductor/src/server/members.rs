//! The engines a running conductor serves and the bookkeeping over them ([`Members`]), and a
//! request placed on two of them ([`Placed`]), found again by URL after the engine set changed.
//! Pure.

use std::collections::HashMap;

use crate::engines::{Engines, RoutingProtocol};
use crate::kv_events::{Delta, Holdings};
use crate::prefill_costs::PrefillCosts;
use crate::state::{State, Ticket};

/// The engines served now and the bookkeeping over them. `epoch` counts engine-set changes, so
/// a request placed before a change finds its instances again by URL.
pub(super) struct Members {
    pub(super) engines: Engines,
    /// `None` until there is at least one prefill and one decode engine.
    pub(super) state: Option<State>,
    pub(super) epoch: u64,
    /// What each prefill engine with a KV event stream holds, by base URL (kept over
    /// engine-set changes, re-entered into every new state).
    pub(super) holdings: HashMap<String, Holdings>,
    /// Every prefill engine's cost model, by base URL (prior or fitted; kept over changes).
    pub(super) costs: PrefillCosts,
    /// The decode engines' cost model (prior, or scaled to the observed TPOTs).
    pub(super) decode_fit: crate::decode_cost::DecodeFit,
    /// From prefill answers to decode engines' first tokens (prior, or fitted).
    pub(super) handoff_fit: crate::handoff_fit::HandoffFit,
}

/// A request placed on instances, with what is needed to find them after an engine-set change.
#[derive(Clone, Debug)]
pub(super) struct Placed {
    pub(super) ticket: Ticket,
    pub(super) epoch: u64,
    pub(super) prefill_url: String,
    pub(super) decode_url: String,
    /// The model the request names (the prefill engine's cost group).
    pub(super) model: String,
    /// How the pair is routed, or why it cannot be (engines of different conventions).
    pub(super) protocol: Result<RoutingProtocol, String>,
}

impl Members {
    /// Enters every event-fed engine's holdings into the state (after it was rebuilt).
    pub(super) fn reenter_holdings(&mut self) {
        let Some(state) = self.state.as_mut() else {
            return;
        };
        for (url, held) in &self.holdings {
            if let Some(i) = self.engines.prefill.iter().position(|u| u == url) {
                let deltas: Vec<Delta> = held.keys().map(Delta::Added).collect();
                state.apply_event_deltas(i, &deltas);
            }
        }
    }

    /// Gives the state every prefill engine's current cost model (after it was rebuilt, or
    /// after a fit moved).
    pub(super) fn apply_costs(&mut self) {
        let Some(state) = self.state.as_mut() else {
            return;
        };
        for (i, url) in self.engines.prefill.iter().enumerate() {
            state.set_prefill_cost(i, self.costs.current(url));
        }
        state.set_decode_cost(self.decode_fit.current());
        state.set_handoff_cost(self.handoff_fit.current());
    }

    /// Run `f` on the state with `placed`'s ticket as the current engine set numbers it; an
    /// instance that left meanwhile gets an index nothing has (its part is skipped).
    pub(super) fn with_ticket(&mut self, placed: &Placed, f: impl FnOnce(&mut State, &Ticket)) {
        let Some(state) = self.state.as_mut() else {
            return;
        };
        let ticket = if placed.epoch == self.epoch {
            placed.ticket
        } else {
            let find = |urls: &[String], url: &str| {
                urls.iter().position(|u| u == url).unwrap_or(usize::MAX)
            };
            Ticket {
                prefill: find(&self.engines.prefill, &placed.prefill_url),
                decode: find(&self.engines.decode, &placed.decode_url),
                ..placed.ticket
            }
        };
        f(state, &ticket);
    }
}

//! What the agent's admin server serves beyond the standard endpoints (`/livez`, `/readyz`,
//! `/metrics`): the discovered topology at `/topology` and its summary at
//! `/topology/summary`, unavailable until discovery is done. I/O boundary: none here; the
//! admin server (`kvpool_runtime::admin`) owns the listener.

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use parking_lot::RwLock;

use crate::locality::SessionLocality;
use crate::topology::{NodeSummary, Topology};

/// The topology once discovered, shared with the admin server's handlers.
#[derive(Clone, Default)]
pub(super) struct TopologyView(Arc<RwLock<Option<(Topology, NodeSummary)>>>);

impl TopologyView {
    /// Publish the discovered topology.
    pub(super) fn set(&self, topo: Topology, summary: NodeSummary) {
        *self.0.write() = Some((topo, summary));
    }

    /// The discovered topology as the engine API places sessions on it (`allow`: the pool's
    /// RDMA allow-list); `None` before discovery.
    pub(super) fn locality(&self, allow: &[String]) -> Option<SessionLocality> {
        let topo = self.0.read();
        topo.as_ref()
            .map(|(t, _)| SessionLocality::from_topology(t, allow))
    }

    /// The routes that serve this view.
    pub(super) fn router(&self) -> Router {
        Router::new()
            .route("/topology", get(topology_handler))
            .route("/topology/summary", get(summary_handler))
            .with_state(self.clone())
    }
}

/// `part` of the view as JSON, or 503 until discovery is done.
fn respond<T: serde::Serialize>(
    view: &TopologyView,
    part: fn(&(Topology, NodeSummary)) -> &T,
) -> Response {
    match view.0.read().as_ref() {
        Some(found) => {
            (StatusCode::OK, Json(serde_json::to_value(part(found)).ok())).into_response()
        }
        None => (StatusCode::SERVICE_UNAVAILABLE, "discovery not done\n").into_response(),
    }
}

async fn topology_handler(State(view): State<TopologyView>) -> Response {
    respond(&view, |(topo, _)| topo)
}

async fn summary_handler(State(view): State<TopologyView>) -> Response {
    respond(&view, |(_, summary)| summary)
}

//! The agent credential issuer (docs/adr/0009-node-bound-agent-credentials.md): the operator
//! hands each node agent the credential of its own node, on proof of which pod it is, so that
//! the master can refuse an agent's calls for any other node (no `--shared-agent-credentials`).
//!
//! - [`ca`]: the issuer's TLS identity. Its CA key is derived from the operator's root key, so
//!   every replica and every start present the same CA, whose certificate the pool document
//!   carries to the agents.
//! - [`review`]: the decision, pure: who the TokenReview says called, and whether that pod is
//!   one of the pool's agent DaemonSet's pods on a node.
//! - [`serve`]: the HTTPS endpoint (TokenReview, then the pod and its DaemonSet read from the
//!   API server, then the node's credential file).
//!
//! The wire contract is [`kvpool_proto::issuer`].

pub mod ca;
pub mod review;
pub mod serve;

pub use ca::IssuerCa;
pub use review::{Grant, Refusal};
pub use serve::{IssuerError, IssuerState, serve};

/// What the pools' agents need to reach the issuer: its URL and the CA certificate (PEM) that
/// signs its server certificate. `None` in the settings: the agents share one credential and
/// the master runs with `--shared-agent-credentials`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentIssuer {
    /// `https://host:port`, as the agents dial it.
    pub url: String,
    pub ca_pem: String,
}

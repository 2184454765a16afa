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

/// The host of an issuer URL (`https://host[:port]`); the error says what is wrong.
pub fn host_of(url: &str) -> Result<String, String> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("{url:?} is not a URL: {e}"))?;
    if uri.scheme_str() != Some("https") {
        return Err(format!("{url:?} is not an https:// URL"));
    }
    if uri.path() != "/" && !uri.path().is_empty() {
        return Err(format!(
            "{url:?} has a path; give scheme, host and port only"
        ));
    }
    uri.host()
        .map(str::to_owned)
        .ok_or_else(|| format!("{url:?} names no host"))
}

/// The names the issuer's certificate holds for `host`: the host itself and, for a Service
/// name `svc.ns.svc[.cluster.local]`, its shorter and longer forms.
pub fn server_names(host: &str) -> Vec<String> {
    let mut names = vec![host.to_owned()];
    let base = host
        .strip_suffix(".cluster.local")
        .unwrap_or(host)
        .strip_suffix(".svc");
    if let Some(base) = base {
        for n in [
            base.to_owned(),
            format!("{base}.svc"),
            format!("{base}.svc.cluster.local"),
        ] {
            if !names.contains(&n) {
                names.push(n);
            }
        }
    }
    names
}

/// What the pools' agents need to reach the issuer: its URL and the CA certificate (PEM) that
/// signs its server certificate. `None` in the settings: the agents share one credential and
/// the master runs with `--shared-agent-credentials`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentIssuer {
    /// `https://host:port`, as the agents dial it.
    pub url: String,
    pub ca_pem: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issuer_urls_are_checked_and_service_names_widened() {
        assert_eq!(
            host_of("https://kvpool-operator.kvpool-system.svc:8443").as_deref(),
            Ok("kvpool-operator.kvpool-system.svc")
        );
        for bad in ["http://x:8443", "https://x:8443/v1", "not a url"] {
            assert!(host_of(bad).is_err(), "{bad}");
        }
        assert_eq!(
            server_names("op.ns.svc"),
            ["op.ns.svc", "op.ns", "op.ns.svc.cluster.local"]
        );
        assert_eq!(server_names("127.0.0.1"), ["127.0.0.1"]);
    }
}

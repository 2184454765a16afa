//! TLS of a `KVCachePool`'s master (`spec.master.tls`): which Secret holds the master's
//! certificate, which one the clients' certificate for mutual TLS, and the name the clients
//! verify. The operator turns it into the master's `--tls-*` flags and the clients'
//! `KVPOOL_MASTER_*` variables. And TLS of the transfer lanes (`spec.transport.tls`): the
//! agents' certificate Secret, the mode and the name initiators verify, which reach the agents
//! through the pool document and the engines as `KVPOOL_TRANSFER_*` variables. Pure types, no
//! I/O.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use crate::validated::SpecError;

/// Pattern of a Secret name (a DNS subdomain).
const SECRET_NAME_RULE: &str = "self.matches('^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$')";
/// Pattern of a DNS name the master's certificate may carry.
const SERVER_NAME_RULE: &str = "self.matches('^[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?([.][A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*$')";

/// TLS on the master's gRPC port. Off when absent: calls are authenticated but travel in
/// plain text.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MasterTlsSpec {
    /// A `kubernetes.io/tls` Secret in the pool's namespace with the master's certificate
    /// (`tls.crt`, leaf first), its key (`tls.key`) and the CA that signed it (`ca.crt`, as
    /// cert-manager writes it). The master mounts all three; every client of the master mounts
    /// `ca.crt` alone. The certificate must name `<pool>-master.<namespace>.svc` or
    /// `serverName`.
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new(SECRET_NAME_RULE).message("master.tls.secretName must be a Secret name (lower-case letters, digits, '-' and '.')").reason(Reason::FieldValueInvalid))]
    pub secret_name: String,

    /// Mutual TLS: a `kubernetes.io/tls` Secret with the clients' certificate (`tls.crt`,
    /// `tls.key`) and the CA that signed it (`ca.crt`). The agents, the conductor and the
    /// engines present it; the master accepts only clients whose certificate that CA signed.
    /// Absent: any client that trusts the master's CA may connect (and must still sign its
    /// calls with its role key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new(SECRET_NAME_RULE).message("master.tls.clientSecretName must be a Secret name (lower-case letters, digits, '-' and '.')").reason(Reason::FieldValueInvalid))]
    pub client_secret_name: Option<String>,

    /// The name the clients verify in the master's certificate. Absent: the master Service's
    /// DNS name, `<pool>-master.<namespace>.svc`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new(SERVER_NAME_RULE).message("master.tls.serverName must be a DNS name (letters, digits, '-' and dots between labels)").reason(Reason::FieldValueInvalid))]
    pub server_name: Option<String>,
}

/// Whether `s` matches the Secret-name rule (`^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$`).
fn secret_name_ok(s: &str) -> bool {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    edge(s.chars().next())
        && edge(s.chars().last())
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
}

/// Whether `s` matches the server-name rule (dot-separated labels of letters, digits and `-`,
/// each starting and ending with a letter or digit).
fn server_name_ok(s: &str) -> bool {
    s.split('.').all(|label| {
        let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
        edge(label.chars().next())
            && edge(label.chars().last())
            && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    })
}

impl MasterTlsSpec {
    /// The checks of the CEL rules above, for objects an API server stored before they existed.
    pub fn validate(&self) -> Result<(), SpecError> {
        const SECRET_NAME: &str = "must be a Secret name (lower-case letters, digits, '-' and '.')";
        const SERVER_NAME: &str =
            "must be a DNS name (letters, digits, '-' and dots between labels)";
        let check = |field, value: Option<&str>, ok: fn(&str) -> bool, message| match value {
            Some(v) if !ok(v) => Err(SpecError::Conflict { field, message }),
            _ => Ok(()),
        };
        let secret = Some(self.secret_name.as_str());
        let client = self.client_secret_name.as_deref();
        let server = self.server_name.as_deref();
        check("master.tls.secretName", secret, secret_name_ok, SECRET_NAME)?;
        check(
            "master.tls.clientSecretName",
            client,
            secret_name_ok,
            SECRET_NAME,
        )?;
        check("master.tls.serverName", server, server_name_ok, SERVER_NAME)
    }
}

/// Where the operator mounts the transfer TLS Secret in agent pods (`tls.crt`, `tls.key`,
/// `ca.crt`) and its CA alone in engine pods; the agent reads its files there.
pub const TRANSFER_TLS_DIR: &str = "/etc/kvpool/transfer-tls";

/// TLS on the transfer lanes: which connections must use it.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum TransferTlsMode {
    /// Agents serve TLS and plaintext alike; initiators dial plaintext. For moving a running
    /// pool to `require` without a gap.
    Allow,
    /// Agents refuse plaintext; every initiator (agents and engines) dials TLS and verifies the
    /// agent's certificate.
    #[default]
    Require,
}

impl TransferTlsMode {
    /// The setting as the agent's `pool.transport_tls` and `KVPOOL_TRANSFER_TLS` spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            TransferTlsMode::Allow => "allow",
            TransferTlsMode::Require => "require",
        }
    }
}

/// TLS on the TCP transfer lanes between engines and agents and between agents (TLS 1.3;
/// docs/transfer.md "TLS"). Off when absent. The transfer handshake with the pool's key still
/// runs inside it.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TransferTlsSpec {
    /// `require` (the default): agents accept TLS only and initiators dial TLS; `allow`: agents
    /// accept both and initiators dial plaintext (for switching a running pool).
    #[serde(default)]
    pub mode: TransferTlsMode,

    /// A `kubernetes.io/tls` Secret in the pool's namespace with the agents' certificate
    /// (`tls.crt`), its key (`tls.key`) and the CA that signed it (`ca.crt`). Every agent
    /// serves it; engines mount `ca.crt` alone. The certificate must name `serverName`.
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new(SECRET_NAME_RULE).message("transport.tls.secretName must be a Secret name (lower-case letters, digits, '-' and '.')").reason(Reason::FieldValueInvalid))]
    pub secret_name: String,

    /// The name initiators verify in the agents' certificate (agents are dialled by IP
    /// address, which a shared certificate cannot name). Absent:
    /// `<pool>-transfer.<namespace>.svc` (a name only; no such Service is needed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    #[x_kube(validation = Rule::new(SERVER_NAME_RULE).message("transport.tls.serverName must be a DNS name (letters, digits, '-' and dots between labels)").reason(Reason::FieldValueInvalid))]
    pub server_name: Option<String>,
}

impl TransferTlsSpec {
    /// The name initiators verify for pool `pool` in `namespace`.
    pub fn server_name_for(&self, pool: &str, namespace: &str) -> String {
        self.server_name
            .clone()
            .unwrap_or_else(|| format!("{pool}-transfer.{namespace}.svc"))
    }

    /// The checks of the CEL rules above, for objects an API server stored before they existed.
    pub fn validate(&self) -> Result<(), SpecError> {
        if !secret_name_ok(&self.secret_name) {
            return Err(SpecError::Conflict {
                field: "transport.tls.secretName",
                message: "must be a Secret name (lower-case letters, digits, '-' and '.')",
            });
        }
        match self.server_name.as_deref() {
            Some(n) if !server_name_ok(n) => Err(SpecError::Conflict {
                field: "transport.tls.serverName",
                message: "must be a DNS name (letters, digits, '-' and dots between labels)",
            }),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_tls_names_are_checked_and_the_server_name_defaults() {
        let tls = |secret: &str, server: Option<&str>| TransferTlsSpec {
            mode: TransferTlsMode::Require,
            secret_name: secret.into(),
            server_name: server.map(Into::into),
        };
        assert!(tls("agents-tls", None).validate().is_ok());
        let e = tls("Agents", None).validate().expect_err("upper case");
        assert!(e.to_string().contains("transport.tls.secretName"), "{e}");
        let e = tls("a", Some("x y")).validate().expect_err("space");
        assert!(e.to_string().contains("transport.tls.serverName"), "{e}");
        assert_eq!(
            tls("a", None).server_name_for("cache", "ml"),
            "cache-transfer.ml.svc"
        );
        assert_eq!(
            tls("a", Some("agents.example")).server_name_for("cache", "ml"),
            "agents.example"
        );
        let parsed: TransferTlsSpec =
            serde_json::from_str(r#"{"secretName":"t"}"#).expect("mode defaults");
        assert_eq!(parsed.mode, TransferTlsMode::Require);
    }

    #[test]
    fn names_are_checked_like_the_cel_rules() {
        assert!(secret_name_ok("cache-master.tls") && secret_name_ok("a"));
        for bad in ["", "-a", "a-", "A", "a/b", "a_b"] {
            assert!(!secret_name_ok(bad), "{bad:?}");
        }
        assert!(server_name_ok("master.kvpool.example") && server_name_ok("M-1"));
        for bad in ["", "a..b", "a .b", "-a.b", "a.b-", "a_b"] {
            assert!(!server_name_ok(bad), "{bad:?}");
        }
        let tls = |server: &str| MasterTlsSpec {
            secret_name: "t".into(),
            client_secret_name: None,
            server_name: Some(server.into()),
        };
        assert!(tls("m.example").validate().is_ok());
        let e = tls("m example").validate().expect_err("space");
        assert!(e.to_string().contains("master.tls.serverName"), "{e}");
    }
}

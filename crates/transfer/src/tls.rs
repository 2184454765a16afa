//! Optional TLS on the transfer engine's TCP connections (issue 15): the setting
//! ([`TlsMode`]: `off`, `allow`, `require`), the rustls configurations made once from the PEM
//! files (TLS 1.3 only, the ring provider), the reasons a TLS handshake fails as the metric
//! and the errors name them, and (`halves`) the initiator's TLS connection shared by a lane's
//! sender and receiver threads. TLS authenticates the target and protects every byte; the
//! transfer handshake with the pool key still runs inside it and authenticates the peer.
//! I/O boundary: the PEM files (and, in `halves`, the lane's socket).

mod halves;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::ServerName;
use rustls::{CertificateError, ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::error::TransferError;

pub(crate) use halves::{
    TlsReadHalf, TlsWriteHalf, client_connect, recv_spans_copy, send_spans_copy, split,
};

/// First byte of a TLS handshake record (a ClientHello starts with it); the plaintext HELLO
/// frame starts with the frame magic, whose first byte differs.
pub(crate) const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// TLS on the transfer engine's TCP connections ([`crate::EngineConfig::tls`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum TlsMode {
    /// No TLS: the target refuses TLS connections, the initiator dials plaintext.
    #[default]
    Off,
    /// The target serves TLS and plaintext connections alike (told apart by their first
    /// byte); the initiator dials plaintext. For migrating a pool to `require`.
    Allow,
    /// The target refuses plaintext connections (ERROR `tls`); the initiator dials TLS only
    /// and verifies the target's certificate against the CA file.
    Require,
}

impl TlsMode {
    /// The setting's name, as configuration spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            TlsMode::Off => "off",
            TlsMode::Allow => "allow",
            TlsMode::Require => "require",
        }
    }
}

/// The TLS setting and its files. The target side needs `cert_file` and `key_file` (unless
/// `off`); the initiator side, under `require`, needs `ca_file`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TransferTls {
    pub mode: TlsMode,
    /// The target's certificate chain (PEM, leaf first).
    pub cert_file: Option<PathBuf>,
    /// The target's private key (PEM).
    pub key_file: Option<PathBuf>,
    /// CA certificates (PEM) that verify targets (initiator side).
    pub ca_file: Option<PathBuf>,
    /// The name to verify in every target's certificate; unset: the target's IP address.
    pub server_name: Option<String>,
}

/// The initiator's side of TLS, loaded: how to verify targets.
#[derive(derive_more::Debug)]
pub(crate) struct ClientTls {
    #[debug(skip)]
    config: Arc<ClientConfig>,
    server_name: Option<ServerName<'static>>,
}

impl ClientTls {
    /// The name the certificate of the target at `addr` must carry.
    pub(crate) fn name_for(&self, addr: SocketAddr) -> ServerName<'static> {
        self.server_name
            .clone()
            .unwrap_or_else(|| ServerName::IpAddress(addr.ip().into()))
    }
}

/// The TLS setting with its files read.
#[derive(Default)]
pub(crate) struct LoadedTls {
    /// Target side (with `cert_file` and `key_file`).
    pub(crate) server: Option<Arc<ServerConfig>>,
    /// Initiator side (`require` only).
    pub(crate) client: Option<Arc<ClientTls>>,
}

fn bad(reason: String) -> TransferError {
    TransferError::Config(format!("transfer TLS: {reason}"))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, TransferError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .map_err(|e| bad(format!("cannot read the {what} {}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(bad(format!(
            "the {what} {} holds no PEM certificate",
            path.display()
        )));
    }
    Ok(certs)
}

impl TransferTls {
    /// Read the files the setting needs; an error names the file or setting at fault.
    pub(crate) fn load(&self) -> Result<LoadedTls, TransferError> {
        if self.mode == TlsMode::Off {
            return Ok(LoadedTls::default());
        }
        let server = match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => Some(self.server_config(cert, key)?),
            (None, None) => None,
            _ => {
                return Err(bad(
                    "the certificate and the key file go together (set both or neither)".into(),
                ));
            }
        };
        let client = match (self.mode, &self.ca_file) {
            (TlsMode::Require, Some(ca)) => Some(Arc::new(self.client_config(ca)?)),
            (TlsMode::Require, None) => {
                return Err(bad(
                    "require needs a CA file to verify the targets' certificates".into(),
                ));
            }
            _ => None,
        };
        Ok(LoadedTls { server, client })
    }

    fn server_config(&self, cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TransferError> {
        let chain = certs(cert, "certificate file")?;
        let key = PrivateKeyDer::from_pem_file(key)
            .map_err(|e| bad(format!("cannot read the key file {}: {e}", key.display())))?;
        let config = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| bad(format!("TLS 1.3 with ring: {e}")))?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| bad(format!("the certificate and key do not go together: {e}")))?;
        Ok(Arc::new(config))
    }

    fn client_config(&self, ca: &Path) -> Result<ClientTls, TransferError> {
        let mut roots = RootCertStore::empty();
        for c in certs(ca, "CA file")? {
            roots.add(c).map_err(|e| {
                bad(format!(
                    "a certificate in {} is not a usable CA: {e}",
                    ca.display()
                ))
            })?;
        }
        let config = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| bad(format!("TLS 1.3 with ring: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let server_name = match &self.server_name {
            Some(n) => Some(
                ServerName::try_from(n.clone())
                    .map_err(|e| bad(format!("server name {n:?}: {e}")))?,
            ),
            None => None,
        };
        Ok(ClientTls {
            config: Arc::new(config),
            server_name,
        })
    }
}

/// The `reason` label of `kvpool_transfer_tls_handshake_failures_total` for a failed TLS
/// handshake whose I/O error is `e`: what the certificate check said, `timeout`, `closed`, or
/// `handshake` for anything else.
pub(crate) fn failure_reason(e: &std::io::Error) -> &'static str {
    use rustls::Error as E;
    if crate::wire::is_timeout(e) {
        return "timeout";
    }
    let Some(tls) = e.get_ref().and_then(|x| x.downcast_ref::<rustls::Error>()) else {
        return match e.kind() {
            std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::BrokenPipe => "closed",
            _ => "handshake",
        };
    };
    match tls {
        E::InvalidCertificate(CertificateError::UnknownIssuer) => "unknown_issuer",
        E::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => "wrong_name",
        E::InvalidCertificate(
            CertificateError::Expired
            | CertificateError::ExpiredContext { .. }
            | CertificateError::NotValidYet
            | CertificateError::NotValidYetContext { .. },
        ) => "expired",
        E::InvalidCertificate(_) => "bad_certificate",
        E::AlertReceived(_) => "peer_alert",
        E::PeerIncompatible(_) => "incompatible",
        _ => "handshake",
    }
}

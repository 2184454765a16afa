//! TLS to the master (issue 15): which CA verifies the master, the client certificate for
//! mutual TLS and the name to verify, read from the environment by every master client (the
//! agent, the conductor, the operator, `kvpool up`, the benches, the Python package); the
//! tonic TLS settings of the gRPC channel and the rustls configuration of the blocking fast
//! lane, both made once from the same files. I/O boundary: the PEM files, and the fast lane's
//! TLS stream over its socket.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::ServerName;
use rustls::{ClientConnection, RootCertStore, StreamOwned};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

use super::error::ClientError;

/// The environment variable naming the CA file that verifies the master: set, every call to
/// the master goes over TLS.
pub const CA_FILE_ENV: &str = "KVPOOL_MASTER_CA_FILE";
/// The client certificate chain (PEM) shown to a master that asks for one (mutual TLS).
pub const CLIENT_CERT_FILE_ENV: &str = "KVPOOL_MASTER_CLIENT_CERT_FILE";
/// The private key (PEM) of the client certificate.
pub const CLIENT_KEY_FILE_ENV: &str = "KVPOOL_MASTER_CLIENT_KEY_FILE";
/// The name the master's certificate must carry (default: the host of the master address).
pub const SERVER_NAME_ENV: &str = "KVPOOL_MASTER_SERVER_NAME";

/// TLS settings of a master client; all unset (the default): plaintext.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MasterTls {
    /// CA certificates (PEM) that verify the master; set, TLS is on.
    pub ca_file: Option<PathBuf>,
    /// Client certificate chain and key (PEM) for mutual TLS.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// The name to verify in the master's certificate instead of the address's host.
    pub server_name: Option<String>,
}

impl MasterTls {
    /// The settings in the `KVPOOL_MASTER_*` variables above (unset or empty: not set).
    pub fn from_env() -> MasterTls {
        let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
        MasterTls {
            ca_file: var(CA_FILE_ENV).map(PathBuf::from),
            cert_file: var(CLIENT_CERT_FILE_ENV).map(PathBuf::from),
            key_file: var(CLIENT_KEY_FILE_ENV).map(PathBuf::from),
            server_name: var(SERVER_NAME_ENV).and_then(|v| v.into_string().ok()),
        }
    }

    /// Whether anything is set.
    pub fn is_set(&self) -> bool {
        *self != MasterTls::default()
    }

    /// Read the files: `None` when TLS is off; an error naming the file or setting at fault.
    pub(super) fn load(&self) -> Result<Option<Arc<LoadedTls>>, ClientError> {
        let setup = |reason: String| ClientError::TlsSetup(reason);
        let Some(ca_file) = &self.ca_file else {
            if self.is_set() {
                return Err(setup(format!(
                    "{CLIENT_CERT_FILE_ENV}, {CLIENT_KEY_FILE_ENV} and {SERVER_NAME_ENV} need \
                     {CA_FILE_ENV} (the CA that verifies the master)"
                )));
            }
            return Ok(None);
        };
        let ca_pem = read(ca_file, CA_FILE_ENV)?;
        let mut roots = RootCertStore::empty();
        let cas = CertificateDer::pem_slice_iter(&ca_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| setup(format!("{CA_FILE_ENV} {}: {e}", ca_file.display())))?;
        if cas.is_empty() {
            return Err(setup(format!(
                "{CA_FILE_ENV} {} holds no PEM certificate",
                ca_file.display()
            )));
        }
        for ca in cas {
            roots
                .add(ca)
                .map_err(|e| setup(format!("{CA_FILE_ENV} {}: {e}", ca_file.display())))?;
        }
        let mut tonic = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&ca_pem));
        if let Some(name) = &self.server_name {
            ServerName::try_from(name.as_str())
                .map_err(|e| setup(format!("{SERVER_NAME_ENV} {name:?}: {e}")))?;
            tonic = tonic.domain_name(name.clone());
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| setup(e.to_string()))?
            .with_root_certificates(roots);
        let config = match (&self.cert_file, &self.key_file) {
            (None, None) => builder.with_no_client_auth(),
            (Some(cert), Some(key)) => {
                let (cert_pem, key_pem) = (
                    read(cert, CLIENT_CERT_FILE_ENV)?,
                    read(key, CLIENT_KEY_FILE_ENV)?,
                );
                let chain = CertificateDer::pem_slice_iter(&cert_pem)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| {
                        setup(format!("{CLIENT_CERT_FILE_ENV} {}: {e}", cert.display()))
                    })?;
                let private = PrivateKeyDer::from_pem_slice(&key_pem)
                    .map_err(|e| setup(format!("{CLIENT_KEY_FILE_ENV} {}: {e}", key.display())))?;
                tonic = tonic.identity(Identity::from_pem(&cert_pem, &key_pem));
                builder
                    .with_client_auth_cert(chain, private)
                    .map_err(|e| setup(format!("the client certificate and key: {e}")))?
            }
            _ => {
                return Err(setup(format!(
                    "{CLIENT_CERT_FILE_ENV} and {CLIENT_KEY_FILE_ENV} go together"
                )));
            }
        };
        Ok(Some(Arc::new(LoadedTls {
            tonic,
            fast: Arc::new(config),
            server_name: self.server_name.clone(),
        })))
    }
}

fn read(path: &Path, var: &str) -> Result<Vec<u8>, ClientError> {
    std::fs::read(path)
        .map_err(|e| ClientError::TlsSetup(format!("{var}: reading {}: {e}", path.display())))
}

/// The loaded TLS settings of a client.
#[derive(Debug)]
pub(super) struct LoadedTls {
    /// For the gRPC channel.
    pub(super) tonic: ClientTlsConfig,
    /// For the fast lane.
    fast: Arc<rustls::ClientConfig>,
    server_name: Option<String>,
}

impl LoadedTls {
    /// Start TLS on the fast lane's socket to `host` (the handshake runs with the first
    /// write, under the socket's timeouts).
    pub(super) fn wrap(&self, tcp: TcpStream, host: &str) -> Result<FastStream, String> {
        let name = self.server_name.as_deref().unwrap_or(host);
        let name = ServerName::try_from(name.trim_start_matches('[').trim_end_matches(']'))
            .map_err(|e| format!("server name {name:?}: {e}"))?
            .to_owned();
        let conn = ClientConnection::new(self.fast.clone(), name).map_err(|e| e.to_string())?;
        Ok(FastStream::Tls(Box::new(StreamOwned::new(conn, tcp))))
    }
}

/// The fast lane's connection: plain TCP or TLS over it.
#[derive(Debug)]
pub(super) enum FastStream {
    Plain(TcpStream),
    Tls(Box<StreamOwned<ClientConnection, TcpStream>>),
}

impl FastStream {
    /// The socket, when reads come straight from it (polling for readability says a reply
    /// is there only then).
    pub(super) fn plain_socket(&self) -> Option<&TcpStream> {
        match self {
            FastStream::Plain(s) => Some(s),
            FastStream::Tls(_) => None,
        }
    }
}

impl Read for FastStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            FastStream::Plain(s) => s.read(buf),
            FastStream::Tls(s) => s.read(buf),
        }
    }
}

impl Write for FastStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            FastStream::Plain(s) => s.write(buf),
            FastStream::Tls(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            FastStream::Plain(s) => s.flush(),
            FastStream::Tls(s) => s.flush(),
        }
    }
}

/// A description of the TLS failure behind `err`, when a TLS error is in its chain.
pub(super) fn tls_failure(err: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(t) = e.downcast_ref::<rustls::Error>() {
            return Some(t.to_string());
        }
        if let Some(t) = e
            .downcast_ref::<io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            return Some(t.to_string());
        }
        next = e.source();
    }
    None
}

//! Optional TLS on the master's port (issue 15): the rustls server configuration made from the
//! `--tls-*` PEM files (with `--tls-client-ca-file`, clients must present a certificate signed
//! by that CA), and [`MasterIo`], the stream an accepted connection is served over: plain TCP,
//! or TLS whose first decrypted bytes were read to tell the fast lane from gRPC and are
//! replayed to whoever serves it. I/O boundary: the PEM files and the accepted streams.

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use kvpool_proto::fast;

/// Errors of loading the master's TLS files.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum TlsError {
    #[error("--tls-cert-file and --tls-key-file go together, and --tls-client-ca-file needs both")]
    Flags,
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot read PEM certificates from {path}")]
    Certs {
        path: PathBuf,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    #[error("{path} holds no PEM certificate")]
    NoCert { path: PathBuf },
    #[error("cannot read a PEM private key from {path}")]
    Key {
        path: PathBuf,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    #[error("a certificate in the client CA file {path} is not a usable CA")]
    ClientCa {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("cannot build the client certificate verifier")]
    Verifier(#[source] rustls::server::VerifierBuilderError),
    #[error("the certificate {cert} and key {key} do not make a TLS server configuration")]
    Config {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: rustls::Error,
    },
}

kvpool_runtime::error_category!(TlsError);

/// The certificate chain in `pem`, read from `path` (at least one certificate).
fn certs(pem: &[u8], path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Certs {
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCert {
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// The TLS acceptor of the master's port: `cert` (PEM chain, leaf first) and `key` (PEM), and
/// with `client_ca` mutual TLS (a client without a certificate signed by it is refused). ALPN
/// offers `h2` (tonic's clients require it); the fast lane's clients offer none.
pub fn acceptor(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<TlsAcceptor, TlsError> {
    let pems = PemFiles::read(cert, key, client_ca)?;
    Ok(TlsAcceptor::from(Arc::new(server_config(&pems)?)))
}

/// The master port's PEM files, as read at one moment, with their paths (for errors).
#[derive(Debug)]
pub(super) struct PemFiles<'a> {
    pub(super) cert: (&'a Path, Vec<u8>),
    pub(super) key: (&'a Path, Vec<u8>),
    pub(super) client_ca: Option<(&'a Path, Vec<u8>)>,
}

impl<'a> PemFiles<'a> {
    pub(super) fn read(
        cert: &'a Path,
        key: &'a Path,
        client_ca: Option<&'a Path>,
    ) -> Result<Self, TlsError> {
        let read = |path: &'a Path| {
            std::fs::read(path)
                .map(|bytes| (path, bytes))
                .map_err(|source| TlsError::Read {
                    path: path.to_owned(),
                    source,
                })
        };
        Ok(PemFiles {
            cert: read(cert)?,
            key: read(key)?,
            client_ca: client_ca.map(read).transpose()?,
        })
    }
}

/// The rustls server configuration made from `pems` (see [`acceptor`]).
pub(super) fn server_config(pems: &PemFiles<'_>) -> Result<rustls::ServerConfig, TlsError> {
    let config_error = |source| TlsError::Config {
        cert: pems.cert.0.to_owned(),
        key: pems.key.0.to_owned(),
        source,
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = certs(&pems.cert.1, pems.cert.0)?;
    let key = PrivateKeyDer::from_pem_slice(&pems.key.1).map_err(|source| TlsError::Key {
        path: pems.key.0.to_owned(),
        source,
    })?;
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(config_error)?;
    let builder = match &pems.client_ca {
        None => builder.with_no_client_auth(),
        Some((path, pem)) => {
            let mut roots = RootCertStore::empty();
            for ca in certs(pem, path)? {
                roots.add(ca).map_err(|source| TlsError::ClientCa {
                    path: path.to_path_buf(),
                    source,
                })?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(TlsError::Verifier)?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(chain, key).map_err(config_error)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// Why an accepted connection was not opened.
#[derive(Debug)]
pub(super) enum OpenError {
    /// Closed or broken before a byte worth serving: nothing to count.
    Closed,
    /// On a TLS port, the first byte is not a TLS handshake record (a plaintext client).
    NotTls(u8),
    /// The TLS handshake failed (an untrusted or missing client certificate, a client that
    /// does not trust ours, garbage).
    Handshake(io::Error),
}

/// Which step an [`open`] was at when its deadline cut it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Step {
    Tls,
    FirstBytes,
}

/// Open an accepted connection: the TLS handshake when `tls` is set, then whether its first
/// (decrypted) bytes are the fast lane's magic. `step` tells the caller where a deadline cut
/// it.
pub(super) async fn open(
    stream: TcpStream,
    tls: Option<&TlsAcceptor>,
    step: &mut Step,
) -> Result<(MasterIo, bool), OpenError> {
    let Some(acceptor) = tls else {
        *step = Step::FirstBytes;
        let fast = starts_with_magic(&stream).await?;
        return Ok((MasterIo::Plain(stream), fast));
    };
    *step = Step::Tls;
    let mut first = [0u8; 1];
    match stream.peek(&mut first).await {
        Ok(0) | Err(_) => return Err(OpenError::Closed),
        // 22: a TLS handshake record (the ClientHello).
        Ok(_) if first[0] != 22 => return Err(OpenError::NotTls(first[0])),
        Ok(_) => {}
    }
    let mut tls = acceptor
        .accept(stream)
        .await
        .map_err(OpenError::Handshake)?;
    *step = Step::FirstBytes;
    let mut head = Vec::with_capacity(fast::MAGIC.len());
    let mut byte = [0u8; 1];
    while head.len() < fast::MAGIC.len() && head[..] == fast::MAGIC[..head.len()] {
        match tls.read(&mut byte).await {
            Ok(1) => head.push(byte[0]),
            _ => return Err(OpenError::Closed),
        }
    }
    let fast = head[..] == fast::MAGIC[..];
    Ok((MasterIo::Tls(Box::new(Rewind { head, tls })), fast))
}

/// Whether the connection's first bytes are the fast lane's magic (without consuming them).
async fn starts_with_magic(stream: &TcpStream) -> Result<bool, OpenError> {
    let mut head = [0u8; fast::MAGIC.len()];
    loop {
        let n = stream
            .peek(&mut head)
            .await
            .map_err(|_| OpenError::Closed)?;
        if n == 0 {
            return Err(OpenError::Closed);
        }
        if head[..n] != fast::MAGIC[..n] {
            return Ok(false);
        }
        if n == head.len() {
            return Ok(true);
        }
        // A prefix of the magic so far: wait for the rest.
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// A TLS stream whose first decrypted bytes (`head`) were read already and are read again.
#[derive(Debug)]
pub(super) struct Rewind {
    head: Vec<u8>,
    tls: TlsStream<TcpStream>,
}

/// A connection to the master's port, plain or TLS.
#[derive(Debug)]
pub(super) enum MasterIo {
    Plain(TcpStream),
    Tls(Box<Rewind>),
}

impl AsyncRead for MasterIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MasterIo::Plain(s) => Pin::new(s).poll_read(cx, buf),
            MasterIo::Tls(r) => {
                if !r.head.is_empty() {
                    let n = r.head.len().min(buf.remaining());
                    buf.put_slice(&r.head[..n]);
                    r.head.drain(..n);
                    return Poll::Ready(Ok(()));
                }
                Pin::new(&mut r.tls).poll_read(cx, buf)
            }
        }
    }
}

impl AsyncWrite for MasterIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            MasterIo::Plain(s) => Pin::new(s).poll_write(cx, buf),
            MasterIo::Tls(r) => Pin::new(&mut r.tls).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MasterIo::Plain(s) => Pin::new(s).poll_flush(cx),
            MasterIo::Tls(r) => Pin::new(&mut r.tls).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MasterIo::Plain(s) => Pin::new(s).poll_shutdown(cx),
            MasterIo::Tls(r) => Pin::new(&mut r.tls).poll_shutdown(cx),
        }
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            MasterIo::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            MasterIo::Tls(r) => Pin::new(&mut r.tls).poll_write_vectored(cx, bufs),
        }
    }
    fn is_write_vectored(&self) -> bool {
        match self {
            MasterIo::Plain(s) => s.is_write_vectored(),
            MasterIo::Tls(r) => r.tls.is_write_vectored(),
        }
    }
}

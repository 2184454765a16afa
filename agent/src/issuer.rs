//! This node's credential, fetched from the operator's agent credential issuer at start
//! (docs/adr/0009-node-bound-agent-credentials.md): the agent presents its projected
//! ServiceAccount token over TLS (the issuer's CA comes with the pool document) and gets the
//! credential file of its own node, which it keeps in memory. Transient failures (the operator
//! not reachable yet, the API server slow) are retried with growing, jittered delays; a
//! refusal (not an agent pod, a rejected token) ends the start with the issuer's reason. I/O
//! boundary: the token file and the HTTPS call.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use kvpool_proto::issuer::{IssueRequest, MAX_BODY, PATH, parse_refusal};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// One attempt (connect, TLS, request and answer) must finish within this.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(20);
/// Retries of transient failures: from 500 ms, doubling, at most 30 s apart, for about five
/// minutes in all; then the agent exits and the kubelet restarts it.
const RETRY_MIN: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);
const RETRIES: usize = 14;

/// Where and how to ask (the pool document's `credentialIssuer`, with the pool's identity).
#[derive(Clone, PartialEq, Eq, derive_more::Debug)]
pub struct IssuerConfig {
    /// `https://host:port`.
    pub url: String,
    /// CA certificate(s), PEM, that sign the issuer's certificate.
    #[debug(skip)]
    pub ca_pem: String,
    /// The projected ServiceAccount token (audience `kvpool-agent-credentials`).
    pub token_file: PathBuf,
    pub namespace: String,
    pub pool: String,
}

/// Why no credential came back.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum IssueError {
    #[error("credential issuer URL {url:?}: {why}")]
    Url { url: String, why: String },
    #[error("the credential issuer's CA certificate (pool document credentialIssuer.caPem): {0}")]
    Ca(String),
    #[error("cannot read the agent's ServiceAccount token {path}")]
    Token {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot reach the credential issuer at {url}")]
    Connect {
        url: String,
        #[source]
        source: std::io::Error,
    },
    #[error("HTTP exchange with the credential issuer at {url}: {why}")]
    Http { url: String, why: String },
    #[error("the credential issuer at {url} did not answer within {ATTEMPT_TIMEOUT:?}")]
    Timeout { url: String },
    #[error("the credential issuer refused this agent ({status}, {reason}): {message}")]
    Refused {
        status: u16,
        reason: String,
        message: String,
    },
    #[error("stopped while waiting for the credential issuer")]
    Stopped,
}

kvpool_runtime::error_category!(IssueError);

impl IssueError {
    /// Whether asking again may succeed: the network, the issuer's API server, a pod not
    /// scheduled yet. Refusals of the caller and broken configuration are final.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Connect { .. } | Self::Http { .. } | Self::Timeout { .. } => true,
            Self::Refused { status, .. } => *status >= 500 || *status == 409 || *status == 429,
            Self::Url { .. } | Self::Ca(_) | Self::Token { .. } | Self::Stopped => false,
        }
    }
}

/// `(host, port)` of an `https://host[:port]` URL.
fn host_port(url: &str) -> Result<(String, u16), IssueError> {
    let bad = |why: &str| IssueError::Url {
        url: url.to_owned(),
        why: why.to_owned(),
    };
    let uri: hyper::Uri = url.parse().map_err(|_| bad("not a URL"))?;
    if uri.scheme_str() != Some("https") {
        return Err(bad("not an https:// URL"));
    }
    let host = uri.host().ok_or_else(|| bad("no host"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Ok((host.to_owned(), uri.port_u16().unwrap_or(443)))
}

fn tls_config(ca_pem: &str) -> Result<Arc<rustls::ClientConfig>, IssueError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        let cert = cert.map_err(|e| IssueError::Ca(e.to_string()))?;
        roots.add(cert).map_err(|e| IssueError::Ca(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(IssueError::Ca("holds no certificate".to_owned()));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| IssueError::Ca(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// One request to the issuer: the credential file's bytes, or why not.
pub async fn fetch_once(cfg: &IssuerConfig) -> Result<Vec<u8>, IssueError> {
    let (host, port) = host_port(&cfg.url)?;
    let tls = tls_config(&cfg.ca_pem)?;
    let token = std::fs::read_to_string(&cfg.token_file).map_err(|source| IssueError::Token {
        path: cfg.token_file.clone(),
        source,
    })?;
    let server_name = ServerName::try_from(host.clone()).map_err(|_| IssueError::Url {
        url: cfg.url.clone(),
        why: "the host is not a DNS name or IP address".to_owned(),
    })?;
    let body = IssueRequest {
        namespace: cfg.namespace.clone(),
        pool: cfg.pool.clone(),
    }
    .to_json();
    let http_err = |why: String| IssueError::Http {
        url: cfg.url.clone(),
        why,
    };
    let attempt = async {
        let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
            .await
            .map_err(|source| IssueError::Connect {
                url: cfg.url.clone(),
                source,
            })?;
        let stream = tokio_rustls::TlsConnector::from(tls)
            .connect(server_name, tcp)
            .await
            .map_err(|source| IssueError::Connect {
                url: cfg.url.clone(),
                source,
            })?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| http_err(e.to_string()))?;
        let conn = tokio::spawn(conn);
        let request = hyper::Request::post(PATH)
            .header(hyper::header::HOST, format!("{host}:{port}"))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(
                hyper::header::AUTHORIZATION,
                format!("Bearer {}", token.trim()),
            )
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| http_err(e.to_string()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| http_err(e.to_string()))?;
        let status = response.status();
        let bytes = Limited::new(response.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| http_err(format!("reading the answer: {e}")))?
            .to_bytes();
        conn.abort();
        if status.is_success() {
            return Ok(bytes.to_vec());
        }
        let (reason, message) = parse_refusal(&bytes);
        Err(IssueError::Refused {
            status: status.as_u16(),
            reason,
            message,
        })
    };
    tokio::time::timeout(ATTEMPT_TIMEOUT, attempt)
        .await
        .map_err(|_| IssueError::Timeout {
            url: cfg.url.clone(),
        })?
}

/// [`fetch_once`], retried while the failure is transient, until `stop`.
pub async fn fetch(cfg: &IssuerConfig, stop: &CancellationToken) -> Result<Vec<u8>, IssueError> {
    let backoff = ExponentialBuilder::default()
        .with_min_delay(RETRY_MIN)
        .with_max_delay(RETRY_MAX)
        .with_max_times(RETRIES)
        .with_jitter();
    let retried = (|| fetch_once(cfg))
        .retry(backoff)
        .sleep(tokio::time::sleep)
        .when(IssueError::is_transient)
        .notify(|e, after| {
            warn!(error = %kvpool_runtime::telemetry::chain(e), retry_in = ?after,
                "no credential from the issuer yet");
        });
    tokio::select! {
        r = retried => r,
        () = stop.cancelled() => Err(IssueError::Stopped),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_cas_are_checked_before_any_connection() {
        assert_eq!(
            host_port("https://op.ns.svc:8443").expect("url"),
            ("op.ns.svc".to_owned(), 8443)
        );
        assert_eq!(
            host_port("https://[::1]").expect("url"),
            ("::1".to_owned(), 443)
        );
        for bad in ["http://op:8443", "op:8443", ""] {
            let e = host_port(bad).expect_err(bad);
            assert!(!e.is_transient());
        }
        let e = tls_config("not a certificate").expect_err("no CA");
        assert!(e.to_string().contains("holds no certificate"), "{e}");
    }

    #[test]
    fn only_failures_that_can_pass_are_retried() {
        let refused = |status| IssueError::Refused {
            status,
            reason: "r".into(),
            message: "m".into(),
        };
        assert!(refused(503).is_transient());
        assert!(refused(409).is_transient());
        assert!(!refused(403).is_transient());
        assert!(!refused(401).is_transient());
        assert!(IssueError::Timeout { url: "u".into() }.is_transient());
    }
}

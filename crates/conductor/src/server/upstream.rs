//! The conductor's HTTP client to the engines: JSON POSTs, bounded reads of their answers, and
//! the errors of an upstream call; idle pooled connections expire. I/O boundary: outgoing HTTP
//! connections.

use axum::body::{Body, Bytes};
use axum::http::{HeaderName, HeaderValue, Request, header};
use axum::response::Response;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde_json::Value;

use crate::config::UpstreamPool;

/// Largest upstream prefill response read, bytes.
const MAX_PREFILL_RESPONSE: usize = 1 << 20;

/// A failed upstream call.
#[derive(Debug, thiserror::Error)]
pub(super) enum UpstreamError {
    #[error("cannot build the request to {url}")]
    Build {
        url: String,
        #[source]
        source: axum::http::Error,
    },
    #[error("cannot reach {url}")]
    Connect {
        url: String,
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    #[error("cannot read the response of {url}")]
    Read {
        url: String,
        #[source]
        source: axum::Error,
    },
    #[error("{0}")]
    Mismatch(String),
    /// A prefill engine's bootstrap server (vLLM's `MooncakeConnector`) gave no usable answer.
    #[error("{0}")]
    Bootstrap(String),
}

/// `path` on the engine at base URL `base`.
pub(super) fn engine_url(base: &str, path: &str) -> String {
    format!("{}{path}", base.trim_end_matches('/'))
}

/// The host part of an `http://host:port` base URL, as SGLang's router puts it in
/// `bootstrap_host` (IPv6 literals keep their brackets).
pub fn url_host(url: &str) -> Option<&str> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next()?;
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let host = if authority.starts_with('[') {
        authority.split_inclusive(']').next()?
    } else {
        authority.split(':').next()?
    };
    (!host.is_empty()).then_some(host)
}

/// The HTTP client the conductor calls the engines with, and the engines' key (sent on every
/// call that carries no `Authorization` of its own).
pub(super) struct Upstream {
    client: Client<HttpConnector, Body>,
    engine_key: Option<HeaderValue>,
}

impl Upstream {
    /// Keep-alive connections with Nagle's algorithm off: a request or answer written in two
    /// pieces must not wait for the peer's acknowledgement of the first. Idle ones expire as
    /// `pool` says (the pool's timer is what makes the idle timeout apply at all).
    pub(super) fn new(pool: UpstreamPool, engine_key: Option<&str>) -> Self {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        Self {
            client: Client::builder(TokioExecutor::new())
                .pool_timer(TokioTimer::new())
                .pool_idle_timeout(pool.idle_timeout)
                .pool_max_idle_per_host(pool.max_idle_per_host)
                .build(http),
            engine_key: engine_key.and_then(|k| HeaderValue::from_str(&format!("Bearer {k}")).ok()),
        }
    }

    /// POSTs `body` as JSON to `url`; the response's body is still to be read.
    pub(super) async fn post(
        &self,
        url: String,
        body: &Value,
    ) -> Result<Response<Body>, UpstreamError> {
        self.post_with(url, body, &[]).await
    }

    /// [`Self::post`] with `headers` added (a client request's forwarded ones).
    pub(super) async fn post_with(
        &self,
        url: String,
        body: &Value,
        headers: &[(HeaderName, HeaderValue)],
    ) -> Result<Response<Body>, UpstreamError> {
        let mut req = Request::post(&url)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string()))
            .map_err(|source| UpstreamError::Build {
                url: url.clone(),
                source,
            })?;
        for (name, value) in headers {
            req.headers_mut().insert(name.clone(), value.clone());
        }
        self.request(url, req).await
    }

    /// Sends `req` (to `url`); the response's body is still to be read.
    pub(super) async fn request(
        &self,
        url: String,
        mut req: Request<Body>,
    ) -> Result<Response<Body>, UpstreamError> {
        if let Some(key) = &self.engine_key
            && !req.headers().contains_key(header::AUTHORIZATION)
        {
            req.headers_mut().insert(header::AUTHORIZATION, key.clone());
        }
        let resp = self
            .client
            .request(req)
            .await
            .map_err(|source| UpstreamError::Connect { url, source })?;
        Ok(resp.map(Body::new))
    }
}

/// Reads the body of `url`'s answer to its end (at most 1 MiB: prefill and prefetch answers
/// are small; streamed decode responses are relayed, not read).
pub(super) async fn read_body(url: String, body: Body) -> Result<Bytes, UpstreamError> {
    axum::body::to_bytes(body, MAX_PREFILL_RESPONSE)
        .await
        .map_err(|source| UpstreamError::Read { url, source })
}

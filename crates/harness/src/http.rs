//! HTTP/1.1 requests to the admin endpoints of children (`/readyz`, `/metrics`) and the APIs
//! tests call over loopback, made with hyper-util's client: one request per connection
//! (`Connection: close`), the whole reply read and de-framed by hyper. Tokio ([`call`],
//! [`request_async`]) and blocking ([`request`]: the same on a runtime of its own) flavours.
//! I/O boundary: one TCP connection per call, optionally from a chosen local address.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONNECTION, CONTENT_TYPE, HeaderMap};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Connecting, and then the whole exchange, each get at most this long.
pub const TIMEOUT: Duration = Duration::from_secs(10);
/// Largest reply body read, bytes.
pub const MAX_BODY: usize = 64 << 20;

/// A reply, its body read to the end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    /// The body (de-chunked), lossily UTF-8.
    pub body: String,
}

impl Reply {
    /// The value of header `name` (any case), if present and text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name)?.to_str().ok()
    }

    fn new(parts: http::response::Parts, body: &[u8]) -> Self {
        Reply {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body: String::from_utf8_lossy(body).into_owned(),
        }
    }
}

/// One request: method, target (`/path?query`), a JSON body (possibly empty), extra headers,
/// and the local address to send from (any, when `None`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Call<'a> {
    pub method: &'a str,
    pub target: &'a str,
    pub body: &'a str,
    pub headers: &'a [(&'a str, &'a str)],
    pub from: Option<IpAddr>,
}

impl<'a> Call<'a> {
    /// `method target` with a JSON `body`, no extra headers, from any local address.
    pub fn new(method: &'a str, target: &'a str, body: &'a str) -> Self {
        Call {
            method,
            target,
            body,
            ..Call::default()
        }
    }
}

/// Why a call got no reply.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The method, target or a header is not valid HTTP.
    #[error("not a valid request: {0}")]
    Request(#[source] http::Error),
    /// Connecting, sending or reading the reply's head failed.
    #[error("exchange failed: {}", chain(.0))]
    Exchange(#[source] hyper_util::client::legacy::Error),
    /// Reading the reply's body failed, or it was longer than [`MAX_BODY`].
    #[error("reading the body failed: {0}")]
    Body(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// No whole reply within [`TIMEOUT`].
    #[error("no reply within {TIMEOUT:?}")]
    Timeout,
}

/// An error and its sources, `: `-separated (hyper-util's own message is only "client error").
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

/// One request to `addr` on the Tokio runtime.
pub async fn call(addr: SocketAddr, c: Call<'_>) -> Result<Reply, HttpError> {
    let mut builder = http::Request::builder()
        .method(c.method)
        .uri(format!("http://{addr}{}", c.target))
        .header(CONTENT_TYPE, "application/json")
        .header(CONNECTION, "close");
    for (name, value) in c.headers {
        builder = builder.header(*name, *value);
    }
    let request = builder
        .body(Full::new(Bytes::copy_from_slice(c.body.as_bytes())))
        .map_err(HttpError::Request)?;
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(TIMEOUT));
    connector.set_nodelay(true);
    connector.set_local_address(c.from);
    let client = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build::<_, Full<Bytes>>(connector);
    let exchange = async {
        let reply = client.request(request).await.map_err(HttpError::Exchange)?;
        let (parts, body) = reply.into_parts();
        let body = Limited::new(body, MAX_BODY)
            .collect()
            .await
            .map_err(HttpError::Body)?
            .to_bytes();
        Ok(Reply::new(parts, &body))
    };
    tokio::time::timeout(TIMEOUT, exchange)
        .await
        .map_err(|_| HttpError::Timeout)?
}

/// One request (a JSON `body`, possibly empty) on the Tokio runtime; `None` whenever the
/// server does not answer (yet).
pub async fn request_async(
    addr: SocketAddr,
    method: &str,
    target: &str,
    body: &str,
) -> Option<Reply> {
    call(addr, Call::new(method, target, body)).await.ok()
}

/// `GET target` on the Tokio runtime.
pub async fn get_async(addr: SocketAddr, target: &str) -> Option<Reply> {
    request_async(addr, "GET", target, "").await
}

/// [`request_async`], blocking: on a runtime of its own in a thread of its own (so that it
/// also works from inside another runtime).
pub fn request(addr: SocketAddr, method: &str, target: &str, body: &str) -> Option<Reply> {
    std::thread::scope(|s| {
        s.spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?
                .block_on(request_async(addr, method, target, body))
        })
        .join()
        .ok()?
    })
}

/// `GET target`; blocking.
pub fn get(addr: SocketAddr, target: &str) -> Option<Reply> {
    request(addr, "GET", target, "")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server answering each connection with `reply` and handing back what it was sent.
    async fn answering(reply: &'static str) -> (SocketAddr, tokio::task::JoinHandle<String>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            while !String::from_utf8_lossy(&seen).contains("\r\n\r\n{}") {
                let n = s.read(&mut buf).await.expect("read");
                assert!(n > 0, "request cut short");
                seen.extend_from_slice(&buf[..n]);
            }
            s.write_all(reply.as_bytes()).await.expect("write");
            String::from_utf8_lossy(&seen).into_owned()
        });
        (addr, server)
    }

    #[tokio::test]
    async fn chunked_replies_are_decoded_and_headers_found_in_any_case() {
        let (addr, server) = answering(
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\n\r\n\
             5\r\nhello\r\n6;x=y\r\n world\r\n0\r\n\r\n",
        )
        .await;
        let headers = [("x-request-id", "r-1")];
        let c = Call {
            headers: &headers,
            ..Call::new("POST", "/p?q=1", "{}")
        };
        let r = call(addr, c).await.expect("a reply");
        assert_eq!((r.status, r.body.as_str()), (200, "hello world"));
        assert_eq!((r.header("x-a"), r.header("X-A")), (Some("1"), Some("1")));
        let sent = server.await.expect("server").to_ascii_lowercase();
        assert!(sent.starts_with("post /p?q=1 http/1.1\r\n"), "{sent}");
        for h in [
            "content-type: application/json",
            "connection: close",
            "x-request-id: r-1",
        ] {
            assert!(sent.contains(h), "{h}: {sent}");
        }
    }

    #[tokio::test]
    async fn a_body_to_the_end_of_the_connection_and_no_server_at_all() {
        let (addr, _server) = answering("HTTP/1.0 503 Service Unavailable\r\n\r\nnot ready").await;
        let r = request_async(addr, "POST", "/", "{}")
            .await
            .expect("a reply");
        assert_eq!((r.status, r.body.as_str()), (503, "not ready"));
        // The listener is gone: refused, so no reply.
        assert_eq!(get_async(addr, "/readyz").await, None);
        let bad = Call::new("NOT A METHOD", "/", "");
        assert!(matches!(call(addr, bad).await, Err(HttpError::Request(_))));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_blocking_flavour_works_inside_a_runtime_too() {
        let (addr, server) = answering("HTTP/1.1 204 No Content\r\n\r\n").await;
        // Called on a worker of this runtime; the server runs on the other one.
        let r = request(addr, "PUT", "/x", "{}");
        assert_eq!(r.map(|r| r.status), Some(204));
        server.await.expect("server");
        let r = get(addr, "/");
        assert_eq!(r, None);
    }
}

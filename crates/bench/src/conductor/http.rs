//! The load generator's HTTP/1.1 client: JSON POSTs through hyper-util's pooled client
//! (keep-alive connections, so N requests in flight use N connections per server, as the front
//! doors' own clients do), each response read to its end (at most [`MAX_BODY`] bytes), and a
//! streamed body read as server-sent events by `eventsource-stream`. I/O boundary: TCP
//! connections.

use std::convert::Infallible;

use bytes::Bytes;
use eventsource_stream::Eventsource;
use futures::StreamExt;
use http::header::{ACCEPT, CONTENT_TYPE};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client as Pool;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
pub use kvpool_harness::http::HttpError;

/// Largest response body read, bytes.
pub const MAX_BODY: usize = 1 << 20;

/// A response: its status and whole body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub body: Bytes,
}

/// JSON POSTs to `http://host:port/path` URLs over pooled keep-alive connections. A pooled
/// connection the server closed meanwhile is retried on a fresh one (hyper-util's default).
pub struct Client {
    pool: Pool<HttpConnector, Full<Bytes>>,
}

impl Default for Client {
    fn default() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            pool: Pool::builder(TokioExecutor::new()).build(connector),
        }
    }
}

impl Client {
    /// POSTs `body` as JSON to `url` and reads the whole response.
    pub async fn post(&self, url: &str, body: &str) -> Result<Response, HttpError> {
        let request = http::Request::post(url)
            .header(CONTENT_TYPE, "application/json")
            .header(ACCEPT, "*/*")
            .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
            .map_err(HttpError::Request)?;
        let (parts, body) = self
            .pool
            .request(request)
            .await
            .map_err(HttpError::Exchange)?
            .into_parts();
        let body = Limited::new(body, MAX_BODY)
            .collect()
            .await
            .map_err(HttpError::Body)?
            .to_bytes();
        Ok(Response {
            status: parts.status.as_u16(),
            body,
        })
    }
}

/// The `data` of each server-sent event in a whole body, in order; an error for a body that
/// is not an event stream.
pub async fn sse_data(body: Bytes) -> Result<Vec<String>, String> {
    let mut events = futures::stream::iter([Ok::<_, Infallible>(body)]).eventsource();
    let mut data = Vec::new();
    while let Some(event) = events.next().await {
        data.push(event.map_err(|e| e.to_string())?.data);
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn chunked_and_sized_bodies_are_read_and_connections_reused() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            // One connection, two requests: a chunked answer, then a sized one.
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let mut answers = [
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6;x=1\r\n world\r\n0\r\n\r\n",
                "HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nnop",
            ]
            .into_iter();
            let mut seen = 0;
            while seen < 2 {
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0);
                let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                assert!(text.starts_with("POST /p HTTP/1.1\r\n"), "{text}");
                assert!(text.ends_with("{}"), "{text}");
                s.write_all(answers.next().unwrap().as_bytes())
                    .await
                    .unwrap();
                seen += 1;
            }
        });
        let client = Client::default();
        let url = format!("http://{addr}/p");
        let a = client.post(&url, "{}").await.unwrap();
        assert_eq!((a.status, &a.body[..]), (200, &b"hello world"[..]));
        let b = client.post(&url, "{}").await.unwrap();
        assert_eq!((b.status, &b.body[..]), (404, &b"nop"[..]));
        server.await.unwrap();
        assert!(matches!(
            client.post("https://h/", "{}").await,
            Err(HttpError::Exchange(_))
        ));
        assert!(matches!(
            client.post("not a url", "{}").await,
            Err(HttpError::Request(_))
        ));
    }

    #[tokio::test]
    async fn events_are_read_whatever_their_line_ends_and_split_data_lines() {
        let body = "data: {\"a\":1}\n\n: keep-alive\r\ndata: {\"b\":\r\ndata: 2}\r\n\r\nevent: x\ndata: [DONE]\n\n";
        let data = sse_data(Bytes::from(body)).await.unwrap();
        assert_eq!(data, ["{\"a\":1}", "{\"b\":\n2}", "[DONE]"]);
        assert_eq!(sse_data(Bytes::new()).await.unwrap(), Vec::<String>::new());
    }
}

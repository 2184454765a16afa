//! The load generator's HTTP/1.1 client: JSON POSTs over keep-alive connections (a pool of idle
//! connections per address, so N requests in flight use N connections per server, as an HTTP
//! client library would), each response read to its end: a `Content-Length` body, a chunked one
//! (server-sent events) or, without either, one that ends with the connection. Lean on purpose:
//! the generator shares the cores with what it measures. I/O boundary: TCP connections.

use std::collections::HashMap;
use std::io;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Largest response body read, bytes.
const MAX_BODY: usize = 1 << 20;
/// Longest status or header line, bytes.
const MAX_LINE: usize = 16 << 10;

/// A response: its status and body (de-chunked).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

/// One keep-alive connection.
struct Conn {
    io: BufReader<TcpStream>,
}

/// The head of a response: status, and how its body is framed.
#[derive(Debug, PartialEq, Eq)]
pub struct Head {
    pub status: u16,
    pub length: Option<usize>,
    pub chunked: bool,
    pub close: bool,
}

/// Parses a status line and header lines (without their CRLFs).
pub fn parse_head<'a>(status_line: &str, headers: impl Iterator<Item = &'a str>) -> Option<Head> {
    let mut parts = status_line.split(' ');
    let version = parts.next()?;
    if !version.starts_with("HTTP/1.") {
        return None;
    }
    let status = parts.next()?.parse().ok()?;
    let mut head = Head {
        status,
        length: None,
        chunked: false,
        close: version == "HTTP/1.0",
    };
    for line in headers {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let (name, value) = (name.trim(), value.trim());
        if name.eq_ignore_ascii_case("content-length") {
            head.length = Some(value.parse().ok()?);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            head.chunked = value.to_ascii_lowercase().contains("chunked");
        } else if name.eq_ignore_ascii_case("connection") {
            head.close = value.eq_ignore_ascii_case("close");
        }
    }
    Some(head)
}

fn bad(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

impl Conn {
    async fn line(&mut self, buf: &mut String) -> io::Result<()> {
        buf.clear();
        let n = (&mut self.io).take(MAX_LINE as u64).read_line(buf).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if !buf.ends_with('\n') {
            return Err(bad("header line too long"));
        }
        buf.truncate(buf.trim_end_matches(['\r', '\n']).len());
        Ok(())
    }

    /// Sends one request and reads its response; `Ok((response, reusable))`.
    async fn exchange(&mut self, request: &[u8]) -> io::Result<(Response, bool)> {
        self.io.get_mut().write_all(request).await?;
        let mut status_line = String::new();
        self.line(&mut status_line).await?;
        let mut headers = Vec::new();
        let mut line = String::new();
        loop {
            self.line(&mut line).await?;
            if line.is_empty() {
                break;
            }
            headers.push(line.clone());
        }
        let head = parse_head(&status_line, headers.iter().map(String::as_str))
            .ok_or_else(|| bad(format!("bad response head: {status_line}")))?;
        let mut body = Vec::new();
        if head.chunked {
            loop {
                self.line(&mut line).await?;
                let size = line.split(';').next().unwrap_or("").trim();
                let size = usize::from_str_radix(size, 16)
                    .map_err(|_| bad(format!("bad chunk size: {line}")))?;
                if size == 0 {
                    // Trailers, up to the empty line.
                    loop {
                        self.line(&mut line).await?;
                        if line.is_empty() {
                            break;
                        }
                    }
                    break;
                }
                if body.len() + size > MAX_BODY {
                    return Err(bad("body too long"));
                }
                let start = body.len();
                body.resize(start + size + 2, 0);
                self.io.read_exact(&mut body[start..]).await?;
                body.truncate(start + size);
            }
        } else if let Some(n) = head.length {
            if n > MAX_BODY {
                return Err(bad("body too long"));
            }
            body.resize(n, 0);
            self.io.read_exact(&mut body).await?;
        } else {
            (&mut self.io)
                .take(MAX_BODY as u64)
                .read_to_end(&mut body)
                .await?;
            return Ok((
                Response {
                    status: head.status,
                    body,
                },
                false,
            ));
        }
        Ok((
            Response {
                status: head.status,
                body,
            },
            !head.close,
        ))
    }
}

/// JSON POSTs to `http://host:port/path` URLs over pooled keep-alive connections.
#[derive(Default)]
pub struct Client {
    idle: parking_lot::Mutex<HashMap<String, Vec<Conn>>>,
}

/// `(authority, path)` of an `http://` URL.
pub fn split_url(url: &str) -> Option<(&str, &str)> {
    let rest = url.strip_prefix("http://")?;
    Some(match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    })
}

impl Client {
    /// POSTs `body` as JSON to `url` and reads the whole response. A pooled connection the
    /// server has closed meanwhile is retried once on a fresh one.
    pub async fn post(&self, url: &str, body: &str) -> io::Result<Response> {
        let (authority, path) =
            split_url(url).ok_or_else(|| bad(format!("not an http:// URL: {url}")))?;
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\n\
             Accept: */*\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let pooled = self.idle.lock().get_mut(authority).and_then(Vec::pop);
        let (response, conn, reusable) = match pooled {
            Some(mut conn) => match conn.exchange(request.as_bytes()).await {
                Ok((r, reusable)) => (r, conn, reusable),
                Err(_) => self.fresh(authority, request.as_bytes()).await?,
            },
            None => self.fresh(authority, request.as_bytes()).await?,
        };
        if reusable {
            self.idle
                .lock()
                .entry(authority.to_owned())
                .or_default()
                .push(conn);
        }
        Ok(response)
    }

    async fn fresh(&self, authority: &str, request: &[u8]) -> io::Result<(Response, Conn, bool)> {
        let stream = TcpStream::connect(authority).await?;
        stream.set_nodelay(true)?;
        let mut conn = Conn {
            io: BufReader::new(stream),
        };
        let (r, reusable) = conn.exchange(request).await?;
        Ok((r, conn, reusable))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_say_how_the_body_is_framed() {
        let h = parse_head(
            "HTTP/1.1 200 OK",
            ["content-length: 12", "X: y"].into_iter(),
        )
        .unwrap();
        assert_eq!(
            h,
            Head {
                status: 200,
                length: Some(12),
                chunked: false,
                close: false
            }
        );
        let h = parse_head(
            "HTTP/1.1 503 Service Unavailable",
            ["Transfer-Encoding: chunked", "Connection: close"].into_iter(),
        )
        .unwrap();
        assert!(h.chunked && h.close && h.status == 503);
        assert!(
            parse_head("HTTP/1.0 200 OK", std::iter::empty())
                .unwrap()
                .close
        );
        assert_eq!(parse_head("SSH-2.0", std::iter::empty()), None);
        assert_eq!(
            parse_head("HTTP/1.1 200 OK", ["content-length: x"].into_iter()),
            None
        );
    }

    #[test]
    fn urls_split_into_authority_and_path() {
        assert_eq!(
            split_url("http://127.0.0.1:80/v1/completions"),
            Some(("127.0.0.1:80", "/v1/completions"))
        );
        assert_eq!(split_url("http://h:1"), Some(("h:1", "/")));
        assert_eq!(split_url("https://h"), None);
    }

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
        assert_eq!((a.status, a.body.as_slice()), (200, &b"hello world"[..]));
        let b = client.post(&url, "{}").await.unwrap();
        assert_eq!((b.status, b.body.as_slice()), (404, &b"nop"[..]));
        server.await.unwrap();
    }
}

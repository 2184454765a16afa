//! A minimal HTTP/1.1 client for the admin endpoints of children (`/readyz`, `/metrics`) and the
//! APIs tests call over loopback: one request per connection (`Connection: close`), the whole
//! reply read, a chunked body decoded. Blocking ([`request`]) and Tokio ([`request_async`])
//! flavours share the request text and the reply parser. I/O boundary: one TCP connection per
//! call; `None` whenever the server does not answer (yet) or answers garbage.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// Connecting, and then the whole exchange, each get at most this long.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// A parsed reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    /// Status line and headers.
    pub head: String,
    /// The body, de-chunked.
    pub body: String,
}

impl Reply {
    /// The value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

fn request_text(addr: SocketAddr, method: &str, target: &str, body: &str) -> String {
    format!(
        "{method} {target} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Parses a whole HTTP/1.x reply.
pub fn parse_reply(raw: &[u8]) -> Option<Reply> {
    let text = String::from_utf8_lossy(raw);
    let status = text.get(9..12)?.parse().ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let reply = Reply {
        status,
        head: head.to_owned(),
        body: body.to_owned(),
    };
    if reply
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
    {
        let body = dechunk(&reply.body)?;
        return Some(Reply { body, ..reply });
    }
    Some(reply)
}

fn dechunk(mut rest: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(after.get(..size)?);
        rest = after.get(size + 2..)?;
    }
}

/// One request (a JSON `body`, possibly empty); blocking.
pub fn request(addr: SocketAddr, method: &str, target: &str, body: &str) -> Option<Reply> {
    let mut s = TcpStream::connect_timeout(&addr, TIMEOUT).ok()?;
    s.set_read_timeout(Some(TIMEOUT)).ok()?;
    s.set_write_timeout(Some(TIMEOUT)).ok()?;
    s.write_all(request_text(addr, method, target, body).as_bytes())
        .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    parse_reply(&raw)
}

/// `GET target`; blocking.
pub fn get(addr: SocketAddr, target: &str) -> Option<Reply> {
    request(addr, "GET", target, "")
}

/// One request on the Tokio runtime (for tests whose servers run on the same runtime).
pub async fn request_async(
    addr: SocketAddr,
    method: &str,
    target: &str,
    body: &str,
) -> Option<Reply> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(request_text(addr, method, target, body).as_bytes())
            .await
            .ok()?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.ok()?;
        Some(raw)
    };
    let raw = tokio::time::timeout(TIMEOUT, exchange).await.ok()??;
    parse_reply(&raw)
}

/// `GET target` on the Tokio runtime.
pub async fn get_async(addr: SocketAddr, target: &str) -> Option<Reply> {
    request_async(addr, "GET", target, "").await
}

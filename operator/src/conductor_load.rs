//! The load of a `KVCachePool`'s conductor, per role, as its `GET /v1/kvpool/load` endpoint
//! reports it (docs/scheduling.md, "Load signal"): what the engine-pool controller autoscales
//! by (docs/adr/0007-autoscaling-from-the-conductor.md). Behind the [`ConductorLoad`] trait so
//! the reconcile tests script the signal; the reader is injected through the controllers'
//! `Context`, so this module sits below it.
//! I/O boundary: the HTTP GET in [`HttpConductorLoad`].

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use futures::future::BoxFuture;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvpool_core::autoscale::LoadReport;

/// Path of the conductor's load endpoint.
pub const LOAD_PATH: &str = "/v1/kvpool/load";
/// Largest answer read, bytes (the real one is a few hundred).
const MAX_ANSWER: usize = 64 * 1024;

/// Why the load could not be read.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum LoadError {
    #[error("bad conductor address {addr:?}")]
    Address {
        addr: String,
        #[source]
        source: hyper::http::Error,
    },
    #[error("conductor {addr} did not answer {LOAD_PATH}")]
    Unreachable {
        addr: String,
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    #[error("conductor {addr} answered {LOAD_PATH} with HTTP {status}")]
    Status { addr: String, status: u16 },
    #[error("cannot read the answer of conductor {addr} (at most {MAX_ANSWER} bytes)")]
    Read {
        addr: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("conductor {addr} answered {LOAD_PATH} with a body that is not a load report")]
    Parse {
        addr: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("conductor {addr} did not answer {LOAD_PATH} within {timeout:?}")]
    Timeout { addr: String, timeout: Duration },
    /// A scripted reader ran out of answers, or was told to fail (tests).
    #[error("no load figures for {addr}")]
    Silent { addr: String },
}

kvpool_runtime::error_category!(LoadError);

/// Reads a conductor's load. Object-safe so the context can hold any implementation.
pub trait ConductorLoad: Send + Sync {
    /// Ask the conductor whose API listens on `addr` (`host:port`).
    fn load<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, Result<LoadReport, LoadError>>;
}

/// The real reader: plain HTTP to the conductor Service, bounded by `timeout` as a whole.
#[derive(Clone, Debug)]
pub struct HttpConductorLoad {
    pub timeout: Duration,
    client: Client<HttpConnector, Empty<Bytes>>,
}

impl HttpConductorLoad {
    pub fn new(timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        Self {
            timeout,
            client: Client::builder(TokioExecutor::new()).build(connector),
        }
    }

    async fn get(&self, addr: &str) -> Result<LoadReport, LoadError> {
        let request = hyper::Request::get(format!("http://{addr}{LOAD_PATH}"))
            .header(hyper::header::ACCEPT, "application/json")
            .body(Empty::<Bytes>::new())
            .map_err(|source| LoadError::Address {
                addr: addr.to_owned(),
                source,
            })?;
        let response =
            self.client
                .request(request)
                .await
                .map_err(|source| LoadError::Unreachable {
                    addr: addr.to_owned(),
                    source,
                })?;
        let status = response.status();
        if !status.is_success() {
            return Err(LoadError::Status {
                addr: addr.to_owned(),
                status: status.as_u16(),
            });
        }
        let body = Limited::new(response.into_body(), MAX_ANSWER)
            .collect()
            .await
            .map_err(|source| LoadError::Read {
                addr: addr.to_owned(),
                source,
            })?
            .to_bytes();
        serde_json::from_slice(&body).map_err(|source| LoadError::Parse {
            addr: addr.to_owned(),
            source,
        })
    }
}

impl Default for HttpConductorLoad {
    fn default() -> Self {
        Self::new(Duration::from_secs(3))
    }
}

impl ConductorLoad for HttpConductorLoad {
    fn load<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, Result<LoadReport, LoadError>> {
        Box::pin(async move {
            match tokio::time::timeout(self.timeout, self.get(addr)).await {
                Ok(answer) => answer,
                Err(_) => Err(LoadError::Timeout {
                    addr: addr.to_owned(),
                    timeout: self.timeout,
                }),
            }
        })
    }
}

/// A reader that answers from a script, one entry per call (`None`: the conductor is silent),
/// then stays silent. For tests.
#[derive(Debug, Default)]
pub struct ScriptedLoad {
    script: Mutex<VecDeque<Option<LoadReport>>>,
    /// Addresses asked, in order.
    asked: Mutex<Vec<String>>,
}

impl ScriptedLoad {
    pub fn new(script: impl IntoIterator<Item = Option<LoadReport>>) -> Self {
        Self {
            script: Mutex::new(script.into_iter().collect()),
            asked: Mutex::default(),
        }
    }

    /// Append one answer.
    pub fn push(&self, answer: Option<LoadReport>) {
        self.script
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(answer);
    }

    /// The addresses asked so far.
    pub fn asked(&self) -> Vec<String> {
        self.asked.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl ConductorLoad for ScriptedLoad {
    fn load<'a>(&'a self, addr: &'a str) -> BoxFuture<'a, Result<LoadReport, LoadError>> {
        self.asked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(addr.to_owned());
        let next = self
            .script
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front()
            .flatten();
        let answer = next.ok_or_else(|| LoadError::Silent {
            addr: addr.to_owned(),
        });
        Box::pin(std::future::ready(answer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_core::autoscale::RoleLoad;

    /// Serve one HTTP answer per connection on 127.0.0.1 with `status` and `body`.
    async fn serve_once(status: u16, body: String) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let mut buf = [0u8; 2048];
                let mut head = Vec::new();
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let text = String::from_utf8_lossy(&head).to_string();
                let (status, body) = if text.starts_with(&format!("GET {LOAD_PATH} ")) {
                    (status, body.clone())
                } else {
                    (404, String::new())
                };
                let answer = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(answer.as_bytes()).await;
            }
        });
        addr
    }

    #[tokio::test]
    async fn reads_the_report_and_names_what_went_wrong() {
        let report = LoadReport {
            window_s: 30.0,
            prefill: RoleLoad {
                instances: 2,
                queue_depth: 7,
                slo_s: 2.0,
                ..RoleLoad::default()
            },
            decode: RoleLoad::default(),
        };
        let reader = HttpConductorLoad::default();
        let addr = serve_once(200, serde_json::to_string(&report).expect("json")).await;
        assert_eq!(reader.load(&addr).await.expect("load"), report);

        let addr = serve_once(503, "{}".into()).await;
        let err = reader.load(&addr).await.expect_err("503");
        assert!(
            matches!(err, LoadError::Status { status: 503, .. }),
            "{err}"
        );

        let addr = serve_once(200, "not json".into()).await;
        assert_eq!(
            reader.load(&addr).await.expect_err("garbage").category(),
            "parse"
        );

        let addr = serve_once(200, "x".repeat(MAX_ANSWER + 1)).await;
        assert_eq!(
            reader.load(&addr).await.expect_err("too big").category(),
            "read"
        );

        // A port nobody listens on: bind, learn the port, close.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("port");
        let err = reader
            .load(&format!("127.0.0.1:{port}"))
            .await
            .expect_err("nothing listens");
        assert!(
            matches!(err.category(), "unreachable" | "timeout"),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn scripted_answers_run_out_into_silence() {
        let s = ScriptedLoad::new([Some(LoadReport::default()), None]);
        assert!(s.load("a:1").await.is_ok());
        assert!(s.load("a:1").await.is_err());
        assert!(s.load("a:1").await.is_err());
        assert_eq!(s.asked().len(), 3);
    }
}

//! The load generator of `kvpool bench conductor`, the same for every target: `/v1/completions`
//! requests with a fresh prompt each (so that no prefix cache or cache-aware policy sees a
//! repeat), read to the end of the response (the last byte of the JSON body, or the `[DONE]`
//! event when streaming). Two phases per target: one request in flight for a count of
//! requests (latency), and a closed loop of N requests in flight for a duration (the maximum
//! request rate). The `Direct` target is a front door of zero cost: the generator itself sends
//! each request to a prefill and a decode engine at once with a fresh bootstrap room, as
//! SGLang's convention and both front doors do. I/O boundary: HTTP/1.1 keep-alive connections
//! on loopback, the monotonic clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;
use serde_json::json;

use super::http::{Client, sse_data};
use super::router::BOOTSTRAP_PORT;

/// Largest bootstrap room (SGLang draws them from 0 to 2^63 - 1).
const MAX_ROOM: u64 = (1 << 63) - 1;

/// Where requests go.
#[derive(Clone, Debug)]
pub enum Target {
    /// Straight to the engines, paired here: prefill `i % P` and decode `i % D`.
    Direct {
        prefill: Vec<String>,
        decode: Vec<String>,
    },
    /// To a front door's `/v1/completions`.
    Front { base: String },
}

/// What every request looks like.
#[derive(Clone, Debug)]
pub struct Workload {
    pub model: String,
    /// Bytes of prompt text (stand-in tokens of 4 bytes each).
    pub prompt_bytes: usize,
    pub max_tokens: u32,
    pub stream: bool,
}

/// The figures of one phase against one target.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Phase {
    pub requests: u64,
    pub ok: u64,
    pub failed: u64,
    pub seconds: f64,
    /// Successful requests per second.
    pub requests_per_second: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub first_error: Option<String>,
}

/// The prompt of request `i`: its number, then letters, `bytes` long in all (at least the
/// number), so that no two requests share more than a few leading bytes.
pub fn prompt(i: u64, bytes: usize) -> String {
    let mut s = format!("{i:x} ");
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while s.len() < bytes {
        // xorshift: letters that differ between requests all the way along.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push(char::from(b'a' + (x % 26) as u8));
    }
    s
}

/// Longest latency told apart, microseconds (an hour); longer ones count as this.
const MAX_LATENCY_US: u64 = 3_600_000_000;

/// Latencies and outcomes of a phase, in the making: latencies in microseconds in an HDR
/// histogram (three significant digits), as the other benchmarks keep them.
struct Tally {
    latencies_us: Histogram<u64>,
    failed: u64,
    first_error: Option<String>,
}

impl Default for Tally {
    fn default() -> Self {
        Self {
            latencies_us: Histogram::new_with_bounds(1, MAX_LATENCY_US, 3)
                .unwrap_or_else(|_| unreachable!("constant bounds are valid")),
            failed: 0,
            first_error: None,
        }
    }
}

impl Tally {
    fn record(&mut self, started: Instant, outcome: Result<(), String>) {
        match outcome {
            Ok(()) => self.record_latency(started.elapsed()),
            Err(e) => {
                self.failed += 1;
                self.first_error.get_or_insert(e);
            }
        }
    }

    fn record_latency(&mut self, latency: Duration) {
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.latencies_us.saturating_record(us.max(1));
    }

    fn merge(&mut self, other: Tally) {
        // Same bounds on both sides, so adding cannot fail.
        let _ = self.latencies_us.add(&other.latencies_us);
        self.failed += other.failed;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }

    /// The `q`-quantile latency in milliseconds; 0 with no latency recorded.
    fn quantile_ms(&self, q: f64) -> f64 {
        self.latencies_us.value_at_quantile(q) as f64 / 1e3
    }

    fn phase(self, seconds: f64) -> Phase {
        let ok = self.latencies_us.len();
        Phase {
            requests: ok + self.failed,
            ok,
            failed: self.failed,
            seconds,
            requests_per_second: if seconds > 0.0 {
                ok as f64 / seconds
            } else {
                0.0
            },
            p50_ms: self.quantile_ms(0.5),
            p99_ms: self.quantile_ms(0.99),
            first_error: self.first_error,
        }
    }
}

/// The HTTP client and the request counter (which numbers the prompts) of one run.
pub struct Load {
    client: Client,
    work: Workload,
    next: AtomicU64,
}

impl Load {
    pub fn new(work: Workload) -> Arc<Self> {
        Arc::new(Self {
            client: Client::default(),
            work,
            next: AtomicU64::new(0),
        })
    }

    fn body(&self, i: u64, bootstrap: Option<(&str, u64)>) -> String {
        let w = &self.work;
        let mut v = json!({
            "model": w.model,
            "prompt": prompt(i, w.prompt_bytes),
            "max_tokens": w.max_tokens,
            "stream": w.stream,
        });
        if let (Some((host, room)), Some(obj)) = (bootstrap, v.as_object_mut()) {
            obj.insert("bootstrap_host".into(), json!(host));
            obj.insert("bootstrap_port".into(), json!(BOOTSTRAP_PORT));
            obj.insert("bootstrap_room".into(), json!(room));
        }
        v.to_string()
    }

    /// POSTs `body` to `url` and reads the answer to its end; an error unless it is a 200
    /// whose body looks complete.
    async fn post(&self, url: String, body: String) -> Result<(), String> {
        let resp = self
            .client
            .post(&url, &body)
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        let bytes = &resp.body;
        let complete = if self.work.stream {
            complete_stream(bytes.clone()).await
        } else {
            serde_json::from_slice::<serde_json::Value>(bytes)
                .is_ok_and(|v| v.get("choices").is_some())
        };
        match (resp.status, complete) {
            (200, true) => Ok(()),
            (status, _) => Err(format!(
                "{url}: {status}: {}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
            )),
        }
    }

    /// One request to `target`, to the end of its response.
    pub async fn one(&self, target: &Target) -> Result<(), String> {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        match target {
            Target::Front { base } => {
                self.post(format!("{base}/v1/completions"), self.body(i, None))
                    .await
            }
            Target::Direct { prefill, decode } => {
                let p = &prefill[i as usize % prefill.len()];
                let d = &decode[i as usize % decode.len()];
                let host = url_host(p);
                let body = self.body(i, Some((host, rand::random::<u64>() & MAX_ROOM)));
                let (a, b) = tokio::join!(
                    self.post(format!("{p}/v1/completions"), body.clone()),
                    self.post(format!("{d}/v1/completions"), body)
                );
                a.and(b)
            }
        }
    }

    /// Sends requests to `target` until one succeeds or `timeout` passes (a front door that
    /// has just started may not have registered its engines yet).
    pub async fn wait_serving(&self, target: &Target, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.one(target).await {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// `n` requests, one in flight.
    pub async fn sequential(&self, target: &Target, n: u64) -> Phase {
        let mut tally = Tally::default();
        let started = Instant::now();
        for _ in 0..n {
            let t = Instant::now();
            let outcome = self.one(target).await;
            tally.record(t, outcome);
        }
        tally.phase(started.elapsed().as_secs_f64())
    }

    /// `concurrency` requests in flight (each worker sends its next one when its last one is
    /// done) until `duration` has passed; requests in flight then are finished and counted.
    pub async fn closed_loop(
        self: &Arc<Self>,
        target: &Target,
        concurrency: usize,
        duration: Duration,
    ) -> Phase {
        let started = Instant::now();
        let deadline = started + duration;
        let workers: Vec<_> = (0..concurrency)
            .map(|_| {
                let (this, target) = (self.clone(), target.clone());
                tokio::spawn(async move {
                    let mut tally = Tally::default();
                    while Instant::now() < deadline {
                        let t = Instant::now();
                        let outcome = this.one(&target).await;
                        tally.record(t, outcome);
                    }
                    tally
                })
            })
            .collect();
        let mut tally = Tally::default();
        for w in workers {
            match w.await {
                Ok(t) => tally.merge(t),
                Err(e) => tally.record(Instant::now(), Err(format!("worker lost: {e}"))),
            }
        }
        tally.phase(started.elapsed().as_secs_f64())
    }
}

/// Whether a streamed completion is whole: server-sent events of JSON chunks, the last one
/// `[DONE]`.
async fn complete_stream(body: bytes::Bytes) -> bool {
    let Ok(data) = sse_data(body).await else {
        return false;
    };
    match data.split_last() {
        Some((last, chunks)) => {
            last == "[DONE]"
                && chunks
                    .iter()
                    .all(|c| serde_json::from_str::<serde_json::Value>(c).is_ok())
        }
        None => false,
    }
}

/// The host of an `http://host:port` base URL (what `bootstrap_host` carries).
fn url_host(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    authority
        .rsplit_once(':')
        .map_or(authority, |(host, _)| host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_have_the_asked_length_and_differ_from_the_first_bytes_on() {
        let a = prompt(1, 256);
        let b = prompt(2, 256);
        assert_eq!((a.len(), b.len()), (256, 256));
        assert_ne!(a[..4], b[..4]);
        assert!(a.is_ascii());
        assert_eq!(prompt(0x1234, 2), "1234 ", "never shorter than the number");
    }

    #[test]
    fn latency_quantiles_in_milliseconds_merged_over_workers() {
        assert_eq!(Tally::default().phase(1.0).p99_ms, 0.0);
        let (mut a, mut b) = (Tally::default(), Tally::default());
        for ms in 1..=100u64 {
            let t = if ms % 2 == 0 { &mut a } else { &mut b };
            t.record_latency(Duration::from_millis(ms));
        }
        a.merge(b);
        let p = a.phase(1.0);
        assert_eq!(p.ok, 100);
        // Three significant digits: within 0.1% of the nearest-rank values 50 and 99 ms.
        assert!((p.p50_ms - 50.0).abs() <= 0.05, "{}", p.p50_ms);
        assert!((p.p99_ms - 99.0).abs() <= 0.1, "{}", p.p99_ms);
    }

    #[tokio::test]
    async fn a_stream_is_complete_with_json_chunks_then_done() {
        let whole = "data: {\"choices\":[]}\n\ndata: {\"choices\":[]}\n\ndata: [DONE]\n\n";
        assert!(complete_stream(whole.into()).await);
        assert!(complete_stream("data: [DONE]\n\n".into()).await);
        for cut in [
            "",
            "data: {\"choices\":[]}\n\n",
            "data: {\"cho\n\ndata: [DONE]\n\n",
        ] {
            assert!(!complete_stream(cut.into()).await, "{cut:?}");
        }
    }

    #[test]
    fn a_tally_counts_failures_and_keeps_the_first_error() {
        let mut t = Tally::default();
        let now = Instant::now();
        t.record(now, Ok(()));
        t.record(now, Err("first".into()));
        t.record(now, Err("second".into()));
        let p = t.phase(2.0);
        assert_eq!((p.requests, p.ok, p.failed), (3, 1, 2));
        assert_eq!(p.requests_per_second, 0.5);
        assert_eq!(p.first_error.as_deref(), Some("first"));
    }

    #[test]
    fn direct_requests_carry_the_prefill_engines_bootstrap_fields() {
        let load = Load::new(Workload {
            model: "m".into(),
            prompt_bytes: 16,
            max_tokens: 3,
            stream: false,
        });
        let v: serde_json::Value =
            serde_json::from_str(&load.body(5, Some(("127.0.0.1", 42)))).unwrap();
        assert_eq!(v["bootstrap_host"], "127.0.0.1");
        assert_eq!(v["bootstrap_port"], BOOTSTRAP_PORT);
        assert_eq!(v["bootstrap_room"], 42);
        assert_eq!(v["max_tokens"], 3);
        assert_eq!(v["prompt"].as_str().unwrap().len(), 16);
        let front: serde_json::Value = serde_json::from_str(&load.body(5, None)).unwrap();
        assert!(front.get("bootstrap_room").is_none());
        assert_eq!(url_host("http://127.0.0.1:8000"), "127.0.0.1");
        assert_eq!(url_host("http://h:1/x"), "h");
    }
}

//! `kvpool up --replay`: turns Mooncake trace records into prompts whose blocks follow the
//! trace's `hash_ids` (equal ids give equal text, so shared prefixes in the trace are shared
//! prefixes for the conductor and the engines), sends them to the conductor at trace timing
//! divided by the speed-up, and measures TTFT and TPOT from the streamed responses. Prompt
//! building and the statistics are pure; `send` and `replay` own the HTTP client and the clock.

use std::time::{Duration, Instant};

use axum::body::Body;
use eventsource_stream::Eventsource;
use futures::StreamExt;
use http::{Request, header};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use kvpool_conductor::server::TTFT_HEADER;
use kvpool_core::sim::trace::TraceRecord;

/// Prompt text for a trace record: `input_length` stand-in tokens of `chunk_bytes` ASCII bytes
/// each, block `i` (of `block_size` tokens) derived from `hash_ids[i]` alone.
pub fn prompt_text(rec: &TraceRecord, block_size: u32, chunk_bytes: usize) -> String {
    let block = u64::from(block_size.max(1));
    let chunk = chunk_bytes.max(1);
    let mut out = String::with_capacity(rec.input_length as usize * chunk);
    let mut left = rec.input_length;
    for &id in &rec.hash_ids {
        let n = left.min(block);
        for t in 0..n {
            let h = xxh3_64_with_seed(&t.to_le_bytes(), id);
            for k in 0..chunk {
                // Letters only: valid UTF-8, one byte per character.
                out.push(char::from(b'a' + ((h >> (5 * (k % 12))) % 26) as u8));
            }
        }
        left -= n;
    }
    out
}

pub use super::stats::{Outcome, Quantiles, ReplayStats, quantile, summarise};

/// Whether a server-sent event carries a completion chunk (JSON), not the `[DONE]` marker.
fn is_chunk(event: &eventsource_stream::Event) -> bool {
    event.data.trim_start().starts_with('{')
}

type HttpClient = Client<HttpConnector, Body>;

/// Sends one streaming completion and times it.
async fn send(client: &HttpClient, url: &str, body: String) -> Outcome {
    let Ok(req) = Request::post(url)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
    else {
        return Outcome::Failed;
    };
    let start = Instant::now();
    let resp = match client.request(req).await {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(error = %e, "replay request failed");
            return Outcome::Failed;
        }
    };
    // The conductor's TTFT estimate comes with the response head, before the first token.
    let predicted_ttft_s = predicted_ttft_s(resp.headers());
    match resp.status().as_u16() {
        200 => {}
        429 => return Outcome::Rejected,
        400 => {
            // A request that no load would let through (code `slo_unattainable`) is an early
            // rejection too; any other 400 is a failure.
            let body = axum::body::to_bytes(Body::new(resp.into_body()), 64 << 10)
                .await
                .unwrap_or_default();
            let code = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v.pointer("/error/code")?.as_str().map(str::to_owned));
            if code.as_deref() == Some("slo_unattainable") {
                return Outcome::Rejected;
            }
            tracing::debug!(?code, "replay request refused");
            return Outcome::Failed;
        }
        other => {
            tracing::debug!(status = other, "replay request refused");
            return Outcome::Failed;
        }
    }
    // Server-sent events as the spec frames them (an event split across frames, CRLF line
    // ends, comments); each chunk event is one step of the stream.
    let mut events = Body::new(resp.into_body()).into_data_stream().eventsource();
    let mut first: Option<Instant> = None;
    let mut last = start;
    let mut tokens = 0;
    while let Some(event) = events.next().await {
        let Ok(event) = event else {
            return Outcome::Failed;
        };
        if is_chunk(&event) {
            let now = Instant::now();
            first.get_or_insert(now);
            last = now;
            tokens += 1;
        }
    }
    let Some(first) = first else {
        return Outcome::Failed;
    };
    let ttft_s = first.duration_since(start).as_secs_f64();
    let tpot_s =
        (tokens > 1).then(|| last.duration_since(first).as_secs_f64() / (tokens - 1) as f64);
    Outcome::Served {
        ttft_s,
        tpot_s,
        tokens,
        predicted_ttft_s,
    }
}

/// The conductor's TTFT estimate in a response's headers ([`TTFT_HEADER`], milliseconds), in
/// seconds; `None` when absent or not a finite number >= 0.
fn predicted_ttft_s(headers: &http::HeaderMap) -> Option<f64> {
    let ms: f64 = headers
        .get(TTFT_HEADER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    (ms.is_finite() && ms >= 0.0).then_some(ms / 1e3)
}

/// Replays `records` against the conductor at `conductor` (base URL), `speed` times faster
/// than the trace; stops sending new requests when `stop` is cancelled (requests in flight get
/// two more seconds, then count as failed).
#[allow(clippy::too_many_arguments)]
pub async fn replay(
    conductor: &str,
    model: &str,
    records: &[TraceRecord],
    block_size: u32,
    chunk_bytes: usize,
    speed: f64,
    stop: &CancellationToken,
    on_done: &OnDone,
) -> ReplayStats {
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let url = format!("{}/v1/completions", conductor.trim_end_matches('/'));
    let start = Instant::now();
    let t0 = records.first().map_or(0, |r| r.timestamp_ms);
    let mut tasks = Vec::with_capacity(records.len());
    for rec in records {
        let at = Duration::from_secs_f64(rec.timestamp_ms.saturating_sub(t0) as f64 / 1e3 / speed);
        tokio::select! {
            () = tokio::time::sleep_until((start + at).into()) => {}
            () = stop.cancelled() => break,
        }
        let body = json!({
            "model": model,
            "prompt": prompt_text(rec, block_size, chunk_bytes),
            "max_tokens": rec.output_length.max(1),
            "stream": true,
        })
        .to_string();
        let (client, url, on_done) = (client.clone(), url.clone(), on_done.clone());
        tasks.push(tokio::spawn(async move {
            let outcome = send(&client, &url, body).await;
            on_done(&outcome);
            outcome
        }));
    }
    // Requests in flight finish; once the replay is stopped they get `DRAIN` more, then the
    // rest is abandoned and counted as failed (a dead child may never answer them).
    let abandon = async {
        stop.cancelled().await;
        tokio::time::sleep(DRAIN).await;
    };
    tokio::pin!(abandon);
    let mut abandoned = false;
    let mut outcomes = Vec::with_capacity(tasks.len());
    for mut t in tasks {
        if !abandoned {
            tokio::select! {
                r = &mut t => {
                    outcomes.push(r.unwrap_or(Outcome::Failed));
                    continue;
                }
                () = &mut abandon => abandoned = true,
            }
        }
        t.abort();
        on_done(&Outcome::Failed);
        outcomes.push(Outcome::Failed);
    }
    summarise(&outcomes, start.elapsed().as_secs_f64())
}

/// Told of every request's outcome as it finishes (the progress line).
pub type OnDone = std::sync::Arc<dyn Fn(&Outcome) + Send + Sync>;

/// How long requests in flight may still finish once a replay is stopped.
const DRAIN: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use kvpool_core::sched::{block_keys, text_tokens};

    fn rec(input: u64, ids: &[u64]) -> TraceRecord {
        TraceRecord {
            timestamp_ms: 0,
            input_length: input,
            output_length: 3,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn shared_hash_ids_give_shared_block_keys() {
        let a = prompt_text(&rec(10, &[1, 2, 3]), 4, 4);
        let b = prompt_text(&rec(9, &[1, 2, 7]), 4, 4);
        assert_eq!((a.len(), b.len()), (40, 36));
        let bs = NonZeroU32::new(4).unwrap();
        let ka = block_keys(&text_tokens(&a, 4), bs);
        let kb = block_keys(&text_tokens(&b, 4), bs);
        assert_eq!(ka.len(), 3);
        assert_eq!(ka[..2], kb[..2]);
        assert_ne!(ka[2], kb[2]);
        // Different first id: nothing shared.
        let c = prompt_text(&rec(8, &[9, 2]), 4, 4);
        assert_ne!(block_keys(&text_tokens(&c, 4), bs)[1], ka[1]);
    }

    #[test]
    fn the_ttft_estimate_is_read_from_the_response_head() {
        let mut h = http::HeaderMap::new();
        assert_eq!(predicted_ttft_s(&h), None);
        h.insert(TTFT_HEADER, http::HeaderValue::from_static("250.000"));
        assert_eq!(predicted_ttft_s(&h), Some(0.25));
        for bad in ["-1", "NaN", "soon"] {
            h.insert(TTFT_HEADER, http::HeaderValue::from_static(bad));
            assert_eq!(predicted_ttft_s(&h), None, "{bad}");
        }
    }

    #[tokio::test]
    async fn chunk_events_are_counted_not_done_even_split_across_frames() {
        let frames = [
            "data: {\"a\"",
            ":1}\r\n\r",
            "\n: keep-alive\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n",
        ];
        let events: Vec<_> = futures::stream::iter(
            frames.map(|f| Ok::<_, std::convert::Infallible>(bytes::Bytes::from(f))),
        )
        .eventsource()
        .collect()
        .await;
        let chunks = events
            .iter()
            .filter(|e| e.as_ref().is_ok_and(is_chunk))
            .count();
        assert_eq!(chunks, 2);
    }
}

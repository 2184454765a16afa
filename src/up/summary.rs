//! What `kvpool up --replay` reports: the engines' KV traffic and timings scraped from their
//! `/metrics` and the conductor's, the master's pool statistics, and the summary built from them
//! (JSON, or text for people). I/O boundary: `engine_kv` and `pool_stats` (HTTP and gRPC to the
//! children); the summary itself is pure.

use std::path::Path;

use serde_json::{Value, json};

use super::plan::{ChildSpec, Role};
use super::stats::{Prediction, Quantiles, ReplayStats};
pub use kvpool_harness::scrape::{metric_sum, metric_sum_labelled};

/// The timed operations of the summary's `timing` object: the engines' KV work by operation
/// (`kvpool_engine_kv_seconds{op}`), their prefill queue, and the conductor's pool lookups.
pub const TIMED: [&str; 6] = [
    "exists",
    "read",
    "write",
    "handoff_wait",
    "prefill_queue",
    "pool_lookup",
];

/// KV traffic summed over the engines, and where the time went.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineKv {
    pub read_bytes: f64,
    pub written_bytes: f64,
    pub block_hits: f64,
    pub block_misses: f64,
    pub verify_failures: f64,
    pub errors: f64,
    /// Per [`TIMED`] entry: total wall seconds and number of observations.
    pub timed_s: [f64; 6],
    pub timed_n: [f64; 6],
    /// The pool bandwidth the conductor's estimate ended on, bytes per cost-model second.
    pub fetch_bandwidth_bps: Option<f64>,
    /// The prefill engines' KV events the conductor applied: blocks stored, blocks removed,
    /// and breaks in the sequence (all recoveries).
    pub kv_events: [f64; 3],
    /// Real engines' prompt tokens by where they came from, as vLLM counts them
    /// (`vllm:prompt_tokens_by_source_total`): [`PROMPT_SOURCES`] in order.
    pub prompt_tokens: [f64; 3],
    /// The conductor's own error of its cost models (`kvpool_conductor_prefill_cost_error_ratio`
    /// averaged over the prefill engines that have one, `..._decode_cost_error_ratio`).
    pub prefill_cost_error: Option<f64>,
    pub decode_cost_error: Option<f64>,
    /// The prefill cost the conductor fitted (`kvpool_conductor_prefill_cost_seconds{source=
    /// "fitted"}`), per [`PREFILL_TERMS`] entry averaged over the engines with a fit: what a
    /// simulation of the same engines takes as its prefill cost.
    pub prefill_cost_fitted: [Option<f64>; 3],
}

/// The terms of the conductor's prefill cost model, as its metrics label them.
pub const PREFILL_TERMS: [&str; 3] = ["fixed", "linear", "quadratic"];

/// vLLM's sources of prompt tokens: computed, its own prefix cache, loaded through the KV
/// connector (from the pool).
pub const PROMPT_SOURCES: [&str; 3] = ["local_compute", "local_cache_hit", "external_kv_transfer"];

/// The `/metrics` text of a child's admin server, when it answers 200.
async fn metrics_text(spec: &ChildSpec) -> Option<String> {
    kvpool_harness::http::get_async(spec.admin, "/metrics")
        .await
        .filter(|r| r.status == 200)
        .map(|r| r.body)
}

pub(super) async fn engine_kv(specs: &[ChildSpec]) -> EngineKv {
    let mut kv = EngineKv::default();
    for spec in specs
        .iter()
        .filter(|s| matches!(s.role, Role::Prefill | Role::Decode))
    {
        let Some(text) = metrics_text(spec).await else {
            continue;
        };
        kv.read_bytes += metric_sum(&text, "kvpool_engine_kv_read_bytes_total");
        kv.written_bytes += metric_sum(&text, "kvpool_engine_kv_written_bytes_total");
        kv.block_hits += metric_sum(&text, "kvpool_engine_kv_block_hits_total");
        kv.block_misses += metric_sum(&text, "kvpool_engine_kv_block_misses_total");
        kv.verify_failures += metric_sum(&text, "kvpool_engine_kv_verify_failures_total");
        kv.errors += metric_sum(&text, "kvpool_engine_kv_errors_total");
        for (i, op) in TIMED.iter().enumerate().take(4) {
            kv.timed_s[i] += metric_sum_labelled(&text, "kvpool_engine_kv_seconds_sum", "op", op);
            kv.timed_n[i] += metric_sum_labelled(&text, "kvpool_engine_kv_seconds_count", "op", op);
        }
        for (i, source) in PROMPT_SOURCES.iter().enumerate() {
            kv.prompt_tokens[i] += metric_sum_labelled(
                &text,
                "vllm:prompt_tokens_by_source_total",
                "source",
                source,
            );
        }
        kv.timed_s[4] += metric_sum(&text, "kvpool_engine_prefill_queue_seconds_sum");
        kv.timed_n[4] += metric_sum(&text, "kvpool_engine_prefill_queue_seconds_count");
    }
    if let Some(spec) = specs.iter().find(|s| s.role == Role::Conductor)
        && let Some(text) = metrics_text(spec).await
    {
        kv.timed_s[5] += metric_sum(&text, "kvpool_conductor_pool_lookup_seconds_sum");
        kv.timed_n[5] += metric_sum(&text, "kvpool_conductor_pool_lookup_seconds_count");
        for (i, kind) in ["stored", "removed"].iter().enumerate() {
            kv.kv_events[i] =
                metric_sum_labelled(&text, "kvpool_conductor_kv_events_total", "kind", kind);
        }
        kv.kv_events[2] = metric_sum(&text, "kvpool_conductor_kv_event_gaps_total");
        kv.prefill_cost_error = metric_mean(&text, "kvpool_conductor_prefill_cost_error_ratio");
        kv.decode_cost_error = metric_mean(&text, "kvpool_conductor_decode_cost_error_ratio");
        for (i, term) in PREFILL_TERMS.iter().enumerate() {
            let fitted: Vec<f64> = kvpool_harness::scrape::samples(&text)
                .filter(|s| {
                    s.name == "kvpool_conductor_prefill_cost_seconds"
                        && s.label("term") == Some(term)
                        && s.label("source") == Some("fitted")
                })
                .map(|s| s.value)
                .collect();
            kv.prefill_cost_fitted[i] = super::stats::mean(&fitted);
        }
        kv.fetch_bandwidth_bps = kvpool_harness::scrape::samples(&text)
            .any(|s| s.name == "kvpool_conductor_pool_fetch_bandwidth_bytes_per_second")
            .then(|| {
                metric_sum(
                    &text,
                    "kvpool_conductor_pool_fetch_bandwidth_bytes_per_second",
                )
            });
    }
    kv
}

/// The mean of a metric's samples (over its label sets); `None` when it has none.
fn metric_mean(text: &str, name: &str) -> Option<f64> {
    let v: Vec<f64> = kvpool_harness::scrape::samples(text)
        .filter(|s| s.name == name)
        .map(|s| s.value)
        .collect();
    super::stats::mean(&v)
}

pub(super) async fn pool_stats(
    master: &str,
    key_file: &Path,
    tls: kvpool_client::master::MasterTls,
) -> Option<Value> {
    let key = kvpool_proto::auth::AuthKey::from_file(key_file).ok()?;
    let config = kvpool_client::master::ClientConfig {
        tls,
        ..kvpool_client::master::ClientConfig::default()
    };
    let client =
        kvpool_client::master::MasterClient::new(vec![master.to_owned()], key, config).ok()?;
    let s = client.stats().await.ok()?;
    Some(json!({
        "objects": s.objects,
        "used_bytes": s.used_bytes.iter().sum::<u64>(),
        "capacity_bytes": s.capacity_bytes.iter().sum::<u64>(),
        "nodes_alive": s.nodes_alive,
        "segments": s.segments,
    }))
}

/// The summary printed after a replay; `policy`: the conductor's placement policy.
pub fn summary_json(
    stats: &ReplayStats,
    speed: f64,
    policy: &str,
    kv: &EngineKv,
    pool: Option<Value>,
    clean: bool,
) -> Value {
    let lookups = kv.block_hits + kv.block_misses;
    json!({
        "policy": policy,
        "requests": stats.requests,
        "served": stats.served,
        "rejected": stats.rejected,
        "failed": stats.failed,
        "generated_tokens": stats.generated_tokens,
        "wall_s": stats.wall_s,
        "speed": speed,
        "ttft_ms": stats.ttft_ms,
        "tpot_ms": stats.tpot_ms,
        "ttft_prediction": stats.ttft_prediction,
        "conductor_cost_error_ratio": {
            "prefill": kv.prefill_cost_error,
            "decode": kv.decode_cost_error,
        },
        "conductor_prefill_cost_fitted_s": {
            "fixed": kv.prefill_cost_fitted[0],
            "linear": kv.prefill_cost_fitted[1],
            "quadratic": kv.prefill_cost_fitted[2],
        },
        "engines": {
            "kv_read_bytes": kv.read_bytes,
            "kv_written_bytes": kv.written_bytes,
            "kv_block_hits": kv.block_hits,
            "kv_block_misses": kv.block_misses,
            "kv_verify_failures": kv.verify_failures,
            "kv_errors": kv.errors,
            "pool_hit_ratio": (lookups > 0.0).then(|| kv.block_hits / lookups),
            "prompt_tokens": {
                "computed": kv.prompt_tokens[0],
                "engine_cache": kv.prompt_tokens[1],
                "pool": kv.prompt_tokens[2],
            },
        },
        "timing": timing_json(kv),
        "conductor_kv_events": {
            "blocks_stored": kv.kv_events[0],
            "blocks_removed": kv.kv_events[1],
            "sequence_gaps": kv.kv_events[2],
        },
        "pool": pool,
        "clean_shutdown": clean,
    })
}

/// Per timed operation, its count and mean wall milliseconds (null mean when none ran).
fn timing_json(kv: &EngineKv) -> Value {
    let mut ops = serde_json::Map::new();
    for (i, op) in TIMED.iter().enumerate() {
        let (sum, n) = (kv.timed_s[i], kv.timed_n[i]);
        ops.insert(
            (*op).to_owned(),
            json!({"count": n, "mean_ms": (n > 0.0).then(|| sum / n * 1e3)}),
        );
    }
    ops.insert(
        "conductor_fetch_bandwidth_bytes_per_s".into(),
        json!(kv.fetch_bandwidth_bps),
    );
    Value::Object(ops)
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.1} ms"))
}

/// A row of latency statistics, `-` for a missing one.
fn quantiles(q: Quantiles) -> String {
    format!(
        "mean {}  p50 {}  p90 {}  p99 {}  (wall clock)",
        ms(q.mean),
        ms(q.p50),
        ms(q.p90),
        ms(q.p99)
    )
}

/// The conductor's TTFT prediction against what was observed, `-` for a missing figure.
fn prediction(p: &Prediction) -> String {
    let ratio = |r: Option<f64>, f: &dyn Fn(f64) -> String| r.map_or_else(|| "-".into(), f);
    format!(
        "TTFT median {} vs {} observed (x{}), median error {} over {} requests",
        ms(p.median_predicted_ms),
        ms(p.median_observed_ms),
        ratio(p.median_ratio, &|r| format!("{r:.2}")),
        ratio(p.median_abs_error_ratio, &|r| format!("{:.0}%", r * 100.0)),
        p.requests
    )
}

pub(super) fn print_summary(v: &Value, stats: &ReplayStats, kv: &EngineKv) {
    print!("{}", summary_table(v, stats, kv));
}

/// The replay's summary for people: one row per subject, labels aligned.
pub fn summary_table(v: &Value, stats: &ReplayStats, kv: &EngineKv) -> String {
    let bytes = |b: f64| {
        bytesize::ByteSize::b(b.max(0.0) as u64)
            .display()
            .iec()
            .to_string()
    };
    let mut rows = vec![
        (
            "requests",
            format!(
                "{} in {:.1} s at x{}, policy {}: {} served, {} rejected, {} failed",
                stats.requests,
                stats.wall_s,
                v["speed"],
                v["policy"].as_str().unwrap_or("-"),
                stats.served,
                stats.rejected,
                stats.failed
            ),
        ),
        ("TTFT", quantiles(stats.ttft_ms)),
        ("TPOT", quantiles(stats.tpot_ms)),
    ];
    if stats.ttft_prediction.requests > 0 {
        rows.push(("predicted", prediction(&stats.ttft_prediction)));
    }
    // Synthetic engines count their own KV traffic; real engines count prompt tokens by source.
    if kv.prompt_tokens.iter().all(|t| *t == 0.0) {
        rows.extend([
            (
                "KV moved",
                format!(
                    "{} written, {} read through the agents",
                    bytes(kv.written_bytes),
                    bytes(kv.read_bytes)
                ),
            ),
            (
                "pool blocks",
                format!(
                    "{:.0} hits, {:.0} misses, {:.0} verification failures",
                    kv.block_hits, kv.block_misses, kv.verify_failures
                ),
            ),
        ]);
    }
    if kv.prompt_tokens.iter().any(|t| *t > 0.0) {
        rows.push((
            "prompt tokens",
            format!(
                "{:.0} computed, {:.0} from engines' caches, {:.0} loaded from the pool",
                kv.prompt_tokens[0], kv.prompt_tokens[1], kv.prompt_tokens[2]
            ),
        ));
    }
    if v["pool"].is_object() {
        let num = |k: &str| v["pool"][k].as_f64().unwrap_or(0.0);
        rows.push((
            "master",
            format!(
                "{} objects, {} used of {}, {} nodes alive",
                v["pool"]["objects"],
                bytes(num("used_bytes")),
                bytes(num("capacity_bytes")),
                v["pool"]["nodes_alive"]
            ),
        ));
    }
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    let mut out = String::from("replay summary\n");
    for (k, val) in rows {
        out.push_str(&format!("  {k:<width$}  {val}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_aligns_its_rows_and_names_the_units() {
        let stats = ReplayStats {
            requests: 3,
            served: 2,
            rejected: 1,
            ttft_ms: Quantiles {
                p50: Some(12.0),
                ..Quantiles::default()
            },
            ttft_prediction: Prediction::of(&[(10.0, 12.0), (20.0, 16.0)]),
            wall_s: 1.5,
            ..ReplayStats::default()
        };
        let kv = EngineKv {
            written_bytes: 2.0 * 1024.0 * 1024.0,
            ..EngineKv::default()
        };
        let v = json!({"speed": 10.0, "policy": "random", "pool": {"objects": 4, "used_bytes": 1024.0,
            "capacity_bytes": 67108864.0, "nodes_alive": 2}});
        let t = summary_table(&v, &stats, &kv);
        let rows: Vec<&str> = t.lines().collect();
        assert_eq!(rows[0], "replay summary", "{t}");
        assert_eq!(rows.len(), 8, "{t}");
        assert!(
            rows[1].starts_with(
                "  requests     3 in 1.5 s at x10.0, policy random: 2 served, 1 rejected, 0 failed"
            ),
            "{t}"
        );
        assert!(
            t.contains("  TTFT         mean -  p50 12.0 ms  p90 -  p99 -  (wall clock)"),
            "{t}"
        );
        // Medians 10 and 20 -> 10 (nearest rank) predicted, 12 observed; errors 17% and 25%.
        assert!(
            t.contains(
                "  predicted    TTFT median 10.0 ms vs 12.0 ms observed (x0.83), median error \
                 17% over 2 requests"
            ),
            "{t}"
        );
        // Every value starts in the same column.
        let col = rows[1].find("3 in").unwrap_or(0);
        assert!(
            rows[1..]
                .iter()
                .all(|r| r.len() > col && &r[col - 2..col] == "  "),
            "{t}"
        );
        assert!(t.contains("2.0 MiB written"), "{t}");
        assert!(
            t.contains("4 objects, 1.0 KiB used of 64.0 MiB, 2 nodes alive"),
            "{t}"
        );
    }

    #[test]
    fn timing_has_a_mean_per_operation_that_ran() {
        let kv = EngineKv {
            timed_s: [0.0, 3.0, 0.0, 0.0, 0.0, 0.0],
            timed_n: [0.0, 4.0, 0.0, 0.0, 0.0, 0.0],
            ..EngineKv::default()
        };
        let t = timing_json(&kv);
        assert_eq!(t["read"]["mean_ms"], json!(750.0));
        assert_eq!(t["exists"]["mean_ms"], Value::Null);
    }

    #[test]
    fn summary_has_the_hit_ratio_when_there_were_lookups() {
        let stats = ReplayStats {
            requests: 2,
            served: 2,
            ..ReplayStats::default()
        };
        let kv = EngineKv {
            block_hits: 3.0,
            block_misses: 1.0,
            ..EngineKv::default()
        };
        let v = summary_json(&stats, 10.0, "conductor", &kv, None, true);
        assert_eq!(v["engines"]["pool_hit_ratio"], 0.75);
        assert!(v["pool"].is_null());
        let v = summary_json(&stats, 10.0, "conductor", &EngineKv::default(), None, false);
        assert!(v["engines"]["pool_hit_ratio"].is_null());
        assert_eq!(v["clean_shutdown"], false);
    }
}

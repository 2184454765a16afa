//! The text form of `kvpool bench engine`'s report. Pure: no I/O but stdout in [`print_text`].

use super::report::{ArmRun, EngineReport, NONE};

fn first_label(arm: &str) -> &'static str {
    if arm == NONE { "recompute" } else { "loaded" }
}

/// How the report names the engine.
fn engine_name(engine: &str) -> &str {
    match engine {
        "vllm" => "vLLM",
        "sglang" => "SGLang",
        other => other,
    }
}

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "NO" }
}

/// The text table.
pub fn render_text(r: &EngineReport) -> String {
    use std::fmt::Write as _;
    let w = &r.workload;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{} {} ({}), prefix {} + suffix {} tokens, block {}, {} rounds, {} OpenMP thread(s); \
         Mooncake {}; kvpool package: {}; stores' huge pages: {}; engines' THP: {}; kvpool loads: {}; load average {}",
        engine_name(&r.run.engine),
        r.run.version,
        w.model,
        w.prefix_tokens,
        w.suffix_tokens,
        w.block_size,
        w.repeats,
        w.omp_threads,
        r.run.mooncake.as_deref().unwrap_or("-"),
        w.kvpool_package,
        w.store_hugepages,
        w.engine_thp,
        w.kvpool_loads,
        w.load_average
    );
    let _ = writeln!(
        s,
        "{:<14} {:>10} {:>16} {:>8} {:>15} {:>8} {:>9} {:>6} {:>10} {:>10}",
        "arm",
        "1st req",
        "TTFT p50 ms",
        "p90",
        "hit p50 ms",
        "p90",
        "from store",
        "ids",
        "out tok/s",
        "mean TTFT"
    );
    for (a, c) in r.run.arms.iter().zip(&r.checks) {
        let (tps, mttft) = a
            .throughput
            .as_ref()
            .map(|t| {
                (
                    format!("{:.1}", t.output_tok_per_s),
                    format!("{:.0}", t.mean_ttft_ms),
                )
            })
            .unwrap_or(("-".into(), "-".into()));
        let _ = writeln!(
            s,
            "{:<14} {:>10} {:>16.1} {:>8.1} {:>15.1} {:>8.1} {:>9} {:>6} {:>10} {:>10}",
            a.arm,
            first_label(&a.arm),
            a.loaded.median_ms,
            a.loaded.p90_ms,
            a.hit.median_ms,
            a.hit.p90_ms,
            c.min_external_tokens,
            yes(c.ids_equal),
            tps,
            mttft
        );
    }
    let mut groups: Vec<&ArmRun> = Vec::new();
    for a in &r.run.arms {
        if !groups.iter().any(|g| g.group == a.group) {
            groups.push(a);
        }
    }
    for g in groups {
        let _ = writeln!(
            s,
            "engines of {} at once: started in {:.0} s, load average {}",
            g.group.join(", "),
            g.startup_s,
            g.load_average
        );
    }
    let warm: Vec<String> = r
        .run
        .arms
        .iter()
        .filter_map(|a| Some(format!("{} {:.1}", a.arm, a.warm.as_ref()?.median_ms)))
        .collect();
    if !warm.is_empty() {
        let _ = writeln!(
            s,
            "warm request before each first request (TTFT p50 ms): {}",
            warm.join(", ")
        );
    }
    let thp = r
        .run
        .arms
        .iter()
        .map(|a| (a.arm.as_str(), a.reader_thp_mib));
    if let Some(line) = super::pages::thp_line(thp, r.workload.engine_thp) {
        let _ = writeln!(s, "{line}");
    }
    let fmt = |v: &[(String, f64)]| {
        v.iter()
            .map(|(a, x)| format!("{a} {x:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let q = &r.ratios;
    let _ = writeln!(
        s,
        "loaded TTFT / the engine's own prefix-cache hit (no store): {}",
        fmt(&q.loaded_over_none_hit)
    );
    let _ = writeln!(
        s,
        "loaded TTFT / the same engine's prefix-cache hit:   {}",
        fmt(&q.loaded_over_own_hit)
    );
    let _ = writeln!(
        s,
        "loaded TTFT / recompute TTFT:                       {}",
        fmt(&q.loaded_over_recompute)
    );
    if let Some(after) = r.run.arms.iter().find(|a| a.idle_hit.is_some()) {
        let _ = writeln!(
            s,
            "loaded TTFT / prefix-cache hit after {:.1} s idle:  {}",
            after.idle_hit_after_s,
            fmt(&q.loaded_over_idle_hit)
        );
    }
    for t in &q.targets {
        let _ = writeln!(
            s,
            "{}: loaded TTFT / {}'s prefix-cache hit {:.2} (target <= 1.2: {}); / Mooncake's \
             loaded TTFT {} (target <= 1: {})",
            t.arm,
            t.reference,
            t.over_prefix_hit,
            yes(t.vs_prefix_hit),
            t.over_mooncake
                .map(|x| format!("{x:.2}"))
                .unwrap_or_else(|| "-".into()),
            t.vs_mooncake.map(yes).unwrap_or("not measured")
        );
    }
    for c in &r.checks {
        let _ = writeln!(
            s,
            "{}: prompt tokens from the store {}, prefix-cache hits {}, greedy ids equal {}{}",
            c.arm,
            yes(c.loaded_from_store),
            yes(c.hit_from_cache),
            yes(c.ids_equal),
            if c.notes.is_empty() {
                String::new()
            } else {
                format!(" ({})", c.notes.join("; "))
            }
        );
    }
    let _ = writeln!(s, "all verified: {}", yes(r.all_verified));
    if let Some(row) = &r.idle_memory {
        let _ = writeln!(s, "{}", crate::idle_memory::note(row));
    }
    s
}

/// Prints [`render_text`].
pub fn print_text(r: &EngineReport) {
    print!("{}", render_text(r));
}

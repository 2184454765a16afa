//! The data plane's dashboards and rules, and the metrics reference, against real processes:
//! `kvpool up` (master, two agents in pool mode, two prefill and two decode synthetic engines,
//! the conductor) on 127.0.0.1, scraped every second by a real Prometheus (Debian's
//! `prometheus`) that also evaluates the chart's data-plane rule file, while completions go
//! through the conductor. Then:
//!
//! 1. every query of every data-plane dashboard (panel targets and template variables, with
//!    Grafana's `$__rate_interval`, `$__interval`, `$cluster`, `$namespace` and `$pool` substituted) must
//!    return at least one series;
//! 2. every recording rule's expression, and the series it records, must return one;
//! 3. every alert's expression without its threshold comparisons (`> 0.144`, `< 1`...) must
//!    return one. A misspelled metric or label, a label a `by` clause dropped that an `and`
//!    needs, or a function over the wrong type returns nothing; what is left out is only the
//!    threshold, whose firing `promtool test rules` covers (charts/kvpool/ci/
//!    data-plane-alerts-test.yaml, run by tests/packaging.rs);
//! 4. every metric family any of these processes (and the operator's registry) exports is listed
//!    in docs/observability.md's reference, and every metric listed there is either exported
//!    here or registered by the code (named as a string literal in the sources: families whose
//!    series appear only once an event labels them, and the operator's).
//!
//! With `KVPOOL_DASHBOARD_DATA=<file>` set (scripts/render-dashboard.sh does), the load goes on
//! for `KVPOOL_DASHBOARD_LOAD_S` seconds (default 60) and every panel of the pool dashboard is
//! written to that file as range-query results, for scripts/render-dashboard.py to plot.
//!
//! I/O boundary: child processes, loopback sockets, temp dirs, the repository's files.

mod pool_support;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kvpool_harness::http::request;
use kvpool_harness::{Launcher, PrometheusServer, ScrapeTarget};
use serde::Deserialize;
use serde_json::Value;

const KVPOOL: &str = env!("CARGO_BIN_EXE_kvpool");
/// Bound on every wait; only a hang reaches it on a loaded 2-core box.
const WAIT: Duration = Duration::from_secs(120);
const POLL: Duration = Duration::from_millis(250);
/// The data plane's dashboards and rule file, as the chart ships them.
const DASHBOARDS: [&str; 3] = [
    "charts/kvpool/files/dashboards/kvpool-pool.json",
    "charts/kvpool/files/dashboards/kvpool-conductor.json",
    "charts/kvpool/files/dashboards/kvpool-nodes.json",
];
const RULES: &str = "charts/kvpool/files/rules/data-plane.yaml";
const REFERENCE: &str = "docs/observability.md";

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo(rel)).unwrap_or_else(|e| panic!("cannot read {rel}: {e}"))
}

/// One expression to evaluate and where it comes from.
struct Query {
    origin: String,
    promql: String,
}

/// Grafana's variables as a whole-cluster view of this one pool has them: every cluster,
/// namespace and pool (a series without those labels, as here where no `cluster` label is
/// added, matches `.*`), a rate window of several scrapes.
fn grafana(expr: &str) -> String {
    expr.replace("$__rate_interval", "20s")
        .replace("$__interval", "5s")
        .replace("$cluster", ".*")
        .replace("$namespace", ".*")
        .replace("$pool", ".*")
}

/// The selector a `label_values(selector, label)` variable query reads.
fn label_values_selector(query: &str) -> Option<&str> {
    let inner = query
        .trim()
        .strip_prefix("label_values(")?
        .strip_suffix(')')?;
    Some(inner.rsplit_once(',')?.0.trim())
}

/// Every query of the data-plane dashboards.
fn dashboard_queries() -> Vec<Query> {
    let mut out = Vec::new();
    for file in DASHBOARDS {
        let board: Value = serde_json::from_str(&read(file)).expect("dashboard is JSON");
        for variable in board["templating"]["list"].as_array().into_iter().flatten() {
            if let Some(q) = variable["query"]["query"].as_str() {
                let selector = label_values_selector(q)
                    .unwrap_or_else(|| panic!("{file}: variable query {q} is not label_values"));
                out.push(Query {
                    origin: format!("{file}: variable {}", variable["name"]),
                    promql: grafana(selector),
                });
            }
        }
        let panels = board["panels"].as_array().expect("panels");
        assert!(!panels.is_empty(), "{file} has no panels");
        for panel in panels {
            let targets = panel["targets"].as_array().expect("targets");
            assert!(
                !targets.is_empty(),
                "{file}: panel {} has no query",
                panel["title"]
            );
            for target in targets {
                let expr = target["expr"].as_str().expect("expr");
                out.push(Query {
                    origin: format!("{file}: panel {} {}", panel["title"], target["refId"]),
                    promql: grafana(expr),
                });
            }
        }
    }
    out
}

#[derive(Deserialize)]
struct RuleFile {
    groups: Vec<RuleGroup>,
}

#[derive(Deserialize)]
struct RuleGroup {
    rules: Vec<Rule>,
}

#[derive(Deserialize)]
struct Rule {
    alert: Option<String>,
    record: Option<String>,
    expr: String,
}

/// `expr` without its comparisons against number literals (`> 0.144`, `<1`, `== 0`): the
/// thresholds of an alert. Label matchers (`!="x"`, `=~`) are left alone.
fn without_thresholds(expr: &str) -> String {
    let mut out = String::new();
    let mut rest = expr;
    'scan: while !rest.is_empty() {
        for op in [">=", "<=", "==", "!=", ">", "<"] {
            if let Some(after) = rest.strip_prefix(op) {
                let trimmed = after.trim_start();
                let number: String = trimmed
                    .chars()
                    .take_while(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '+' | '-'))
                    .collect();
                if number.parse::<f64>().is_ok() {
                    out.truncate(out.trim_end().len());
                    rest = &trimmed[number.len()..];
                    continue 'scan;
                }
            }
        }
        let mut chars = rest.chars();
        if let Some(c) = chars.next() {
            out.push(c);
        }
        rest = chars.as_str();
    }
    out
}

/// Every expression of the rule file: recording rules as they are (and the series each
/// records), alerts without their thresholds.
fn rule_queries() -> Vec<Query> {
    let file: RuleFile = serde_saphyr::from_str(&read(RULES)).expect("rule file parses");
    let mut out = Vec::new();
    for rule in file.groups.iter().flat_map(|g| &g.rules) {
        match (&rule.record, &rule.alert) {
            (Some(record), None) => {
                out.push(Query {
                    origin: format!("{RULES}: recording rule {record}"),
                    promql: rule.expr.clone(),
                });
                out.push(Query {
                    origin: format!("{RULES}: series recorded by {record}"),
                    promql: record.clone(),
                });
            }
            (None, Some(alert)) => {
                let stripped = without_thresholds(&rule.expr);
                assert_ne!(stripped, rule.expr, "{alert} has no threshold to leave out");
                out.push(Query {
                    origin: format!("{RULES}: alert {alert} without its threshold"),
                    promql: stripped,
                });
            }
            _ => panic!(
                "{RULES}: a rule must be either recording or alerting: {}",
                rule.expr
            ),
        }
    }
    out
}

/// Metric names in the reference section of docs/observability.md: the first cell of each
/// table row there, when it is one backticked name.
fn documented_metrics() -> BTreeSet<String> {
    let doc = read(REFERENCE);
    let section = doc
        .split_once("## Metrics reference")
        .map(|(_, s)| s)
        .unwrap_or_else(|| panic!("{REFERENCE} has no \"## Metrics reference\" section"));
    let section = section.split("\n## ").next().unwrap_or(section);
    section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once('`').map(|(name, _)| name.to_owned()))
        .filter(|n| n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .collect()
}

/// Family names (`# TYPE` lines) of a Prometheus text exposition.
fn families(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// The operator's families (it is not part of `kvpool up`), with its labelled series used
/// once so that they appear.
fn operator_families() -> BTreeSet<String> {
    let registry = prometheus::Registry::new();
    let metrics = kvpool_operator::metrics::Metrics::register(&registry).expect("register");
    drop(metrics.start("KVCachePool"));
    metrics.finished("KVCachePool", "ok");
    metrics.failed("KVCachePool", "apply");
    metrics.set_leader(true);
    metrics.set_transport_degraded("ns", "pool", 0);
    let text = prometheus::TextEncoder::new()
        .encode_to_string(&registry.gather())
        .expect("encode");
    families(&text)
}

/// Every `.rs` file's text under the given folders.
fn sources(dirs: &[&str]) -> String {
    let mut text = String::new();
    let mut stack: Vec<PathBuf> = dirs.iter().map(|d| repo(d)).collect();
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            // Not through symbolic links: the agents' sysfs fixtures link in circles.
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if kind.is_dir() {
                stack.push(path);
            } else if kind.is_file() && path.extension().is_some_and(|e| e == "rs") {
                text.push_str(&std::fs::read_to_string(&path).unwrap_or_default());
            }
        }
    }
    text
}

/// `kvpool up` with two agents, two prefill and two decode engines on the agents' fixture
/// machine, 16-token blocks so that short prompts span several.
fn up(dir: &Path) -> Command {
    let fixture = pool_support::sysfs_fixture();
    let mut cmd = Command::new(KVPOOL);
    cmd.arg("up")
        .args(["--agents", "2", "--prefill", "2", "--decode", "2"])
        .args(["--block-size", "16", "--json"])
        .arg("--agent-sysfs-root")
        .arg(fixture.join("sys"))
        .arg("--agent-procfs-root")
        .arg(fixture.join("proc"))
        .arg("--dir")
        .arg(dir);
    cmd
}

/// `host:port` of an `http://host:port` URL.
fn socket(url: &str) -> SocketAddr {
    url.trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .unwrap_or_else(|e| panic!("{url}: {e}"))
}

/// Completions through the conductor: prompts that share prefixes (pool and cache hits), some
/// streamed with several tokens (time per output token); `round` varies a quarter of them.
fn load(conductor: SocketAddr, round: usize) {
    let shared =
        "the pool keeps every block of this shared system prompt for later requests ".repeat(4);
    for i in 0..16 {
        let question = if i % 4 == 3 { round * 16 + i } else { i % 4 };
        let stream = i % 2 == 0;
        let body = serde_json::json!({
            "model": "kvpool-synthetic",
            "prompt": format!("{shared} question {question} of the observability test"),
            "max_tokens": 8,
            "stream": stream,
        });
        let reply = request(conductor, "POST", "/v1/completions", &body.to_string())
            .expect("the conductor answers");
        assert_eq!(reply.status, 200, "completion {i}: {}", reply.body);
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Every panel of dashboard `file` with the range-query results of its targets since `start`,
/// as JSON in `out` (what scripts/render-dashboard.py plots).
fn write_panels(prom: &PrometheusServer, file: &str, start: f64, out: &Path) {
    let board: Value = serde_json::from_str(&read(file)).expect("dashboard is JSON");
    let end = unix_now();
    let mut panels = Vec::new();
    for panel in board["panels"].as_array().into_iter().flatten() {
        let mut targets = Vec::new();
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = grafana(target["expr"].as_str().unwrap_or_default());
            let series = prom
                .query_range(&expr, start, end, 2.0)
                .unwrap_or_else(|e| panic!("range query {expr}: {e}"));
            targets.push(serde_json::json!({
                "legendFormat": target["legendFormat"], "expr": expr, "series": series,
            }));
        }
        panels.push(serde_json::json!({
            "title": panel["title"], "type": panel["type"], "gridPos": panel["gridPos"],
            "unit": panel["fieldConfig"]["defaults"]["unit"], "targets": targets,
        }));
    }
    let doc =
        serde_json::json!({"title": board["title"], "start": start, "end": end, "panels": panels});
    std::fs::write(out, serde_json::to_string_pretty(&doc).expect("json"))
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", out.display()));
}

/// Polls `check` until it returns true or [`WAIT`] passes.
fn wait_until(check: impl FnMut() -> bool) -> bool {
    kvpool_harness::poll::until(WAIT, POLL, check)
}

#[test]
fn dashboards_rules_and_metrics_reference_hold_against_a_running_pool() {
    PrometheusServer::binary().unwrap_or_else(|e| {
        panic!("FAIL: {e}; install the test dependencies with scripts/deps.sh")
    });
    // Parse everything first: a broken file fails before any process starts.
    let mut queries = dashboard_queries();
    queries.extend(rule_queries());
    let documented = documented_metrics();
    assert!(
        documented.len() > 50,
        "{REFERENCE} lists only {documented:?}"
    );

    let dir = tempfile::tempdir().expect("temp dir");
    let up_dir = dir.path().join("up");
    let mut pool = Launcher::new(dir.path())
        .pipe_stdout()
        .spawn("up", &mut up(&up_dir))
        .expect("spawn kvpool up");
    // Kept open to the end: `up` must not write into a closed pipe.
    let mut stdout = BufReader::new(pool.take_stdout().expect("piped stdout"));
    let mut ready = String::new();
    stdout.read_line(&mut ready).expect("read the ready line");
    assert!(
        !ready.is_empty(),
        "kvpool up printed nothing; log:\n{}",
        pool.log_text()
    );
    let ready: Value = serde_json::from_str(&ready).expect("the ready line is JSON");
    assert_eq!(ready["ready"], true, "{ready}");
    let conductor = socket(ready["conductor"].as_str().expect("conductor"));
    let children: Vec<(String, SocketAddr)> = ready["children"]
        .as_array()
        .expect("children")
        .iter()
        .map(|c| {
            let name = c["name"].as_str().expect("name").to_owned();
            (name, socket(c["admin"].as_str().expect("admin")))
        })
        .collect();
    // master, 2 agents, 2 prefill and 2 decode engines, the conductor.
    assert_eq!(children.len(), 8, "{ready}");

    let scrape: Vec<ScrapeTarget> = children
        .iter()
        .map(|(name, admin)| ScrapeTarget {
            job: format!("kvpool-{name}"),
            addr: *admin,
        })
        .collect();
    let prometheus_dir = dir.path().join("prometheus");
    std::fs::create_dir_all(&prometheus_dir).expect("prometheus dir");
    let prom = PrometheusServer::start_with_rules(&prometheus_dir, &scrape, &[repo(RULES)])
        .expect("prometheus");

    let started = unix_now();
    let render = std::env::var_os("KVPOOL_DASHBOARD_DATA").map(PathBuf::from);
    let load_for = Duration::from_secs(
        std::env::var("KVPOOL_DASHBOARD_LOAD_S")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(60),
    );
    let mut round = 0;
    load(conductor, round);
    while render.is_some() && unix_now() - started < load_for.as_secs_f64() {
        round += 1;
        load(conductor, round);
    }

    // Prometheus has scraped the load (and evaluated the rules over it) when the served
    // requests' SLO counters and the master's lookups are in, and the recorded miss ratio is.
    let settled = [
        r#"sum(kvpool_conductor_slo_requests_total{objective="ttft"})"#,
        r#"sum(kvpool_master_lookup_keys_total{result="hit"})"#,
        r#"count(kvpool:conductor_slo_miss:ratio_rate5m)"#,
    ];
    let mut missing: Vec<&str> = settled.to_vec();
    let seen = wait_until(|| {
        missing.retain(|q| prom.query(q).is_none_or(|v| v < 1.0));
        missing.is_empty()
    });
    assert!(
        seen,
        "within {WAIT:?} Prometheus did not report >= 1 for {missing:?}; log:\n{}",
        prom.process.log_text()
    );
    // A few more scrapes, so that every rate window holds samples from after the load.
    std::thread::sleep(Duration::from_secs(3));

    let mut empty = Vec::new();
    for q in &queries {
        match prom.query_series(&q.promql) {
            Ok(series) if !series.is_empty() => {}
            Ok(_) => empty.push(format!("{}: no series for {}", q.origin, q.promql)),
            Err(e) => empty.push(format!("{}: {e} for {}", q.origin, q.promql)),
        }
    }
    assert!(
        empty.is_empty(),
        "{} of {} expressions return nothing:\n{}",
        empty.len(),
        queries.len(),
        empty.join("\n")
    );

    if let Some(out) = &render {
        write_panels(&prom, DASHBOARDS[0], started, out);
    }

    // The reference lists what runs, and nothing that does not exist.
    let mut exported = operator_families();
    for (name, admin) in &children {
        let reply = request(*admin, "GET", "/metrics", "").expect("metrics answers");
        assert_eq!(reply.status, 200, "{name} /metrics");
        exported.extend(families(&reply.body));
    }
    let undocumented: Vec<&String> = exported.difference(&documented).collect();
    assert!(
        undocumented.is_empty(),
        "exported but not in {REFERENCE}'s \"Metrics reference\": {undocumented:?}"
    );
    let code = sources(&["crates", "agent", "operator", "src"]);
    let unknown: Vec<&String> = documented
        .difference(&exported)
        .filter(|name| !code.contains(&format!("\"{name}\"")))
        .collect();
    assert!(
        unknown.is_empty(),
        "in {REFERENCE}'s \"Metrics reference\" but neither exported nor registered: {unknown:?}"
    );

    let status = pool.terminate(WAIT).expect("kvpool up exits after SIGTERM");
    assert!(
        status.success(),
        "kvpool up: {status}; log:\n{}",
        pool.log_text()
    );
    drop(stdout);
}

#[test]
fn thresholds_are_left_out_but_label_matchers_stay() {
    assert_eq!(
        without_thresholds(r#"a{x!="1"} > 0.144 and b{y=~"2"} >= 1e-3"#),
        r#"a{x!="1"} and b{y=~"2"}"#
    );
    assert_eq!(without_thresholds("sum(x) < 1"), "sum(x)");
    assert_eq!(without_thresholds("sum(x) > bool y"), "sum(x) > bool y");
    assert_eq!(
        label_values_selector(r#"label_values(kvpool_build_info{namespace=~"$namespace"}, pool)"#),
        Some(r#"kvpool_build_info{namespace=~"$namespace"}"#)
    );
}

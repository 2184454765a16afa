//! A throw-away Prometheus (Debian's `prometheus`) on a free loopback port that scrapes given
//! admin endpoints every second, and instant PromQL queries against it. I/O boundary: the
//! `prometheus` child process, its config file, TSDB directory and log, its HTTP API.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::error::HarnessError;
use crate::http;
use crate::ports::free_addr;
use crate::probe::Probe;
use crate::process::{ChildProcess, Launcher};

/// How long Prometheus gets to listen.
const START_TIMEOUT: Duration = Duration::from_secs(45);

/// One scrape job: a job name and the admin address whose `/metrics` it scrapes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScrapeTarget {
    pub job: String,
    pub addr: SocketAddr,
}

/// A Prometheus with its config, data and log under one directory; killed on drop.
#[derive(Debug)]
pub struct PrometheusServer {
    pub process: ChildProcess,
    pub addr: SocketAddr,
}

/// `prometheus.yml` scraping every target each second.
pub fn scrape_config(targets: &[ScrapeTarget]) -> String {
    scrape_config_with_rules(targets, &[])
}

/// `prometheus.yml` scraping every target each second and evaluating the rule files `rules`
/// (recording and alerting rules) each second.
pub fn scrape_config_with_rules(targets: &[ScrapeTarget], rules: &[PathBuf]) -> String {
    let mut config = String::from("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n");
    if !rules.is_empty() {
        config.push_str("rule_files:\n");
        for r in rules {
            let _ = writeln!(config, "  - '{}'", r.display());
        }
    }
    config.push_str("scrape_configs:\n");
    for t in targets {
        let _ = write!(
            config,
            "  - job_name: {job}\n    scrape_interval: 1s\n    scrape_timeout: 1s\n    \
             static_configs:\n      - targets: ['{addr}']\n",
            job = t.job,
            addr = t.addr
        );
    }
    config
}

/// Percent-encodes a query-string value.
fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

impl PrometheusServer {
    /// The `prometheus` binary on the PATH.
    pub fn binary() -> Result<PathBuf, HarnessError> {
        std::env::var_os("PATH")
            .iter()
            .flat_map(std::env::split_paths)
            .map(|d| d.join("prometheus"))
            .find(|p| p.is_file())
            .ok_or(HarnessError::Missing {
                binary: "prometheus",
                package: "prometheus",
            })
    }

    /// Writes `<dir>/prometheus.yml` for `targets`, starts Prometheus (TSDB in `<dir>/tsdb`,
    /// log in `<dir>/prometheus.log`) and waits until it listens.
    pub fn start(dir: &Path, targets: &[ScrapeTarget]) -> Result<Self, HarnessError> {
        Self::start_with_rules(dir, targets, &[])
    }

    /// [`Self::start`], also evaluating the rule files `rules` every second.
    pub fn start_with_rules(
        dir: &Path,
        targets: &[ScrapeTarget],
        rules: &[PathBuf],
    ) -> Result<Self, HarnessError> {
        let binary = Self::binary()?;
        let config = dir.join("prometheus.yml");
        let text = scrape_config_with_rules(targets, rules);
        std::fs::write(&config, text).map_err(|source| HarnessError::Write {
            path: config.clone(),
            source,
        })?;
        let addr = free_addr()?;
        let mut process = Launcher::new(dir).spawn(
            "prometheus",
            Command::new(binary)
                .arg(format!("--config.file={}", config.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.join("tsdb").display()
                ))
                .arg(format!("--web.listen-address={addr}")),
        )?;
        process.wait_ready(&Probe::Tcp(addr), START_TIMEOUT)?;
        Ok(Self { process, addr })
    }

    /// The series an instant PromQL query returns (`data.result` of a vector answer; a scalar
    /// counts as one series), or Prometheus's error (a query that does not parse, or no
    /// answer).
    pub fn query_series(&self, promql: &str) -> Result<Vec<serde_json::Value>, String> {
        let reply = http::get(
            self.addr,
            &format!("/api/v1/query?query={}", encode(promql)),
        )
        .ok_or_else(|| "Prometheus did not answer".to_owned())?;
        let v: serde_json::Value = serde_json::from_str(&reply.body)
            .map_err(|e| format!("HTTP {}: not JSON ({e}): {}", reply.status, reply.body))?;
        if reply.status != 200 {
            return Err(format!("HTTP {}: {}", reply.status, v["error"]));
        }
        match &v["data"]["result"] {
            serde_json::Value::Array(series) if v["data"]["resultType"] != "scalar" => {
                Ok(series.clone())
            }
            other => Ok(vec![other.clone()]),
        }
    }

    /// The series of a range query from `start` to `end` (Unix seconds) every `step_s`
    /// seconds: `data.result` of the matrix answer, or Prometheus's error.
    pub fn query_range(
        &self,
        promql: &str,
        start: f64,
        end: f64,
        step_s: f64,
    ) -> Result<Vec<serde_json::Value>, String> {
        let target = format!(
            "/api/v1/query_range?query={}&start={start:.3}&end={end:.3}&step={step_s}",
            encode(promql)
        );
        let reply =
            http::get(self.addr, &target).ok_or_else(|| "Prometheus did not answer".to_owned())?;
        let v: serde_json::Value = serde_json::from_str(&reply.body)
            .map_err(|e| format!("HTTP {}: not JSON ({e}): {}", reply.status, reply.body))?;
        if reply.status != 200 {
            return Err(format!("HTTP {}: {}", reply.status, v["error"]));
        }
        Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
    }

    /// The value of an instant PromQL query with a single-sample answer, if any.
    pub fn query(&self, promql: &str) -> Option<f64> {
        let reply = http::get(
            self.addr,
            &format!("/api/v1/query?query={}", encode(promql)),
        )?;
        if reply.status != 200 {
            return None;
        }
        let v: serde_json::Value = serde_json::from_str(&reply.body).ok()?;
        v["data"]["result"].get(0)?["value"]
            .get(1)?
            .as_str()?
            .parse()
            .ok()
    }
}

//! The metrics every kvpool process exports whatever its role, in one place: the admin server
//! (`router` in admin.rs) serves them next to the process's own registry, so no binary
//! registers them itself. `kvpool_build_info{version, git_sha, features}` (always 1) and the
//! prometheus crate's process collector (`process_cpu_seconds_total`,
//! `process_resident_memory_bytes`, `process_open_fds`, ...; Linux only). I/O boundary:
//! `/proc/self` read at scrape time by the process collector.

use prometheus::{IntGaugeVec, Opts, Registry};

/// The workspace version this binary was built from.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The commit this binary was built from: `KVPOOL_GIT_SHA` at compile time (the image builds
/// and CI set it), `unknown` otherwise. Read from the environment rather than from git so
/// that a new commit does not rebuild every crate above this one.
pub const GIT_SHA: &str = match option_env!("KVPOOL_GIT_SHA") {
    Some(sha) => sha,
    None => "unknown",
};

/// The optional cargo features of the `kvpool` binary this process runs, comma-separated
/// (`none` without any): the root package turns on this crate's features of the same names.
pub fn features() -> &'static str {
    match (cfg!(feature = "rdma"), cfg!(feature = "cuda")) {
        (true, true) => "rdma,cuda",
        (true, false) => "rdma",
        (false, true) => "cuda",
        (false, false) => "none",
    }
}

/// A fresh registry holding the process-wide metrics (build information and the process
/// collector).
pub fn registry() -> Result<Registry, prometheus::Error> {
    let registry = Registry::new();
    let build = IntGaugeVec::new(
        Opts::new(
            "kvpool_build_info",
            "Always 1; the labels say which build of kvpool this process runs",
        ),
        &["version", "git_sha", "features"],
    )?;
    build
        .with_label_values(&[VERSION, GIT_SHA, features()])
        .set(1);
    registry.register(Box::new(build))?;
    #[cfg(target_os = "linux")]
    registry.register(Box::new(
        prometheus::process_collector::ProcessCollector::for_self(),
    ))?;
    Ok(registry)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_info_and_process_metrics_are_gathered() {
        let registry = registry().expect("registry");
        let names: Vec<String> = registry
            .gather()
            .iter()
            .map(|f| f.name().to_owned())
            .collect();
        for want in [
            "kvpool_build_info",
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_start_time_seconds",
        ] {
            assert!(
                names.iter().any(|n| n == want),
                "{want} missing in {names:?}"
            );
        }
        let build = registry
            .gather()
            .into_iter()
            .find(|f| f.name() == "kvpool_build_info")
            .expect("build info");
        let labels: Vec<(String, String)> = build.get_metric()[0]
            .get_label()
            .iter()
            .map(|l| (l.name().to_owned(), l.value().to_owned()))
            .collect();
        assert!(
            labels.contains(&("version".into(), VERSION.into())),
            "{labels:?}"
        );
        assert!(
            labels.contains(&("features".into(), features().into())),
            "{labels:?}"
        );
    }
}

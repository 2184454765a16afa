//! The layout rules of docs/adr/0003-crates-by-layer.md, checked on the source tree so that they
//! hold after every change: no production file over 600 lines, no `#[path]` module splicing, no
//! import circle between the files of one folder, and each crate depends only on the layers the
//! ADR allows it. I/O boundary: reads the repository's sources and manifests.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Most lines of production code (before a file's `#[cfg(test)]` module) in one file.
const MAX_PRODUCTION_LINES: usize = 600;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Source roots of the workspace's crates: (crate name, `src` directory).
fn crate_roots() -> Vec<(String, PathBuf)> {
    let root = repo();
    let mut out = vec![
        ("kvpool".to_owned(), root.join("src")),
        ("kvpool-agent".to_owned(), root.join("agent/src")),
        ("kvpool-operator".to_owned(), root.join("operator/src")),
    ];
    let mut crates: Vec<_> = std::fs::read_dir(root.join("crates"))
        .expect("crates/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.join("Cargo.toml").is_file())
        .collect();
    crates.sort();
    for dir in crates {
        let name = format!(
            "kvpool-{}",
            dir.file_name()
                .and_then(|n| n.to_str())
                .expect("utf-8 name")
        );
        out.push((name, dir.join("src")));
    }
    out
}

/// Every crate with its source root and the Rust files below it.
fn crate_sources() -> Vec<(String, PathBuf, Vec<PathBuf>)> {
    crate_roots()
        .into_iter()
        .map(|(krate, src)| {
            let mut files = Vec::new();
            rust_files(&src, &mut files);
            (krate, src, files)
        })
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| e.expect("entry").path())
        .collect();
    entries.sort();
    for p in entries {
        // Fixture trees copy sysfs, symlink loops included: never follow links.
        let meta = std::fs::symlink_metadata(&p).expect("metadata");
        if meta.is_symlink() || p.file_name().is_some_and(|n| n == "fixtures") {
            continue;
        }
        if meta.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// Lines before the file's test module (all lines when it has none). Files that are test
/// modules themselves (`tests.rs`, anything under a `tests/` folder) are not production code.
fn production_lines(path: &Path, text: &str) -> usize {
    let is_test_file = path.file_name().is_some_and(|n| n == "tests.rs")
        || path.components().any(|c| c.as_os_str() == "tests")
        || path.file_name().is_some_and(|n| n == "test_fixtures.rs");
    if is_test_file {
        return 0;
    }
    text.lines()
        .position(|l| l.starts_with("#[cfg(test)]"))
        .unwrap_or_else(|| text.lines().count())
}

#[test]
fn no_production_file_is_longer_than_the_limit() {
    let mut long = Vec::new();
    for (_, _, files) in crate_sources() {
        for f in files {
            let text = std::fs::read_to_string(&f).expect("read");
            let n = production_lines(&f, &text);
            let rel = f
                .strip_prefix(repo())
                .expect("under the repository")
                .to_string_lossy()
                .into_owned();
            if n > MAX_PRODUCTION_LINES {
                long.push(format!("{rel} ({n} lines)"));
            }
        }
    }
    assert!(
        long.is_empty(),
        "production files over {MAX_PRODUCTION_LINES} lines (split them by concern): {long:#?}"
    );
}

#[test]
fn no_module_is_spliced_in_with_a_path_attribute() {
    let mut found = Vec::new();
    let mut dirs: Vec<PathBuf> = crate_roots().into_iter().map(|(_, s)| s).collect();
    for extra in ["tests", "agent/tests", "operator/tests"] {
        dirs.push(repo().join(extra));
    }
    for (_, src) in crate_roots() {
        let tests = src.with_file_name("tests");
        if tests.is_dir() {
            dirs.push(tests);
        }
    }
    for dir in dirs {
        let mut files = Vec::new();
        rust_files(&dir, &mut files);
        for f in files {
            let text = std::fs::read_to_string(&f).expect("read");
            if text.lines().any(|l| l.trim_start().starts_with("#[path")) {
                found.push(f.display().to_string());
            }
        }
    }
    assert!(found.is_empty(), "#[path] attributes: {found:?}");
}

/// The module path of a file inside its crate (`["master", "state"]` for
/// `src/master/state.rs`; `mod.rs` and `lib.rs` name their folder).
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).expect("file under src");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|c| c.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().expect("file name");
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_owned());
    }
    parts
}

/// Paths mentioned in a file: every `crate::a::b` and `super::a` (resolved against the file's
/// module), as absolute module paths inside the crate. `use` groups are expanded one level
/// (`crate::a::{b, c::d}` gives `a::b` and `a::c`).
fn referenced_paths(module: &[String], is_mod_root: bool, text: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    // The module that `super` names from this file.
    let parent: Vec<String> = if is_mod_root || module.is_empty() {
        module[..module.len().saturating_sub(1)].to_vec()
    } else {
        module[..module.len() - 1].to_vec()
    };
    let bytes = text.as_bytes();
    for (start, head) in [("crate::", None), ("super::", Some(&parent))] {
        let mut from = 0;
        while let Some(i) = text[from..].find(start) {
            let at = from + i;
            from = at + start.len();
            if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
                continue;
            }
            // Inside a file's own `mod tests`, `super::` is the file itself: skip test code.
            if text[..at].contains("\n#[cfg(test)]") {
                break;
            }
            let rest = &text[from..];
            let mut base: Vec<String> = head.cloned().unwrap_or_default();
            let mut segs = Vec::new();
            let mut chars = rest.char_indices().peekable();
            let mut cur = String::new();
            let mut group = None;
            while let Some((j, c)) = chars.next() {
                if c.is_ascii_alphanumeric() || c == '_' {
                    cur.push(c);
                } else if c == ':' && rest[j..].starts_with("::") {
                    chars.next();
                    segs.push(std::mem::take(&mut cur));
                    if rest[j + 2..].starts_with('{') {
                        group = Some(j + 3);
                        break;
                    }
                } else {
                    break;
                }
            }
            if !cur.is_empty() {
                segs.push(cur);
            }
            base.extend(segs.iter().cloned());
            match group {
                Some(g) => {
                    let end = rest[g..].find('}').map_or(rest.len(), |e| g + e);
                    for item in rest[g..end].split(',') {
                        let first = item
                            .trim()
                            .split("::")
                            .next()
                            .unwrap_or("")
                            .split_whitespace()
                            .next()
                            .unwrap_or("");
                        if first.is_empty() || first == "self" {
                            continue;
                        }
                        let mut p = base.clone();
                        p.push(first.to_owned());
                        out.push(p);
                    }
                }
                None => out.push(base),
            }
        }
    }
    out
}

#[test]
fn files_of_one_folder_do_not_import_each_other_in_a_circle() {
    let mut circles = Vec::new();
    for (krate, src, files) in crate_sources() {
        // module path -> file
        let modules: BTreeMap<Vec<String>, PathBuf> = files
            .iter()
            .map(|f| (module_path(&src, f), f.clone()))
            .collect();
        // folder (parent module) -> edges between its child modules
        let mut edges: BTreeMap<Vec<String>, BTreeSet<(String, String)>> = BTreeMap::new();
        for (module, file) in &modules {
            if module.is_empty() {
                continue;
            }
            let text = std::fs::read_to_string(file).expect("read");
            let is_root = file
                .file_name()
                .is_some_and(|n| n == "mod.rs" || n == "lib.rs");
            let folder = module[..module.len() - 1].to_vec();
            let me = module[module.len() - 1].clone();
            for path in referenced_paths(module, is_root, &text) {
                if path.len() > folder.len()
                    && path[..folder.len()] == folder[..]
                    && path[folder.len()] != me
                {
                    let mut sibling = folder.clone();
                    sibling.push(path[folder.len()].clone());
                    if modules.contains_key(&sibling) {
                        edges
                            .entry(folder.clone())
                            .or_default()
                            .insert((me.clone(), path[folder.len()].clone()));
                    }
                }
            }
        }
        for (folder, es) in edges {
            let name = format!("{krate}::{}", folder.join("::"));
            if let Some(cycle) = find_cycle(&es) {
                circles.push(format!("{name}: {}", cycle.join(" -> ")));
            }
        }
    }
    assert!(circles.is_empty(), "import circles: {circles:#?}");
}

fn find_cycle(edges: &BTreeSet<(String, String)>) -> Option<Vec<String>> {
    let mut graph: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (a, b) in edges {
        graph.entry(a.as_str()).or_default().push(b.as_str());
    }
    fn visit<'a>(
        n: &'a str,
        graph: &BTreeMap<&'a str, Vec<&'a str>>,
        stack: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) -> Option<Vec<String>> {
        if let Some(i) = stack.iter().position(|s| *s == n) {
            let mut c: Vec<String> = stack[i..].iter().map(|s| (*s).to_owned()).collect();
            c.push(n.to_owned());
            return Some(c);
        }
        if done.contains(n) {
            return None;
        }
        stack.push(n);
        for m in graph.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, graph, stack, done) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(n);
        None
    }
    let mut done = BTreeSet::new();
    for n in graph.keys() {
        if let Some(c) = visit(n, &graph, &mut Vec::new(), &mut done) {
            return Some(c);
        }
    }
    None
}

/// Normal (non-dev, non-build) dependencies of a crate, from its manifest.
fn dependencies(manifest: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(manifest).expect("manifest");
    let mut out = BTreeSet::new();
    let mut in_deps = false;
    for line in text.lines() {
        let l = line.trim();
        if l.starts_with('[') {
            in_deps = l == "[dependencies]";
            continue;
        }
        if in_deps && let Some((name, _)) = l.split_once('=') {
            let name = name.trim();
            if !name.is_empty() && !name.starts_with('#') {
                out.insert(name.to_owned());
            }
        }
    }
    out
}

#[test]
fn crates_depend_only_on_the_layers_below_them() {
    // What each crate must never depend on (docs/adr/0003-crates-by-layer.md).
    let runtime = [
        "tokio",
        "tonic",
        "axum",
        "hyper",
        "kube",
        "etcd-client",
        "prometheus",
    ];
    let servers = [
        "kvpool-master",
        "kvpool-conductor",
        "kvpool-synthetic",
        "kvpool-agent",
        "kvpool-operator",
        "kvpool-bench",
    ];
    // The pool client, and the Python package built on it.
    let pool_client_forbidden: Vec<&str> = [
        "axum",
        "kube",
        "etcd-client",
        "tokenizers",
        "kvpool-runtime",
        "kvpool-crd",
    ]
    .into_iter()
    .chain(servers)
    .collect();
    let rules: Vec<(&str, Vec<&str>)> = vec![
        (
            "crates/core",
            runtime.iter().chain(&["k8s-openapi"]).copied().collect(),
        ),
        (
            "crates/crd",
            runtime
                .iter()
                .copied()
                .filter(|d| *d != "kube")
                .chain(["kvpool-core"])
                .collect(),
        ),
        (
            "crates/proto",
            [
                "tokio",
                "axum",
                "hyper",
                "kube",
                "etcd-client",
                "prometheus",
            ]
            .into_iter()
            .chain(servers)
            .collect(),
        ),
        (
            "crates/transfer",
            [
                "tonic",
                "axum",
                "kube",
                "etcd-client",
                "kvpool-core",
                "kvpool-proto",
            ]
            .into_iter()
            .chain(servers)
            .collect(),
        ),
        ("crates/client", pool_client_forbidden.clone()),
        ("crates/python", pool_client_forbidden),
        (
            "crates/conductor",
            vec!["kvpool-synthetic", "kvpool-master", "kvpool-agent"],
        ),
        (
            "crates/synthetic",
            vec!["kvpool-conductor", "kvpool-master", "kvpool-agent", "kube"],
        ),
        (
            "crates/master",
            vec![
                "kvpool-conductor",
                "kvpool-synthetic",
                "kvpool-agent",
                "kube",
            ],
        ),
        (
            "agent",
            vec!["kvpool-master", "kvpool-conductor", "kvpool-synthetic"],
        ),
        (
            "operator",
            vec![
                "kvpool-master",
                "kvpool-agent",
                "kvpool-conductor",
                "kvpool-synthetic",
            ],
        ),
    ];
    let mut broken = Vec::new();
    for (dir, forbidden) in rules {
        let deps = dependencies(&repo().join(dir).join("Cargo.toml"));
        for f in forbidden {
            if deps.contains(f) {
                broken.push(format!("{dir} depends on {f}"));
            }
        }
    }
    assert!(broken.is_empty(), "layer rules broken: {broken:#?}");
}

#[test]
fn the_pool_client_links_no_server_or_kubernetes_code() {
    // What engines and the Python package link: `cargo tree` of kvpool-client (normal
    // dependencies with features, offline from Cargo.lock).
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = kvpool_harness::output_ok(
        std::process::Command::new(cargo)
            .args([
                "tree",
                "-p",
                "kvpool-client",
                "-e",
                "normal,features",
                "--prefix",
                "none",
                "--offline",
            ])
            .current_dir(repo()),
    )
    .expect("cargo tree");
    let tree = String::from_utf8_lossy(&out.stdout);
    let mut found = Vec::new();
    for line in tree.lines() {
        let l = line.trim();
        let bad = [
            "kube ",
            "kube-",
            "axum ",
            "tokenizers ",
            "etcd-client ",
            "k8s-openapi ",
        ]
        .iter()
        .any(|p| l.starts_with(p))
            || l.starts_with("tonic feature \"server\"")
            || l.starts_with("tonic feature \"router\"")
            || l.starts_with("tonic feature \"transport\"");
        if bad {
            found.push(l.to_owned());
        }
    }
    found.sort();
    found.dedup();
    assert!(found.is_empty(), "kvpool-client links: {found:#?}");
    assert!(
        tree.lines()
            .any(|l| l.starts_with("tonic feature \"channel\""))
    );
}

#[test]
fn the_lean_build_links_no_operator_benchmark_or_kubernetes_client() {
    // README.md's first command: `cargo build --release -p kvpool --no-default-features`
    // (docs/adr/0011-lean-embedded-build.md). What it links, offline from Cargo.lock.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = kvpool_harness::output_ok(
        std::process::Command::new(cargo)
            .args(["tree", "-p", "kvpool", "--no-default-features"])
            .args(["-e", "normal", "--prefix", "none", "--offline"])
            .current_dir(repo()),
    )
    .expect("cargo tree");
    let tree = String::from_utf8_lossy(&out.stdout);
    let mut found: Vec<&str> = tree
        .lines()
        .map(str::trim)
        .filter(|l| {
            [
                "kvpool-operator ",
                "kvpool-bench ",
                "kube-client ",
                "kube-runtime ",
                "kube-lease-manager ",
            ]
            .iter()
            .any(|p| l.starts_with(p))
        })
        .collect();
    found.sort_unstable();
    found.dedup();
    assert!(found.is_empty(), "the lean kvpool links: {found:#?}");
    // The roles `kvpool up` starts are all there.
    for role in [
        "kvpool-agent ",
        "kvpool-conductor ",
        "kvpool-master ",
        "kvpool-synthetic ",
    ] {
        assert!(tree.lines().any(|l| l.starts_with(role)), "no {role}");
    }
}

//! Every repository path the documentation names exists: README.md, docs/**/*.md and the
//! chart's README are scanned for relative paths (`crates/client/src/pool/mod.rs`,
//! `tests/layout.rs`, `deploy/examples/tcp/`, ...), and each must be a file or folder of the
//! repository, so a move that forgets the docs fails here. I/O boundary: reads the docs.

use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Top-level folders whose paths the docs may name; a token that starts elsewhere is not a
/// repository path (a URL, a path inside a container, a label key).
const ROOTS: &[&str] = &[
    "agent/",
    "charts/",
    "crates/",
    "crds/",
    "data/",
    "deploy/",
    "docker/",
    "docs/",
    "fuzz/",
    "operator/",
    "scripts/",
    "src/",
    "tests/",
    ".ci/",
];

fn docs() -> Vec<PathBuf> {
    let mut out = vec![
        repo().join("README.md"),
        repo().join("charts/kvpool/README.md"),
    ];
    let mut stack = vec![repo().join("docs")];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).expect("docs dir") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Path-like tokens of one line: runs of path characters that start with a known root and
/// are not part of a longer path or URL.
fn tokens(line: &str) -> Vec<String> {
    let is_path_char = |c: char| c.is_ascii_alphanumeric() || "/._-*".contains(c);
    let mut out = Vec::new();
    let chars: Vec<char> = line.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if !is_path_char(chars[i]) || (i > 0 && (is_path_char(chars[i - 1]) || chars[i - 1] == ':'))
        {
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len() && is_path_char(chars[i]) {
            i += 1;
        }
        let tok: String = chars[start..i].iter().collect();
        let tok = tok.trim_end_matches(['.', ',']).to_owned();
        if ROOTS.iter().any(|r| tok.starts_with(r)) && !tok.contains('*') && !tok.contains("...") {
            out.push(tok);
        }
    }
    out
}

#[test]
fn every_path_the_docs_name_exists() {
    let root = repo();
    let mut missing = Vec::new();
    for doc in docs() {
        let text = std::fs::read_to_string(&doc).expect("read doc");
        for (n, line) in text.lines().enumerate() {
            for tok in tokens(line) {
                if !Path::new(&root).join(&tok).exists() {
                    missing.push(format!(
                        "{}:{}: {tok}",
                        doc.strip_prefix(&root).unwrap_or(&doc).display(),
                        n + 1
                    ));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "the docs name paths that do not exist: {missing:#?}"
    );
}

#[test]
fn tokens_are_found_and_urls_are_not() {
    assert_eq!(
        tokens("see `crates/core/src/lib.rs` and tests/layout.rs, not https://x.io/src/a.rs"),
        vec!["crates/core/src/lib.rs", "tests/layout.rs"]
    );
    assert_eq!(
        tokens("docs/adr/ and deploy/examples/tcp/."),
        vec!["docs/adr/", "deploy/examples/tcp/"]
    );
}

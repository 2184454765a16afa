//! The example resources users copy from (deploy/examples/** and the YAML blocks of
//! docs/crds.md) must be accepted by an API server with the generated CRDs: each parses into its
//! Rust type, passes the openAPIV3Schema strictly and every CEL rule, and passes the operator's
//! own validation; engine pools point at a KVCachePool of the same set. I/O: reads those files.

mod crd_support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crd_support::{Kind, admission_errors, yaml_to_json};
use kvpool_crd::{KVCachePool, Protocol, ValidatedKVCachePool};
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A kvpool resource found in a file.
struct Doc {
    origin: String,
    kind: Kind,
    value: Value,
}

fn kvpool_docs(origin: &str, text: &str) -> Vec<Doc> {
    let docs: Vec<Value> = serde_saphyr::from_multiple(text)
        .unwrap_or_else(|e| panic!("{origin}: not valid YAML: {e}"));
    docs.into_iter()
        .filter(|d| !d.is_null())
        .filter(|d| d["apiVersion"] == "kvpool.dev/v1alpha1")
        .map(|value| {
            let kind_name = value["kind"].as_str().unwrap_or_default();
            let kind = Kind::from_name(kind_name)
                .unwrap_or_else(|| panic!("{origin}: unknown kvpool kind {kind_name:?}"));
            Doc {
                origin: origin.to_owned(),
                kind,
                value,
            }
        })
        .collect()
}

/// Checks one resource as an API server and the operator would; returns problems.
fn check(doc: &Doc) -> Vec<String> {
    let name = doc.value["metadata"]["name"].as_str().unwrap_or("?");
    let label = format!("{} {} {name}", doc.origin, doc.kind.name());
    let mut problems: Vec<String> = admission_errors(doc.kind, &doc.value, None)
        .into_iter()
        .map(|e| format!("{label}: {e}"))
        .collect();
    let typed = crd_support::rust_validation(doc.kind, &doc.value);
    if let Err(e) = typed {
        problems.push(format!("{label}: {e}"));
    }
    problems
}

fn example_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(repo().join("deploy/examples"))
        .expect("deploy/examples exists")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

fn docs_in(dir: &Path) -> Vec<Doc> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("readable")
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.extension().is_some_and(|x| x == "yaml") && !p.ends_with("kustomization.yaml")
        })
        .collect();
    files.sort();
    files
        .iter()
        .flat_map(|f| {
            let origin = f.strip_prefix(repo()).unwrap_or(f).display().to_string();
            kvpool_docs(&origin, &std::fs::read_to_string(f).expect("readable"))
        })
        .collect()
}

#[test]
fn the_roce_and_tcp_example_sets_exist_with_all_three_kinds() {
    let names: Vec<String> = example_dirs()
        .iter()
        .filter_map(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    for wanted in ["roce-sriov", "tcp"] {
        assert!(
            names.iter().any(|n| n == wanted),
            "deploy/examples/{wanted} is missing: {names:?}"
        );
    }
    for dir in example_dirs() {
        let kinds: BTreeSet<&str> = docs_in(&dir).iter().map(|d| d.kind.name()).collect();
        assert_eq!(kinds.len(), 3, "{} has kinds {kinds:?}", dir.display());
    }
}

#[test]
fn every_example_is_accepted() {
    let problems: Vec<String> = example_dirs()
        .iter()
        .flat_map(|d| docs_in(d))
        .flat_map(|d| check(&d))
        .collect();
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[test]
fn engine_pools_reference_a_pool_of_their_own_set() {
    for dir in example_dirs() {
        let docs = docs_in(&dir);
        let pools: BTreeSet<(String, String)> = docs
            .iter()
            .filter(|d| d.kind == Kind::KVCachePool)
            .map(|d| {
                (
                    d.value["metadata"]["namespace"].to_string(),
                    d.value["metadata"]["name"].to_string(),
                )
            })
            .collect();
        for d in docs.iter().filter(|d| d.kind != Kind::KVCachePool) {
            let wanted = (
                d.value["metadata"]["namespace"].to_string(),
                d.value["spec"]["kvCachePoolRef"]["name"].to_string(),
            );
            assert!(
                pools.contains(&wanted),
                "{}: kvCachePoolRef {wanted:?} is not in {pools:?}",
                d.origin
            );
        }
    }
}

#[test]
fn example_kustomizations_list_every_file() {
    for dir in example_dirs() {
        let k = dir.join("kustomization.yaml");
        let text =
            std::fs::read_to_string(&k).unwrap_or_else(|_| panic!("{} is missing", k.display()));
        let doc = yaml_to_json(&text);
        let listed: BTreeSet<String> = doc["resources"]
            .as_array()
            .expect("resources")
            .iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect();
        let present: BTreeSet<String> = std::fs::read_dir(&dir)
            .expect("readable")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
            .collect();
        assert_eq!(listed, present, "{}", k.display());
    }
}

#[test]
fn the_roce_example_uses_what_it_claims() {
    let text = std::fs::read_to_string(repo().join("deploy/examples/roce-sriov/kvcachepool.yaml"))
        .expect("readable");
    let pool: KVCachePool = serde_saphyr::from_str(&text).expect("parses");
    let v = ValidatedKVCachePool::validate(&pool.spec).expect("valid");
    assert_eq!(v.transport.protocol, Protocol::Rdma);
    assert!(v.transport.sriov.is_some() && !v.transport.networks.is_empty());
    assert!(v.ssd.is_some() && v.master.is_ha() && v.conductor.is_some());
    assert_ne!(pool.spec.dram.hugepages, kvpool_crd::Hugepages::None);
    let text = std::fs::read_to_string(repo().join("deploy/examples/tcp/kvcachepool.yaml"))
        .expect("readable");
    let pool: KVCachePool = serde_saphyr::from_str(&text).expect("parses");
    assert_eq!(pool.spec.transport.protocol, Protocol::Tcp);
}

/// YAML blocks in docs/crds.md that hold kvpool resources are checked like the examples;
/// blocks marked `# invalid:` must be rejected with the message the comment quotes.
#[test]
fn docs_examples_are_accepted_or_rejected_as_documented() {
    let text = std::fs::read_to_string(repo().join("docs/crds.md")).expect("docs/crds.md exists");
    let mut blocks = 0;
    let mut problems = Vec::new();
    for (i, block) in text.split("```yaml\n").skip(1).enumerate() {
        let body = block.split("```").next().unwrap_or_default();
        let origin = format!("docs/crds.md yaml block {}", i + 1);
        let expected_failure = body
            .lines()
            .find_map(|l| l.strip_prefix("# invalid: "))
            .map(|m| m.trim().trim_matches('"').to_owned());
        for doc in kvpool_docs(&origin, body) {
            blocks += 1;
            let found = check(&doc);
            match &expected_failure {
                None => problems.extend(found),
                Some(message) => {
                    if !found.iter().any(|f| f.contains(message.as_str())) {
                        problems.push(format!(
                            "{origin}: expected rejection {message:?}, got {found:?}"
                        ));
                    }
                }
            }
        }
    }
    assert!(
        blocks >= 3,
        "docs/crds.md should show at least one example per kind, found {blocks}"
    );
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

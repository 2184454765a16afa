//! Golden files of what the operator renders for engine pods: the full Deployment (pod template,
//! init container, env, flags, volumes) and Service of a vLLM and an SGLang PrefillPool and
//! DecodePool, of a vLLM PrefillPool with a pod template (`spec.template`) and of a custom
//! engine, and the pool's `engine.json`, each compared byte for byte
//! with the checked-in copy under operator/tests/golden/. A mismatch prints a line diff; after
//! an intended change, regenerate with
//! `KVPOOL_UPDATE_GOLDEN=1 cargo test -p kvpool-operator --test golden` and review the diff in
//! git. Each file is also parsed back and compared with the Rust objects, so it means what the
//! operator sends. I/O boundary: the fixture and golden files of this crate.

use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use kvpool_crd::{DecodePool, KVCachePool, PrefillPool};
use kvpool_operator::cachepool::build::{config_data, config_hash};
use kvpool_operator::cachepool::validate::{ValidCachePool, validate as validate_pool};
use kvpool_operator::context::Settings;
use kvpool_operator::enginepool::build::build;
use kvpool_operator::enginepool::validate::{ValidEnginePool, validate};
use serde_json::Value;

const UPDATE_VAR: &str = "KVPOOL_UPDATE_GOLDEN";

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn golden_dir() -> PathBuf {
    crate_dir().join("tests/golden")
}

fn fixture<T: serde::de::DeserializeOwned>(name: &str) -> T {
    let path = crate_dir().join("tests/fixtures").join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

fn pool(name: &str) -> ValidCachePool {
    let pool: KVCachePool = fixture(name);
    validate_pool(&pool, &Settings::for_tests()).expect("fixture pool is valid")
}

/// The config hash the cachepool controller computes for `pool`'s ConfigMap.
fn hash(pool: &ValidCachePool) -> String {
    config_hash(&config_data(pool).expect("config data"))
}

/// A unified-style diff of two texts, line by line (longest common subsequence), with three
/// lines of context around each change and at most `MAX` lines shown.
fn diff(expected: &str, actual: &str) -> String {
    const CONTEXT: usize = 3;
    const MAX: usize = 200;
    let a: Vec<&str> = expected.lines().collect();
    let b: Vec<&str> = actual.lines().collect();
    let (n, m) = (a.len(), b.len());
    // lcs[i][j]: length of the longest common subsequence of a[i..] and b[j..].
    let mut lcs = vec![vec![0usize; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let mut ops: Vec<(char, usize, &str)> = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < n || j < m {
        if i < n && j < m && a[i] == b[j] {
            ops.push((' ', i + 1, a[i]));
            i += 1;
            j += 1;
        } else if j < m && (i == n || lcs[i][j + 1] >= lcs[i + 1][j]) {
            ops.push(('+', j + 1, b[j]));
            j += 1;
        } else {
            ops.push(('-', i + 1, a[i]));
            i += 1;
        }
    }
    let changed: Vec<usize> = (0..ops.len()).filter(|&k| ops[k].0 != ' ').collect();
    let near = |k: usize| changed.iter().any(|&c| c.abs_diff(k) <= CONTEXT);
    let mut out = String::from(
        "--- golden (line numbers: golden for ' '/'-', rendered for '+')\n+++ rendered\n",
    );
    let mut shown = 0;
    let mut gap = false;
    for (k, (tag, line, text)) in ops.iter().enumerate() {
        if !near(k) {
            gap = true;
            continue;
        }
        if gap {
            out.push_str("...\n");
            gap = false;
        }
        if shown == MAX {
            out.push_str("... (diff cut)\n");
            break;
        }
        out.push_str(&format!("{tag}{line:>5} {text}\n"));
        shown += 1;
    }
    out
}

/// Compares `actual` with the golden file `name`, or writes it when regenerating.
fn check(name: &str, actual: &str) {
    let path = golden_dir().join(name);
    if std::env::var_os(UPDATE_VAR).is_some_and(|v| v == "1") {
        std::fs::create_dir_all(golden_dir()).expect("create golden dir");
        std::fs::write(&path, actual).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "reading {}: {e}\nrun {UPDATE_VAR}=1 cargo test -p kvpool-operator --test golden",
            path.display()
        )
    });
    assert!(
        expected == actual,
        "{} differs from what the operator renders:\n{}\nIf the change is intended, run \
         {UPDATE_VAR}=1 cargo test -p kvpool-operator --test golden and review the diff.",
        path.display(),
        diff(&expected, actual)
    );
}

/// The engine pool's Deployment and Service as one YAML stream, checked against `name`; the
/// file also parses back to exactly these objects.
fn check_engine(name: &str, p: &ValidEnginePool) {
    let children = build(p, &hash(&p.pool));
    let deployment = serde_saphyr::to_string(&children.deployment).expect("render Deployment");
    let service = serde_saphyr::to_string(&children.service).expect("render Service");
    let text = format!("{deployment}---\n{service}");
    check(name, &text);
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text).expect("golden stream parses");
    let docs: Vec<Value> = docs.into_iter().filter(|d| !d.is_null()).collect();
    assert_eq!(docs.len(), 2, "{name}: Deployment and Service");
    let back: Deployment = serde_json::from_value(docs[0].clone()).expect("a Deployment");
    assert_eq!(back, children.deployment, "{name}: Deployment round trip");
    let back: Service = serde_json::from_value(docs[1].clone()).expect("a Service");
    assert_eq!(back, children.service, "{name}: Service round trip");
}

/// The engine pods with a golden file, as (engine, role, KVCachePool): the pool
/// `{role}pool-{engine}.yaml` over `kvcachepool-{pool}.yaml` renders `{engine}-{role}.yaml`.
const ENGINE_PODS: [(&str, &str, &str); 6] = [
    ("vllm", "prefill", "roce"),
    // A pod template: a model-cache claim, a pull secret, a toleration, a node affinity.
    ("vllm-pvc", "prefill", "roce"),
    ("vllm", "decode", "roce"),
    ("sglang", "prefill", "roce"),
    ("sglang", "decode", "roce"),
    ("custom", "prefill", "tcp"),
];

/// The KVCachePool fixtures whose `engine.json` has a golden file, and that file.
const ENGINE_JSONS: [(&str, &str); 2] = [
    ("kvcachepool-roce.yaml", "engine-roce.json"),
    ("kvcachepool-tcp.yaml", "engine-tcp.json"),
];

#[test]
fn engine_pods_match_their_golden_files() {
    for (engine, role, pool_name) in ENGINE_PODS {
        let fixture_name = format!("{role}pool-{engine}.yaml");
        let pool = pool(&format!("kvcachepool-{pool_name}.yaml"));
        let p = match role {
            "prefill" => validate(&fixture::<PrefillPool>(&fixture_name), pool),
            "decode" => validate(&fixture::<DecodePool>(&fixture_name), pool),
            other => panic!("no engine pool kind for the role {other}"),
        }
        .expect("valid");
        check_engine(&format!("{engine}-{role}.yaml"), &p);
    }
}

#[test]
fn engine_json_of_each_pool() {
    for (fixture_name, golden) in ENGINE_JSONS {
        let data = config_data(&pool(fixture_name)).expect("config data");
        let json = data.get("engine.json").expect("engine.json key");
        check(golden, &format!("{json}\n"));
    }
}

/// Every golden file is one that a test above renders, so none goes stale unnoticed.
#[test]
fn no_golden_file_is_left_over() {
    let pods = ENGINE_PODS.map(|(engine, role, _)| format!("{engine}-{role}.yaml"));
    let jsons = ENGINE_JSONS.map(|(_, golden)| golden.to_owned());
    let rendered: Vec<String> = pods.into_iter().chain(jsons).collect();
    let dir = golden_dir();
    let Ok(entries) = std::fs::read_dir(&dir) else {
        assert!(
            std::env::var_os(UPDATE_VAR).is_some(),
            "{} is missing; run {UPDATE_VAR}=1 cargo test -p kvpool-operator --test golden",
            dir.display()
        );
        return;
    };
    for entry in entries {
        let name = entry.expect("entry").file_name();
        let name = name.to_string_lossy();
        assert!(
            rendered.iter().any(|r| *r == name),
            "{} is not rendered by any test",
            Path::new(&dir).join(name.as_ref()).display()
        );
    }
}

#[test]
fn diff_shows_the_changed_lines_with_context() {
    let a = "a\nb\nc\nd\ne\nf\ng\nh\ni\n";
    let b = "a\nb\nc\nd\nE\nf\ng\nh\ni\nj\n";
    let d = diff(a, b);
    assert!(d.contains("-    5 e"), "{d}");
    assert!(d.contains("+    5 E"), "{d}");
    assert!(d.contains("+   10 j"), "{d}");
    assert!(d.contains("     4 d"), "{d}");
    assert!(!d.contains("     1 a"), "{d}");
}

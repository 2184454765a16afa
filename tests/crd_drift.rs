//! Generated files must match the Rust types: `crds/*.yaml` (the CustomResourceDefinitions) and
//! the generated reference sections of `docs/crds.md`. With `KVPOOL_BLESS=1` the test rewrites
//! them instead of failing. I/O: reads and (when blessing) writes those files in the repository.

mod crd_support;

use std::path::{Path, PathBuf};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kvpool::crd::{crds, crds_yaml, render_crds};

const REGENERATE: &str = "regenerate with `KVPOOL_BLESS=1 cargo nextest run -p kvpool --test crd_drift` \
     (or `kvpool-operator crd`) and commit the result";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn blessing() -> bool {
    std::env::var("KVPOOL_BLESS").is_ok_and(|v| v == "1")
}

fn check_or_bless(path: &Path, expected: &str) -> Option<String> {
    let actual = std::fs::read_to_string(path).unwrap_or_default();
    if actual == expected {
        return None;
    }
    if blessing() {
        std::fs::create_dir_all(path.parent().expect("file has a parent")).expect("create dir");
        std::fs::write(path, expected).expect("write generated file");
        return None;
    }
    let first_diff = actual
        .lines()
        .zip(expected.lines())
        .position(|(a, e)| a != e)
        .unwrap_or_else(|| actual.lines().count().min(expected.lines().count()));
    Some(format!(
        "{} is out of date (first difference at line {})",
        path.display(),
        first_diff + 1
    ))
}

#[test]
fn crds_directory_matches_the_rust_types() {
    let dir = repo().join("crds");
    let rendered = render_crds().expect("CRDs render");
    let mut problems: Vec<String> = rendered
        .iter()
        .filter_map(|r| check_or_bless(&dir.join(&r.file_name), &r.yaml))
        .collect();
    // nothing stale next to them
    let expected: Vec<&str> = rendered.iter().map(|r| r.file_name.as_str()).collect();
    for entry in std::fs::read_dir(&dir).expect("crds/ exists").flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".yaml")
            && name != "kustomization.yaml"
            && !expected.contains(&name.as_str())
        {
            problems.push(format!(
                "crds/{name} is not generated from the Rust types; delete it"
            ));
        }
    }
    assert!(problems.is_empty(), "{}\n{REGENERATE}", problems.join("\n"));
}

#[test]
fn crd_yaml_parses_back_to_the_same_definitions() {
    let from_files: Vec<CustomResourceDefinition> = render_crds()
        .expect("CRDs render")
        .iter()
        .map(|r| serde_saphyr::from_str(&r.yaml).expect("rendered YAML parses"))
        .collect();
    assert_eq!(from_files, crds());
    let stream: Vec<CustomResourceDefinition> =
        serde_saphyr::from_multiple(&crds_yaml().expect("stream renders")).expect("stream parses");
    assert_eq!(stream, crds());
}

#[test]
fn crds_kustomization_lists_every_crd() {
    let text = std::fs::read_to_string(repo().join("crds/kustomization.yaml"))
        .expect("crds/kustomization.yaml exists");
    let doc: serde_json::Value = serde_saphyr::from_str(&text).expect("kustomization parses");
    let listed: Vec<&str> = doc["resources"]
        .as_array()
        .expect("resources list")
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    let expected: Vec<String> = render_crds()
        .expect("render")
        .into_iter()
        .map(|r| r.file_name)
        .collect();
    assert_eq!(
        listed, expected,
        "crds/kustomization.yaml must list the generated files in order"
    );
}

#[test]
fn reference_docs_match_the_rust_types() {
    let path = repo().join("docs/crds.md");
    let doc = std::fs::read_to_string(&path).expect("docs/crds.md exists");
    let updated =
        crd_support::reference::splice_into(&doc).unwrap_or_else(|e| panic!("docs/crds.md: {e}"));
    if let Some(problem) = check_or_bless(&path, &updated) {
        panic!(
            "{problem}: its generated field reference differs from the Rust types\n{REGENERATE}"
        );
    }
}

#[test]
fn docs_explain_every_condition_reason() {
    let doc = std::fs::read_to_string(repo().join("docs/crds.md")).expect("docs/crds.md exists");
    for reason in kvpool::crd::conditions::reasons::ALL {
        assert!(
            doc.contains(&format!("| `{reason}` |")),
            "docs/crds.md does not explain reason {reason}"
        );
    }
}

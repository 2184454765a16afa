//! Generated files must match the Rust types: `crds/*.yaml` (the CustomResourceDefinitions) and
//! the generated reference sections of `docs/crds.md`. With `KVPOOL_BLESS=1` the test rewrites
//! them instead of failing. I/O: reads and (when blessing) writes those files in the repository.

mod skip_support;

mod crd_support;

use std::path::{Path, PathBuf};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kvpool_crd::{crds, crds_yaml, render_crds};

const REGENERATE: &str = "regenerate with `KVPOOL_BLESS=1 cargo nextest run -p kvpool --test crd_drift` \
     (or `kvpool operator crd`) and commit the result";

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
    for reason in kvpool_crd::conditions::reasons::ALL {
        assert!(
            doc.contains(&format!("| `{reason}` |")),
            "docs/crds.md does not explain reason {reason}"
        );
    }
}

/// The API server only accepts structural schemas: every node says its type (or is an
/// int-or-string / preserve-unknown-fields node), there are no `$ref`s, and a node has either
/// `properties` or `additionalProperties`, never both.
#[test]
fn schemas_are_structural() {
    fn walk(s: &serde_json::Value, path: &str, problems: &mut Vec<String>) {
        let Some(map) = s.as_object() else { return };
        let flag = |k: &str| map.get(k) == Some(&serde_json::Value::Bool(true));
        if map.contains_key("$ref") {
            problems.push(format!("{path}: $ref"));
        }
        if !map.contains_key("type")
            && !flag("x-kubernetes-int-or-string")
            && !flag("x-kubernetes-preserve-unknown-fields")
        {
            problems.push(format!("{path}: no type"));
        }
        if map.contains_key("properties")
            && map
                .get("additionalProperties")
                .is_some_and(serde_json::Value::is_object)
        {
            problems.push(format!("{path}: both properties and additionalProperties"));
        }
        if let Some(props) = map.get("properties").and_then(serde_json::Value::as_object) {
            for (k, v) in props {
                walk(v, &format!("{path}.{k}"), problems);
            }
        }
        for key in ["items", "additionalProperties"] {
            if let Some(sub) = map.get(key).filter(|v| v.is_object()) {
                walk(sub, &format!("{path}[{key}]"), problems);
            }
        }
    }
    for kind in crd_support::Kind::ALL {
        let mut problems = Vec::new();
        walk(&crd_support::schema(kind), kind.name(), &mut problems);
        assert!(problems.is_empty(), "{problems:#?}");
    }
}

/// Client-side `kubectl apply` stores the object in an annotation limited to 256 KiB.
#[test]
fn crds_fit_client_side_apply() {
    for crd in crds() {
        let size = serde_json::to_vec(&crd).expect("serializes").len();
        assert!(size < 200 * 1024, "{:?} is {size} bytes", crd.metadata.name);
    }
}

/// Selectable fields must be simple paths to scalar fields of the schema.
#[test]
fn selectable_fields_point_at_scalar_fields() {
    for kind in crd_support::Kind::ALL {
        let crd = kind.crd();
        let schema = crd_support::schema(kind);
        for field in crd.spec.versions[0].selectable_fields.iter().flatten() {
            let path = field
                .json_path
                .strip_prefix('.')
                .expect("path starts with a dot");
            let mut node = &schema;
            for seg in path.split('.') {
                node = &node["properties"][seg];
            }
            let ty = node["type"].as_str();
            assert!(
                matches!(ty, Some("string" | "integer" | "boolean")),
                "{}: {path} has type {ty:?}",
                kind.name()
            );
        }
    }
}

/// The generated CRDs are valid `apiextensions.k8s.io/v1` objects for Kubernetes 1.33, checked
/// offline by `kubernetes-validate --strict` (installed by scripts/tools.sh into .tools/venv, or
/// found on PATH). Runs a child process.
#[test]
fn crds_pass_kubernetes_validate() {
    let local = repo().join(".tools/venv/bin/kubernetes-validate");
    let program = if local.is_file() {
        local
    } else if std::process::Command::new("kubernetes-validate")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        PathBuf::from("kubernetes-validate")
    } else {
        skip_support::skip("kubernetes-validate not installed (run scripts/tools.sh)");
        return;
    };
    let files: Vec<PathBuf> = render_crds()
        .expect("render")
        .into_iter()
        .map(|r| repo().join("crds").join(r.file_name))
        .collect();
    let out = std::process::Command::new(&program)
        .args(["--strict", "-k", "1.33.0"])
        .args(&files)
        .output()
        .expect("kubernetes-validate runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "kubernetes-validate failed:\n{text}");
    assert_eq!(
        text.matches(" passed for resource customresourcedefinition/")
            .count(),
        3,
        "{text}"
    );
}

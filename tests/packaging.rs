//! Packaging checks: the Helm chart (charts/kvpool), the plain manifests (deploy/) and the
//! Dockerfiles (docker/) against the operator they ship. Every rendered object must parse into
//! its Kubernetes type without losing a field and pass `kubernetes-validate --strict`; the
//! container args must parse with the operator's own CLI; the RBAC rules must equal the
//! operator's permission list; the alert rules must pass promtool under any release name; the
//! chart must install as an umbrella chart's dependency and render with the pinned helm's default
//! Kubernetes version; its README's values table must be what tests/packaging_support generates;
//! the Dockerfiles' base images must be pinnable by scripts/pin-images.sh; scripts/sbom.sh must
//! write a CycloneDX SBOM per image.
//! I/O boundary: child processes (helm, kubectl, kubernetes-validate, promtool, the scripts) and
//! files in the repository and under the test's temporary directory.
//!
//! The tools come from scripts/tools.sh (helm, kubernetes-validate, kubectl if missing,
//! cargo-cyclonedx) and scripts/deps.sh (promtool). A missing tool fails the test with the command that installs it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, Namespace, PodSpec, Secret, Service, ServiceAccount, Volume, VolumeMount,
};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kvpool::cli::{Cli, Command as KvpoolCommand};
use kvpool_operator::cli::{Command as OperatorCommand, RunArgs};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

mod packaging_support;

/// Release name and namespace that deploy/kvpool.yaml is rendered with (deploy/generate.sh).
const DEPLOY_RELEASE: &str = "kvpool";
const DEPLOY_NAMESPACE: &str = "kvpool-system";
/// The values deploy/kvpool.yaml is rendered with: the defaults, pools managed in `llm`.
const DEPLOY_VALUES: Render<'static> = Render {
    values: Some("deploy/values.yaml"),
    sets: &[],
};
/// The namespace deploy/values.yaml has the operator manage.
const DEPLOY_WATCH_NAMESPACE: &str = "llm";
/// Oldest Kubernetes version the chart installs on (`kubeVersion` in Chart.yaml); schemas are
/// checked there. The CRDs' `selectableFields` are GA from 1.32, and 1.32 is also what helm
/// 3.17 (scripts/tools.sh) assumes when it renders without a cluster. docs/install.md says why
/// the operator's client library, tested from 1.33, is expected to work there.
const KUBE_VERSION: &str = "1.32.0";
/// Path of the `kvpool` binary inside its images (docker/kvpool.Dockerfile runs the operator).
const OPERATOR_BINARY_PATH: &str = "/usr/local/bin/kvpool";
/// Example values files shipped with the chart; each one is rendered and checked.
const EXAMPLE_VALUES: &[&str] = &[
    "charts/kvpool/ci/production-values.yaml",
    "charts/kvpool/ci/namespaced-values.yaml",
];
/// The three CRDs, by name.
const CRD_NAMES: &[&str] = &[
    "decodepools.kvpool.dev",
    "kvcachepools.kvpool.dev",
    "prefillpools.kvpool.dev",
];

// ---------------------------------------------------------------------------------------------
// Tools and files

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// A fresh directory for one test's files, under cargo's per-target temporary directory.
fn scratch_dir(test: &str) -> Result<PathBuf> {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("packaging")
        .join(test);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// Finds a tool: the copy scripts/tools.sh installed under .tools/ first, then PATH. A missing
/// tool is an error that says how to install it; the tests never pass without their tools.
fn tool(name: &str) -> Result<PathBuf> {
    let root = repo_root();
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")));
    let local = match name {
        "kubernetes-validate" => vec![root.join(".tools/venv/bin/kubernetes-validate")],
        "helm" | "kubectl" => vec![root.join(".tools/bin").join(name)],
        // Where `cargo install` puts it and `cargo cyclonedx` looks for it.
        "cargo-cyclonedx" => cargo_home
            .into_iter()
            .map(|h| h.join("bin").join(name))
            .collect(),
        _ => vec![],
    };
    if let Some(found) = local
        .into_iter()
        .find(|p| p.is_file())
        .or_else(|| on_path(name))
    {
        return Ok(found);
    }
    let install = match name {
        "promtool" => "scripts/deps.sh (Debian package prometheus)",
        _ => "scripts/tools.sh",
    };
    bail!("{name} not found in .tools/ or on PATH: run {install} from the repository root")
}

struct Output {
    ok: bool,
    stdout: String,
    stderr: String,
}

fn run_tool(name: &str, args: &[&str]) -> Result<Output> {
    let program = tool(name)?;
    let out = Command::new(&program)
        .args(args)
        .current_dir(repo_root())
        .output()
        .with_context(|| format!("starting {}", program.display()))?;
    Ok(Output {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// Runs a tool and returns its stdout; a non-zero exit is an error carrying both outputs.
fn run_ok(name: &str, args: &[&str]) -> Result<String> {
    let out = run_tool(name, args)?;
    ensure!(
        out.ok,
        "{name} {} failed\nstdout:\n{}\nstderr:\n{}",
        args.join(" "),
        out.stdout,
        out.stderr
    );
    Ok(out.stdout)
}

fn read(rel: &str) -> Result<String> {
    let path = repo_root().join(rel);
    std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}

/// The CustomResourceDefinition files directly inside `rel` (other YAML, such as a
/// kustomization.yaml, is skipped), by file name.
fn crd_files(rel: &str) -> Result<BTreeMap<String, String>> {
    let dir = repo_root().join(rel);
    let mut files = BTreeMap::new();
    if !dir.exists() {
        return Ok(files);
    }
    for entry in std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            if text.lines().any(|l| l == "kind: CustomResourceDefinition") {
                files.insert(name, text);
            }
        }
    }
    Ok(files)
}

// ---------------------------------------------------------------------------------------------
// Rendering and parsing

/// One way of rendering the chart: optional values file plus `--set` overrides.
#[derive(Clone, Copy, Debug)]
struct Render<'a> {
    values: Option<&'a str>,
    sets: &'a [&'a str],
}

const DEFAULTS: Render<'static> = Render {
    values: None,
    sets: &[],
};

/// The opt-in cluster scope: a ClusterRole instead of a Role, all namespaces watched.
const CLUSTER_SCOPE: Render<'static> = Render {
    values: None,
    sets: &["rbac.scope=cluster"],
};

/// Two agent ServiceAccounts with Node access, and so the admission policy that narrows it.
const AGENT_NODE_ACCESS: Render<'static> = Render {
    values: None,
    sets: &[
        "agentNodeAccess.serviceAccounts[0].namespace=llm",
        "agentNodeAccess.serviceAccounts[0].name=kvpool-agent",
        "agentNodeAccess.serviceAccounts[1].namespace=ml",
        "agentNodeAccess.serviceAccounts[1].name=agents",
    ],
};

/// Every rendering the object checks cover: defaults, each example file, and the optional
/// templates switched on one at a time over the defaults.
fn renders() -> Vec<Render<'static>> {
    let mut all = vec![DEFAULTS];
    all.extend(EXAMPLE_VALUES.iter().map(|v| Render {
        values: Some(v),
        sets: &[],
    }));
    all.push(CLUSTER_SCOPE);
    all.push(DEPLOY_VALUES);
    all.push(Render {
        values: None,
        sets: &[
            "metrics.serviceMonitor.enabled=true",
            "metrics.prometheusRule.enabled=true",
            "metrics.dashboard.enabled=true",
            "metrics.podMonitors.enabled=true",
            "operator.leaderElection.enabled=true",
            "crds.keep=false",
        ],
    });
    all
}

fn helm_args<'a>(render: &Render<'a>) -> Vec<&'a str> {
    helm_args_as(DEPLOY_RELEASE, DEPLOY_NAMESPACE, render)
}

fn helm_args_as<'a>(release: &'a str, namespace: &'a str, render: &Render<'a>) -> Vec<&'a str> {
    let mut args = vec![
        "template",
        release,
        "charts/kvpool",
        "--namespace",
        namespace,
        "--kube-version",
        KUBE_VERSION,
    ];
    if let Some(values) = render.values {
        args.extend(["--values", values]);
    }
    for set in render.sets {
        args.extend(["--set", set]);
    }
    args
}

fn helm_template(render: &Render<'_>) -> Result<String> {
    run_ok("helm", &helm_args(render))
}

/// Splits a multi-document YAML stream into JSON values, dropping empty documents.
fn parse_docs(yaml: &str) -> Result<Vec<Value>> {
    let docs: Vec<Value> = serde_saphyr::from_multiple(yaml).context("parsing YAML stream")?;
    Ok(docs.into_iter().filter(|d| !d.is_null()).collect())
}

fn str_at<'v>(doc: &'v Value, pointer: &str) -> &'v str {
    doc.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

fn describe(doc: &Value) -> String {
    format!(
        "{} {}/{}",
        str_at(doc, "/kind"),
        str_at(doc, "/metadata/namespace"),
        str_at(doc, "/metadata/name")
    )
}

/// First place where two JSON values differ, as a JSON pointer with both sides. Numbers compare
/// by value (a schema's `maximum: 1024` comes back from its f64 field as `1024.0`).
fn first_difference(a: &Value, b: &Value, path: &str) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for (key, l) in x {
                let here = format!("{path}/{key}");
                match y.get(key) {
                    Some(r) => {
                        if let Some(d) = first_difference(l, r, &here) {
                            return Some(d);
                        }
                    }
                    None => return Some(format!("{here}: {l} is lost")),
                }
            }
            y.iter()
                .find(|(key, _)| !x.contains_key(*key))
                .map(|(key, r)| format!("{path}/{key}: {r} appears"))
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (l, r))| first_difference(l, r, &format!("{path}/{i}"))),
        (Value::Number(x), Value::Number(y)) if x.as_f64() == y.as_f64() => None,
        _ if a == b => None,
        _ => Some(format!("{path}: {a} vs {b}")),
    }
}

/// Parses `doc` into `T` and back: a field the type does not know is dropped on the way, so a
/// difference means a misspelt or misplaced field (k8s-openapi types ignore unknown fields).
fn round_trip<T: DeserializeOwned + Serialize>(doc: &Value) -> Result<T> {
    let typed: T = serde_json::from_value(doc.clone())
        .with_context(|| format!("{} does not parse into its type", describe(doc)))?;
    let back = serde_json::to_value(&typed)?;
    if let Some(diff) = first_difference(doc, &back, "") {
        bail!(
            "{} changes in a round trip through its type (unknown or misplaced field?): {diff}",
            describe(doc)
        );
    }
    Ok(typed)
}

// The Prometheus Operator's kinds are not in k8s-openapi; these mirror the fields of
// monitoring.coreos.com/v1 that the chart uses and refuse any other field.

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ServiceMonitor {
    api_version: String,
    kind: String,
    metadata: ObjectMeta,
    spec: ServiceMonitorSpec,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ServiceMonitorSpec {
    selector: LabelSelector,
    namespace_selector: NamespaceSelector,
    endpoints: Vec<ScrapeEndpoint>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct NamespaceSelector {
    match_names: Vec<String>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct ScrapeEndpoint {
    port: String,
    path: String,
    scheme: String,
    interval: String,
    scrape_timeout: String,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PrometheusRule {
    api_version: String,
    kind: String,
    metadata: ObjectMeta,
    spec: RuleFile,
}

/// Also the layout of a Prometheus rule file, which promtool checks.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RuleFile {
    groups: Vec<RuleGroup>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RuleGroup {
    name: String,
    rules: Vec<AlertRule>,
}

/// An alerting rule (`alert`, `for`, labels, annotations) or a recording rule (`record`).
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct AlertRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    alert: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    record: Option<String>,
    expr: String,
    #[serde(rename = "for", default, skip_serializing_if = "Option::is_none")]
    for_duration: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    annotations: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PodMonitor {
    api_version: String,
    kind: String,
    metadata: ObjectMeta,
    spec: PodMonitorSpec,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PodMonitorSpec {
    selector: LabelSelector,
    namespace_selector: PodNamespaceSelector,
    pod_metrics_endpoints: Vec<PodMetricsEndpoint>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PodNamespaceSelector {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    any: Option<bool>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    match_names: Vec<String>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PodMetricsEndpoint {
    port: String,
    path: String,
    scheme: String,
    interval: String,
    scrape_timeout: String,
    relabelings: Vec<Relabeling>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Relabeling {
    source_labels: Vec<String>,
    target_label: String,
}

/// Every object a render may contain, typed. Short-lived test values, so variant sizes do not
/// matter.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
enum Object {
    Namespace,
    ServiceAccount(ServiceAccount),
    Service(Service),
    ConfigMap(ConfigMap),
    Secret(Secret),
    Deployment(Box<Deployment>),
    PodDisruptionBudget(PodDisruptionBudget),
    ClusterRole(ClusterRole),
    ClusterRoleBinding(ClusterRoleBinding),
    Role(Role),
    RoleBinding(RoleBinding),
    Crd(Box<CustomResourceDefinition>),
    ServiceMonitor(ServiceMonitor),
    PodMonitor(PodMonitor),
    PrometheusRule(PrometheusRule),
    AdmissionPolicy(Box<ValidatingAdmissionPolicy>),
    AdmissionPolicyBinding(ValidatingAdmissionPolicyBinding),
}

fn typed(doc: &Value) -> Result<Object> {
    let api_version = str_at(doc, "/apiVersion");
    let kind = str_at(doc, "/kind");
    Ok(match (api_version, kind) {
        ("v1", "Namespace") => {
            round_trip::<Namespace>(doc)?;
            Object::Namespace
        }
        ("v1", "ServiceAccount") => Object::ServiceAccount(round_trip(doc)?),
        ("v1", "Service") => Object::Service(round_trip(doc)?),
        ("v1", "ConfigMap") => Object::ConfigMap(round_trip(doc)?),
        ("v1", "Secret") => Object::Secret(round_trip(doc)?),
        ("apps/v1", "Deployment") => Object::Deployment(Box::new(round_trip(doc)?)),
        ("policy/v1", "PodDisruptionBudget") => Object::PodDisruptionBudget(round_trip(doc)?),
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => Object::ClusterRole(round_trip(doc)?),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            Object::ClusterRoleBinding(round_trip(doc)?)
        }
        ("rbac.authorization.k8s.io/v1", "Role") => Object::Role(round_trip(doc)?),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => Object::RoleBinding(round_trip(doc)?),
        ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => {
            Object::Crd(Box::new(round_trip(doc)?))
        }
        ("monitoring.coreos.com/v1", "ServiceMonitor") => Object::ServiceMonitor(round_trip(doc)?),
        ("monitoring.coreos.com/v1", "PodMonitor") => Object::PodMonitor(round_trip(doc)?),
        ("monitoring.coreos.com/v1", "PrometheusRule") => Object::PrometheusRule(round_trip(doc)?),
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy") => {
            Object::AdmissionPolicy(Box::new(round_trip(doc)?))
        }
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding") => {
            Object::AdmissionPolicyBinding(round_trip(doc)?)
        }
        _ => bail!("unexpected object {api_version} {kind} ({})", describe(doc)),
    })
}

/// The chart with the production example's values.
const PRODUCTION: Render<'static> = Render {
    values: Some("charts/kvpool/ci/production-values.yaml"),
    sets: &[],
};

/// Renders, parses and types one rendering; also returns the raw YAML.
fn render_objects(render: &Render<'_>) -> Result<(String, Vec<Object>)> {
    render_objects_as(DEPLOY_RELEASE, DEPLOY_NAMESPACE, render)
}

/// [`render_objects`] under another release name and namespace.
fn render_objects_as(
    release: &str,
    namespace: &str,
    render: &Render<'_>,
) -> Result<(String, Vec<Object>)> {
    let yaml = run_ok("helm", &helm_args_as(release, namespace, render))?;
    let objects = parse_docs(&yaml)?
        .iter()
        .map(typed)
        .collect::<Result<Vec<_>>>()
        .with_context(|| format!("rendering {render:?}"))?;
    Ok((yaml, objects))
}

/// Runs `kubernetes-validate --strict` for Kubernetes [`KUBE_VERSION`] over a YAML stream.
fn kubernetes_validate(test: &str, label: &str, yaml: &str) -> Result<()> {
    let dir = scratch_dir(test)?;
    let file = dir.join(format!("{label}.yaml"));
    std::fs::write(&file, yaml)?;
    let file = file.to_string_lossy().into_owned();
    let out = run_tool(
        "kubernetes-validate",
        &["--strict", "-k", KUBE_VERSION, "--quiet", &file],
    )?;
    ensure!(
        out.ok && !out.stdout.contains("ERROR") && !out.stderr.contains("ERROR"),
        "kubernetes-validate rejected {label}:\n{}{}",
        out.stdout,
        out.stderr
    );
    Ok(())
}

/// The rendered objects of one variant of [`Object`] (a variant holding the typed object), in
/// render order.
macro_rules! objects_of {
    ($objects:expr, $variant:path) => {
        $objects.iter().filter_map(|o| match o {
            $variant(x) => Some(x),
            _ => None,
        })
    };
}

fn deployments(objects: &[Object]) -> Vec<&Deployment> {
    objects_of!(objects, Object::Deployment)
        .map(Box::as_ref)
        .collect()
}

/// `KVPOOL_BLESS=1` (the project's convention for generated files) makes the drift tests
/// rewrite the derived files instead of failing.
fn blessing() -> bool {
    std::env::var("KVPOOL_BLESS").is_ok_and(|v| v == "1")
}

const REGENERATE: &str = "run deploy/generate.sh, or \
    KVPOOL_BLESS=1 cargo nextest run -p kvpool --test packaging";

fn write_atomically(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

/// What deploy/generate.sh does: copy the CRD files and LICENSE into the chart, render
/// deploy/kvpool.yaml.
fn regenerate() -> Result<()> {
    let root = repo_root();
    write_atomically(&root.join("charts/kvpool/LICENSE"), &read("LICENSE")?)?;
    let chart_crds = root.join("charts/kvpool/files/crds");
    let generated = crd_files("crds")?;
    // Overwrite in place and remove only what crds/ no longer has, so that a test running at
    // the same time never sees a file missing.
    for name in crd_files("charts/kvpool/files/crds")?.keys() {
        if !generated.contains_key(name) {
            match std::fs::remove_file(chart_crds.join(name)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
                _ => {}
            }
        }
    }
    for (name, text) in &generated {
        write_atomically(&chart_crds.join(name), text)?;
    }
    write_atomically(
        &root.join("deploy/kvpool.yaml"),
        &helm_template(&DEPLOY_VALUES)?,
    )
}

// ---------------------------------------------------------------------------------------------
// Tests

#[test]
fn helm_lint_passes_with_default_and_example_values() -> Result<()> {
    let lint = [
        "lint",
        "--strict",
        "charts/kvpool",
        "--kube-version",
        KUBE_VERSION,
    ];
    run_ok("helm", &lint)?;
    for values in EXAMPLE_VALUES {
        run_ok("helm", &[&lint[..], &["--values", values]].concat())?;
    }
    Ok(())
}

#[test]
fn every_rendered_object_is_a_valid_kubernetes_object() -> Result<()> {
    for (i, render) in renders().iter().enumerate() {
        let (yaml, objects) = render_objects(render)?;
        ensure!(!objects.is_empty(), "{render:?} rendered nothing");
        kubernetes_validate(
            "every_rendered_object_is_a_valid_kubernetes_object",
            &format!("render-{i}"),
            &yaml,
        )
        .with_context(|| format!("{render:?}"))?;
        // Cluster-scoped kinds carry no namespace; namespaced ones land in the release
        // namespace, except what the values place elsewhere on purpose: the operator's Role
        // and RoleBinding in the watched namespace, the dashboard in Grafana's namespace.
        for doc in parse_docs(&yaml)? {
            let kind = str_at(&doc, "/kind");
            let name = str_at(&doc, "/metadata/name");
            let namespace = str_at(&doc, "/metadata/namespace");
            let expected = match kind {
                "ClusterRole" | "ClusterRoleBinding" | "CustomResourceDefinition" => "",
                "Role" | "RoleBinding"
                    if name == "kvpool-operator"
                        && render.values == Some("charts/kvpool/ci/namespaced-values.yaml") =>
                {
                    "ml-serving"
                }
                "Role" | "RoleBinding"
                    if name == "kvpool-operator" && render.values == DEPLOY_VALUES.values =>
                {
                    DEPLOY_WATCH_NAMESPACE
                }
                "ConfigMap"
                    if name.ends_with("-dashboard")
                        && render.values == Some("charts/kvpool/ci/production-values.yaml") =>
                {
                    "monitoring"
                }
                _ => DEPLOY_NAMESPACE,
            };
            ensure!(
                namespace == expected,
                "{render:?}: {kind} {name} is in namespace {namespace:?}, expected {expected:?}"
            );
        }
    }
    Ok(())
}

#[test]
fn default_render_holds_exactly_the_expected_objects() -> Result<()> {
    let (_, objects) = render_objects(&DEFAULTS)?;
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for object in &objects {
        let kind = match object {
            Object::Namespace => "Namespace",
            Object::ServiceAccount(_) => "ServiceAccount",
            Object::Service(_) => "Service",
            Object::ConfigMap(_) => "ConfigMap",
            Object::Secret(_) => "Secret",
            Object::Deployment(_) => "Deployment",
            Object::PodDisruptionBudget(_) => "PodDisruptionBudget",
            Object::ClusterRole(_) => "ClusterRole",
            Object::ClusterRoleBinding(_) => "ClusterRoleBinding",
            Object::Role(_) => "Role",
            Object::RoleBinding(_) => "RoleBinding",
            Object::Crd(_) => "CustomResourceDefinition",
            Object::ServiceMonitor(_) => "ServiceMonitor",
            Object::PodMonitor(_) => "PodMonitor",
            Object::PrometheusRule(_) => "PrometheusRule",
            Object::AdmissionPolicy(_) => "ValidatingAdmissionPolicy",
            Object::AdmissionPolicyBinding(_) => "ValidatingAdmissionPolicyBinding",
        };
        *kinds.entry(kind).or_default() += 1;
    }
    let crds = crd_files("crds")?.len();
    let mut expected = BTreeMap::from([
        ("ServiceAccount", 1),
        // The metrics Service and the agent credential issuer's.
        ("Service", 2),
        ("Deployment", 1),
        // Namespace scope by default: the operator's Role and RoleBinding, and those of its root
        // key Secret; two ClusterRoles are the aggregated view and edit roles, bound to
        // nobody; the third, bound, lets the agent credential issuer create TokenReviews.
        ("Role", 2),
        ("RoleBinding", 2),
        ("ClusterRole", 3),
        ("ClusterRoleBinding", 1),
    ]);
    if crds > 0 {
        expected.insert("CustomResourceDefinition", crds);
    }
    assert_eq!(kinds, expected, "objects in the default render");

    // The operator pod: non-root, read-only root filesystem, no capabilities, probes on the
    // admin endpoints, resources set.
    let deployment = deployments(&objects)[0];
    let pod = pod_spec(deployment)?;
    let pod_security = pod
        .security_context
        .as_ref()
        .context("no pod securityContext")?;
    assert_eq!(pod_security.run_as_non_root, Some(true));
    let container = &pod.containers[0];
    let security = container
        .security_context
        .as_ref()
        .context("no securityContext")?;
    assert_eq!(security.allow_privilege_escalation, Some(false));
    assert_eq!(security.read_only_root_filesystem, Some(true));
    let dropped = security
        .capabilities
        .as_ref()
        .and_then(|c| c.drop.clone())
        .unwrap_or_default();
    assert_eq!(dropped, vec!["ALL".to_owned()]);
    let probe_path = |probe: &Option<k8s_openapi::api::core::v1::Probe>| {
        probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .and_then(|h| h.path.clone())
    };
    assert_eq!(
        probe_path(&container.liveness_probe).as_deref(),
        Some("/livez")
    );
    assert_eq!(
        probe_path(&container.readiness_probe).as_deref(),
        Some("/readyz")
    );
    let resources = container.resources.as_ref().context("no resources")?;
    assert!(
        resources
            .requests
            .as_ref()
            .is_some_and(|r| r.contains_key("memory"))
    );
    assert!(
        resources
            .limits
            .as_ref()
            .is_some_and(|r| r.contains_key("memory"))
    );
    Ok(())
}

#[test]
fn chart_crds_are_copies_of_the_generated_crds() -> Result<()> {
    if blessing() {
        regenerate()?;
    }
    let generated = crd_files("crds")?;
    let in_chart = crd_files("charts/kvpool/files/crds")?;
    let stale: Vec<&String> = generated
        .keys()
        .chain(in_chart.keys())
        .filter(|name| generated.get(*name) != in_chart.get(*name))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    ensure!(
        stale.is_empty(),
        "charts/kvpool/files/crds/ differs from crds/ in {stale:?}: {REGENERATE}"
    );
    if generated.is_empty() {
        return Ok(());
    }
    // Rendered with crds.install (the default) they appear with the keep policy; without it,
    // not at all.
    let (_, objects) = render_objects(&DEFAULTS)?;
    let crds: Vec<&CustomResourceDefinition> =
        objects_of!(objects, Object::Crd).map(Box::as_ref).collect();
    let names: BTreeSet<&str> = crds
        .iter()
        .filter_map(|c| c.metadata.name.as_deref())
        .collect();
    assert_eq!(names, CRD_NAMES.iter().copied().collect::<BTreeSet<_>>());
    for crd in &crds {
        let keep = crd
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("helm.sh/resource-policy"));
        assert_eq!(
            keep.map(String::as_str),
            Some("keep"),
            "{:?}",
            crd.metadata.name
        );
    }
    let (_, objects) = render_objects(&Render {
        values: None,
        sets: &["crds.install=false"],
    })?;
    assert!(!objects.iter().any(|o| matches!(o, Object::Crd(_))));
    Ok(())
}

#[test]
fn deploy_manifests_equal_the_chart_rendered_with_defaults() -> Result<()> {
    if blessing() {
        regenerate()?;
    }
    let rendered = helm_template(&DEPLOY_VALUES)?;
    let committed = read("deploy/kvpool.yaml")?;
    if rendered != committed {
        let line = rendered
            .lines()
            .zip(committed.lines())
            .position(|(a, b)| a != b)
            .map_or_else(|| "length".to_owned(), |i| format!("line {}", i + 1));
        bail!(
            "deploy/kvpool.yaml differs from the chart with deploy/values.yaml ({line}): {REGENERATE}"
        );
    }
    // The operator it installs manages the pools of one namespace, which deploy/ creates with a
    // Pod Security level that admits the agent; the operator's own namespace stays restricted.
    let (_, objects) = render_objects(&DEPLOY_VALUES)?;
    let (run, _) = parse_operator_args(deployments(&objects)[0])?;
    assert_eq!(run.namespace, DEPLOY_WATCH_NAMESPACE);
    let namespaces: BTreeMap<String, String> = parse_docs(&read("deploy/namespace.yaml")?)?
        .iter()
        .map(|d| {
            (
                str_at(d, "/metadata/name").to_owned(),
                str_at(d, "/metadata/labels/pod-security.kubernetes.io~1enforce").to_owned(),
            )
        })
        .collect();
    assert_eq!(
        namespaces,
        BTreeMap::from([
            (DEPLOY_NAMESPACE.to_owned(), "restricted".to_owned()),
            (DEPLOY_WATCH_NAMESPACE.to_owned(), "privileged".to_owned()),
        ])
    );
    Ok(())
}

#[test]
fn kustomize_installs_namespace_crds_and_operator() -> Result<()> {
    let yaml = run_ok("kubectl", &["kustomize", "deploy/"])?;
    let docs = parse_docs(&yaml)?;
    for doc in &docs {
        typed(doc)?;
    }
    kubernetes_validate(
        "kustomize_installs_namespace_crds_and_operator",
        "kustomize",
        &yaml,
    )?;
    let got: BTreeSet<(String, String)> = docs
        .iter()
        .map(|d| {
            (
                str_at(d, "/kind").to_owned(),
                str_at(d, "/metadata/name").to_owned(),
            )
        })
        .collect();
    let mut expected: BTreeSet<(String, String)> = parse_docs(&helm_template(&DEPLOY_VALUES)?)?
        .iter()
        .map(|d| {
            (
                str_at(d, "/kind").to_owned(),
                str_at(d, "/metadata/name").to_owned(),
            )
        })
        .collect();
    expected.insert(("Namespace".to_owned(), DEPLOY_NAMESPACE.to_owned()));
    expected.insert(("Namespace".to_owned(), DEPLOY_WATCH_NAMESPACE.to_owned()));
    assert_eq!(got, expected);
    // The namespaces are created before anything is put into them.
    assert_eq!(str_at(&docs[0], "/kind"), "Namespace");
    assert_eq!(str_at(&docs[1], "/kind"), "Namespace");
    Ok(())
}

/// The pod spec of a deployment's template.
fn pod_spec(deployment: &Deployment) -> Result<&PodSpec> {
    deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .context("deployment without a pod spec")
}

/// The pod's volume `name` and the first container's mount of it, which must be read-only.
fn read_only_volume<'a>(pod: &'a PodSpec, name: &str) -> Result<(&'a Volume, &'a VolumeMount)> {
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == name)
        .with_context(|| format!("no {name} volume"))?;
    let mount = pod.containers[0]
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == name)
        .with_context(|| format!("no {name} mount"))?;
    assert_eq!(mount.read_only, Some(true), "{name} mounted read-only");
    Ok((volume, mount))
}

/// Parses a container's command line with the operator's CLI; it must be `run`.
fn parse_operator_args(deployment: &Deployment) -> Result<(RunArgs, u16)> {
    let pod = pod_spec(deployment)?;
    ensure!(pod.containers.len() == 1, "one container expected");
    let container = &pod.containers[0];
    assert_eq!(
        container.command.as_deref(),
        Some(&[OPERATOR_BINARY_PATH.to_owned()][..]),
        "the chart must run the binary where docker/kvpool.Dockerfile puts it"
    );
    let mut argv = vec!["kvpool".to_owned()];
    argv.extend(container.args.clone().unwrap_or_default());
    let cli = Cli::try_parse_from(&argv)
        .with_context(|| format!("kvpool rejects the chart's args {argv:?}"))?;
    let KvpoolCommand::Operator(OperatorCommand::Run(run)) = cli.command else {
        bail!("the chart must start `kvpool operator run`, got {argv:?}");
    };
    let admin_port = container
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("admin"))
        .context("no port named admin")?
        .container_port;
    Ok((run, u16::try_from(admin_port)?))
}

#[test]
fn container_args_parse_with_the_operator_cli() -> Result<()> {
    for render in renders() {
        let (_, objects) = render_objects(&render)?;
        let [deployment] = deployments(&objects)[..] else {
            bail!("{render:?}: one Deployment expected");
        };
        let (run, admin_port) = parse_operator_args(deployment)?;
        assert_eq!(run.admin_addr.port(), admin_port, "{render:?}: admin port");
        assert_eq!(
            run.leader_election_namespace, DEPLOY_NAMESPACE,
            "the Lease lives in the release namespace"
        );
        // Leader election is on exactly when the Lease Role is rendered, for the same Lease.
        let lease_role = objects_of!(objects, Object::Role).find(|r| {
            r.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.ends_with("-leader-election"))
        });
        assert_eq!(run.leader_elect, lease_role.is_some(), "{render:?}");
        if let Some(role) = lease_role {
            let named: Vec<String> = role
                .rules
                .iter()
                .flatten()
                .flat_map(|r| r.resource_names.clone().unwrap_or_default())
                .collect();
            assert_eq!(named, vec![run.leader_election_lease.clone()], "{render:?}");
        }
        // A namespaced install watches exactly the namespace its Role is in.
        let operator_role = objects_of!(objects, Object::Role)
            .find(|r| r.metadata.name.as_deref() == Some("kvpool-operator"));
        match operator_role {
            Some(role) => assert_eq!(
                Some(run.namespace.as_str()),
                role.metadata.namespace.as_deref()
            ),
            None => assert_eq!(run.namespace, "", "{render:?}: cluster scope watches all"),
        }
        for image in [&run.agent_image, &run.master_image, &run.conductor_image] {
            ensure!(
                image.contains(':') || image.contains('@'),
                "untagged image {image}"
            );
        }
    }
    // With default values the workload images equal the operator's own defaults, so the chart
    // and a bare `kvpool operator run` deploy the same thing.
    let (_, objects) = render_objects(&DEFAULTS)?;
    let (run, _) = parse_operator_args(deployments(&objects)[0])?;
    let Ok(bare) = Cli::try_parse_from(["kvpool", "operator", "run", "--root-key-file", "/k"])
    else {
        bail!("`kvpool operator run --root-key-file /k` without other flags must parse");
    };
    let KvpoolCommand::Operator(OperatorCommand::Run(bare)) = bare.command else {
        bail!("expected run");
    };
    assert_eq!(run.agent_image, bare.agent_image);
    assert_eq!(run.master_image, bare.master_image);
    assert_eq!(run.conductor_image, bare.conductor_image);
    Ok(())
}

type Triple = (String, String, String);

/// Expands RBAC rules into (group, resource, verb) triples. Wildcards are refused outright.
fn triples(rules: &[PolicyRule]) -> Result<BTreeSet<Triple>> {
    let mut out = BTreeSet::new();
    for rule in rules {
        ensure!(
            rule.non_resource_urls.is_none(),
            "non-resource URL rule: {rule:?}"
        );
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    ensure!(
                        group != "*" && resource != "*" && verb != "*",
                        "wildcard in {rule:?}"
                    );
                    out.insert((group.clone(), resource.clone(), verb.clone()));
                }
            }
        }
    }
    Ok(out)
}

fn operator_permissions(leases: bool, root_key_secret: bool, issuer: bool) -> BTreeSet<Triple> {
    let root_key = if root_key_secret {
        kvpool_operator::rbac::root_key_permissions()
    } else {
        Vec::new()
    };
    let issuer = if issuer {
        kvpool_operator::rbac::agent_issuer_permissions()
    } else {
        Vec::new()
    };
    kvpool_operator::rbac::permissions()
        .into_iter()
        .filter(|(group, _, _)| leases || *group != "coordination.k8s.io")
        .chain(root_key)
        .chain(issuer)
        .map(|(g, r, v)| (g.to_owned(), r.to_owned(), v.to_owned()))
        .collect()
}

/// A Role or ClusterRole: (kind, namespace, name).
type RoleKey = (String, String, String);

/// The RBAC objects of one render, split by whom they serve.
struct RenderedRbac {
    /// What each role bound to the operator's ServiceAccount grants.
    operator: BTreeMap<RoleKey, BTreeSet<Triple>>,
    /// The aggregated ClusterRoles (bound to nobody by the chart): name to their
    /// `aggregate-to-*` targets and grants.
    aggregated: BTreeMap<String, (BTreeSet<String>, BTreeSet<Triple>)>,
}

const AGGREGATE_PREFIX: &str = "rbac.authorization.k8s.io/aggregate-to-";

/// Sorts a render's RBAC objects: every binding names the operator's ServiceAccount and an
/// existing role; every role is either bound to it or an unbound aggregated ClusterRole.
fn rendered_rbac(render: &Render<'_>, objects: &[Object]) -> Result<RenderedRbac> {
    let account = pod_spec(deployments(objects)[0])?
        .service_account_name
        .clone()
        .context("no serviceAccountName")?;
    let mut bound = BTreeSet::new();
    for object in objects {
        let (namespace, role_ref, subjects) = match object {
            Object::ClusterRoleBinding(b) => (String::new(), &b.role_ref, &b.subjects),
            Object::RoleBinding(b) => (
                b.metadata.namespace.clone().unwrap_or_default(),
                &b.role_ref,
                &b.subjects,
            ),
            _ => continue,
        };
        let subjects = subjects.clone().unwrap_or_default();
        assert_eq!(subjects.len(), 1, "{render:?}");
        assert_eq!(subjects[0].kind, "ServiceAccount");
        assert_eq!(subjects[0].name, account);
        assert_eq!(subjects[0].namespace.as_deref(), Some(DEPLOY_NAMESPACE));
        // A RoleBinding to a Role points into its own namespace.
        let role_namespace = if role_ref.kind == "Role" {
            namespace
        } else {
            String::new()
        };
        bound.insert((role_ref.kind.clone(), role_namespace, role_ref.name.clone()));
    }
    let mut operator = BTreeMap::new();
    let mut aggregated = BTreeMap::new();
    for object in objects {
        let (key, meta, rules) = match object {
            Object::ClusterRole(r) => (
                (
                    "ClusterRole".to_owned(),
                    String::new(),
                    r.metadata.name.clone().unwrap_or_default(),
                ),
                &r.metadata,
                &r.rules,
            ),
            Object::Role(r) => (
                (
                    "Role".to_owned(),
                    r.metadata.namespace.clone().unwrap_or_default(),
                    r.metadata.name.clone().unwrap_or_default(),
                ),
                &r.metadata,
                &r.rules,
            ),
            _ => continue,
        };
        let grants = triples(&rules.clone().unwrap_or_default())?;
        let targets: BTreeSet<String> = meta
            .labels
            .iter()
            .flatten()
            .filter(|(_, v)| v.as_str() == "true")
            .filter_map(|(k, _)| k.strip_prefix(AGGREGATE_PREFIX).map(str::to_owned))
            .collect();
        if targets.is_empty() {
            ensure!(bound.remove(&key), "{render:?}: {key:?} is bound to nobody");
            operator.insert(key, grants);
        } else {
            ensure!(
                key.0 == "ClusterRole" && !bound.contains(&key),
                "{render:?}: aggregated role {key:?} must be an unbound ClusterRole"
            );
            aggregated.insert(key.2, (targets, grants));
        }
    }
    ensure!(
        bound.is_empty(),
        "{render:?}: bindings to missing roles {bound:?}"
    );
    Ok(RenderedRbac {
        operator,
        aggregated,
    })
}

#[test]
fn rbac_grants_exactly_what_the_operator_uses() -> Result<()> {
    for render in renders() {
        let (_, objects) = render_objects(&render)?;
        let rbac = rendered_rbac(&render, &objects)?;
        let granted: BTreeSet<Triple> = rbac.operator.values().flatten().cloned().collect();
        let (run, _) = parse_operator_args(deployments(&objects)[0])?;
        assert_eq!(
            granted,
            operator_permissions(
                run.leader_elect,
                run.root_key_secret.is_some(),
                run.agent_issuer_url.is_some()
            ),
            "{render:?}: granted vs used (operator/src/rbac.rs)"
        );
        // The aggregated roles give people access to the three kinds and nothing else.
        for (name, (_, grants)) in &rbac.aggregated {
            ensure!(
                grants.iter().all(|(g, _, _)| g == "kvpool.dev"),
                "{render:?}: {name} grants outside kvpool.dev: {grants:?}"
            );
        }
    }
    Ok(())
}

/// The permissions table of docs/install.md ("### Permissions"): for each row, its first cell
/// (`operator`, `leader election`, `view`, `edit`) and the triples of its group, resources and
/// verbs columns (backquoted words; `core` is the core group).
fn documented_permissions() -> Result<BTreeMap<String, BTreeSet<Triple>>> {
    let doc = read("docs/install.md")?;
    let section = doc
        .split("\n### Permissions\n")
        .nth(1)
        .context("docs/install.md has no '### Permissions' section")?;
    let ticked = |cell: &str| -> Vec<String> {
        cell.split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect()
    };
    let mut table: BTreeMap<String, BTreeSet<Triple>> = BTreeMap::new();
    for line in section
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
    {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        let [who, group, resources, verbs, ..] = cells[..] else {
            bail!("docs/install.md: short permissions row {line:?}");
        };
        let group = if group == "core" {
            String::new()
        } else {
            ticked(group).concat()
        };
        let rows = table.entry(who.to_owned()).or_default();
        for resource in ticked(resources) {
            for verb in ticked(verbs) {
                rows.insert((group.clone(), resource.clone(), verb));
            }
        }
    }
    ensure!(
        !table.is_empty(),
        "docs/install.md: empty permissions table"
    );
    Ok(table)
}

/// The operator's metrics Service (the chart also renders the agent issuer's).
fn is_metrics_service(s: &k8s_openapi::api::core::v1::Service) -> bool {
    s.metadata
        .name
        .as_deref()
        .is_some_and(|n| n.ends_with("-metrics"))
}

/// Resources without a namespace that the operator must never be granted.
const CLUSTER_SCOPED: &[&str] = &[
    "namespaces",
    "nodes",
    "persistentvolumes",
    "clusterroles",
    "clusterrolebindings",
    "customresourcedefinitions",
    "validatingwebhookconfigurations",
    "mutatingwebhookconfigurations",
];

#[test]
fn install_doc_states_exactly_the_rbac_the_chart_renders() -> Result<()> {
    let doc = documented_permissions()?;
    let row = |who: &str| doc.get(who).cloned().unwrap_or_default();
    ensure!(
        doc.keys().map(String::as_str).collect::<BTreeSet<_>>()
            == BTreeSet::from([
                "agent issuer",
                "edit",
                "leader election",
                "operator",
                "root key",
                "view"
            ]),
        "docs/install.md permission rows are for {:?}",
        doc.keys()
    );
    let leader = Render {
        values: None,
        sets: &["operator.leaderElection.enabled=true"],
    };
    let lease_role = (
        "Role".to_owned(),
        DEPLOY_NAMESPACE.to_owned(),
        "kvpool-operator-leader-election".to_owned(),
    );
    for (render, operator_role) in [
        (DEFAULTS, ("Role", DEPLOY_NAMESPACE)),
        (leader, ("Role", DEPLOY_NAMESPACE)),
        (CLUSTER_SCOPE, ("ClusterRole", "")),
    ] {
        let (_, objects) = render_objects(&render)?;
        let rbac = rendered_rbac(&render, &objects)?;
        // The operator's own role is where the scope says, and grants what the table says.
        let key = (
            operator_role.0.to_owned(),
            operator_role.1.to_owned(),
            "kvpool-operator".to_owned(),
        );
        let grants = rbac
            .operator
            .get(&key)
            .with_context(|| format!("{render:?}: no {key:?}"))?;
        assert_eq!(
            grants,
            &row("operator"),
            "{render:?}: docs/install.md vs chart"
        );
        let leases = rbac.operator.get(&lease_role);
        assert_eq!(
            leases.is_some(),
            render
                .sets
                .contains(&"operator.leaderElection.enabled=true"),
            "{render:?}"
        );
        if let Some(leases) = leases {
            assert_eq!(leases, &row("leader election"), "{render:?}");
        }
        // The default keeps the root key in a Secret the operator reads by name.
        let root_key_role = (
            "Role".to_owned(),
            DEPLOY_NAMESPACE.to_owned(),
            "kvpool-operator-root-key".to_owned(),
        );
        let root_key = rbac.operator.get(&root_key_role);
        assert_eq!(root_key, Some(&row("root key")), "{render:?}");
        let role = objects_of!(objects, Object::Role)
            .find(|r| r.metadata.name.as_deref() == Some("kvpool-operator-root-key"))
            .context("the root key Role")?;
        for rule in role.rules.iter().flatten() {
            if rule.verbs.iter().any(|v| v == "get") {
                assert_eq!(
                    rule.resource_names.as_deref(),
                    Some(&["kvpool-operator-root-key".to_owned()][..]),
                    "get on Secrets only for the root key's own name"
                );
            }
        }
        // The agent credential issuer (on by default): TokenReviews alone, cluster-wide since
        // a TokenReview has no namespace.
        let issuer_role = (
            "ClusterRole".to_owned(),
            String::new(),
            "kvpool-operator-agent-issuer".to_owned(),
        );
        assert_eq!(
            rbac.operator.get(&issuer_role),
            Some(&row("agent issuer")),
            "{render:?}"
        );
        ensure!(
            rbac.operator.len() == 3 + usize::from(leases.is_some()),
            "{render:?}: unexpected operator roles {:?}",
            rbac.operator.keys()
        );
        // Namespace scope: nothing else cluster-wide for the operator.
        if operator_role.0 == "Role" {
            ensure!(
                rbac.operator
                    .keys()
                    .all(|key| key.0 == "Role" || *key == issuer_role),
                "{render:?}: a ClusterRole is bound to the operator"
            );
        }
        for (role, grants) in &rbac.operator {
            for (group, resource, verb) in grants {
                // What the doc promises in words: no reading Secrets at all (create only; pool
                // keys are derived from the root key), no cluster-scoped resources (wildcards
                // are refused by `triples`).
                ensure!(
                    resource != "secrets" || verb == "create" || *role == root_key_role,
                    "{render:?}: {role:?} may {verb} secrets"
                );
                ensure!(
                    !CLUSTER_SCOPED.contains(&resource.as_str()),
                    "{render:?}: {role:?} grants {verb} on {group}/{resource}"
                );
            }
        }
        // The aggregated roles, as documented, joined to the built-in roles by label.
        let view = rbac
            .aggregated
            .get("kvpool-view")
            .context("no kvpool-view")?;
        let edit = rbac
            .aggregated
            .get("kvpool-edit")
            .context("no kvpool-edit")?;
        assert_eq!(view.1, row("view"), "{render:?}");
        assert_eq!(edit.1, row("edit"), "{render:?}");
        assert!(view.0.contains("view") && !edit.0.contains("view"));
        assert!(edit.0.contains("edit") && edit.0.contains("admin"));
        ensure!(
            edit.1
                .iter()
                .all(|(_, _, verb)| !["get", "list", "watch"].contains(&verb.as_str())),
            "edit repeats what view grants"
        );
    }
    // Turned off, they are gone.
    let (_, objects) = render_objects(&Render {
        values: None,
        sets: &["rbac.aggregateRoles=false"],
    })?;
    assert!(rendered_rbac(&DEFAULTS, &objects)?.aggregated.is_empty());
    Ok(())
}

/// Every pool's master NetworkPolicy admits the operator's usage query by pod labels; the chart's
/// operator pods carry them under any values.
#[test]
fn operator_pods_carry_the_labels_pool_network_policies_admit() -> Result<()> {
    for render in renders() {
        let (_, objects) = render_objects(&render)?;
        let labels = deployments(&objects)[0]
            .spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .and_then(|m| m.labels.clone())
            .unwrap_or_default();
        for (key, value) in kvpool_operator::cachepool::build::OPERATOR_POD_LABELS {
            assert_eq!(
                labels.get(key).map(String::as_str),
                Some(value),
                "{render:?}: operator pod label {key}"
            );
        }
    }
    Ok(())
}

#[test]
fn values_schema_and_guards_reject_bad_values() -> Result<()> {
    let cases: &[(&str, &str)] = &[
        ("operator.replicaCount=2", "replicaCount"),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("operator.logFormat=xml", "logFormat"),
        ("operator.adminPort=0", "adminPort"),
        ("rbac.scope=global", "scope"),
        ("image.digest=latest", "digest"),
        ("operator.replicas=2", "leaderElection"),
        (
            "rbac.scope=cluster,operator.watchNamespace=team-a",
            "rbac.scope=namespace",
        ),
        (
            "metrics.service.enabled=false,metrics.serviceMonitor.enabled=true",
            "metrics.service.enabled=true",
        ),
        (
            "serviceAccount.create=false",
            "serviceAccount.name is required",
        ),
        (
            "workloadImages.agent.tag=bad tag",
            "workloadImages.agent.tag",
        ),
        // The chart never makes the root key up: created from values, it needs 32 characters.
        ("operator.rootKey.create=true", "at least 32 characters"),
    ];
    for (set, needle) in cases {
        let sets = [*set];
        let out = run_tool(
            "helm",
            &helm_args(&Render {
                values: None,
                sets: &sets,
            }),
        )?;
        ensure!(!out.ok, "helm template accepted --set {set}");
        ensure!(
            out.stderr.contains(needle),
            "rejecting --set {set}, helm did not name {needle}: {}",
            out.stderr
        );
    }
    Ok(())
}

/// The operator's root key by default (issue 34: `helm install` with no other step): no volume
/// and no Secret in the chart, the operator keeps `<fullname>-root-key` itself
/// (`--root-key-secret`, in its own namespace from `POD_NAMESPACE`).
#[test]
fn by_default_the_operator_keeps_its_root_key_secret_itself() -> Result<()> {
    let (_, objects) = render_objects(&DEFAULTS)?;
    let (run, _) = parse_operator_args(deployments(&objects)[0])?;
    assert_eq!(
        run.root_key_secret.as_deref(),
        Some("kvpool-operator-root-key")
    );
    assert_eq!(run.root_key_file, None);
    let pod = pod_spec(deployments(&objects)[0])?;
    ensure!(
        pod.volumes.iter().flatten().all(|v| v.name != "root-key"),
        "no root key volume"
    );
    let env = pod.containers[0].env.clone().unwrap_or_default();
    ensure!(
        env.iter().any(|e| e.name == "POD_NAMESPACE"
            && e.value_from
                .as_ref()
                .and_then(|v| v.field_ref.as_ref())
                .is_some_and(|f| f.field_path == "metadata.namespace")),
        "the operator learns its namespace: {env:?}"
    );
    ensure!(objects_of!(objects, Object::Secret).next().is_none());
    Ok(())
}

/// The operator's root key, when given: mounted read-only from the named Secret (mode 0440,
/// readable through the pod's fsGroup by the non-root operator) at the path its
/// `--root-key-file` names; with `create` the chart makes that Secret from the given value,
/// byte for byte.
#[test]
fn root_key_is_mounted_read_only_from_the_named_or_created_secret() -> Result<()> {
    const VALUE: &str = "0123456789abcdef0123456789abcdef0123";
    let created = format!("operator.rootKey.value={VALUE}");
    let sets = ["operator.rootKey.create=true", created.as_str()];
    for (render, secret_name, rendered) in [
        (
            Render {
                values: None,
                sets: &["operator.rootKey.existingSecret=mine"],
            },
            "mine",
            false,
        ),
        (
            Render {
                values: None,
                sets: &sets,
            },
            "kvpool-operator-root-key",
            true,
        ),
    ] {
        let (_, objects) = render_objects(&render)?;
        let (run, _) = parse_operator_args(deployments(&objects)[0])?;
        let pod = pod_spec(deployments(&objects)[0])?;
        assert_eq!(
            pod.security_context.as_ref().and_then(|s| s.fs_group),
            Some(65532),
            "{render:?}"
        );
        let (volume, mount) = read_only_volume(pod, "root-key")?;
        let secret = volume.secret.as_ref().context("not a Secret volume")?;
        assert_eq!(
            secret.secret_name.as_deref(),
            Some(secret_name),
            "{render:?}"
        );
        assert_eq!(secret.default_mode, Some(0o440));
        let items = secret.items.clone().unwrap_or_default();
        let [item] = &items[..] else {
            bail!("one item expected: {items:?}");
        };
        assert_eq!(
            run.root_key_file,
            Some(Path::new(&mount.mount_path).join(&item.path)),
            "--root-key-file names the mounted file"
        );
        let secrets: Vec<&Secret> = objects_of!(objects, Object::Secret).collect();
        assert_eq!(secrets.len(), usize::from(rendered), "{render:?}");
        if let Some(made) = secrets.first() {
            assert_eq!(made.metadata.name.as_deref(), Some(secret_name));
            let data = made.data.as_ref().context("no data")?;
            assert_eq!(
                data.get(&item.key).map(|b| b.0.as_slice()),
                Some(VALUE.as_bytes())
            );
        }
    }
    Ok(())
}

/// `operator.masterTLS.caConfigMap`: the CA is mounted read-only from that ConfigMap at the path
/// `--master-ca-file` names; unset, neither the flag nor the volume appears.
#[test]
fn master_ca_config_map_becomes_the_operators_master_ca_file() -> Result<()> {
    let (_, objects) = render_objects(&Render {
        values: None,
        sets: &["operator.masterTLS.caConfigMap=kvpool-master-ca"],
    })?;
    let deployment = deployments(&objects)[0];
    let (run, _) = parse_operator_args(deployment)?;
    let (volume, mount) = read_only_volume(pod_spec(deployment)?, "master-ca")?;
    let config_map = volume.config_map.as_ref().context("not a ConfigMap")?;
    assert_eq!(config_map.name, "kvpool-master-ca");
    let item = config_map
        .items
        .iter()
        .flatten()
        .next()
        .context("no item")?;
    assert_eq!(
        run.master_ca_file,
        Some(Path::new(&mount.mount_path).join(&item.path))
    );
    let (_, objects) = render_objects(&DEFAULTS)?;
    let (run, _) = parse_operator_args(deployments(&objects)[0])?;
    assert_eq!(run.master_ca_file, None);
    Ok(())
}

/// Metric names the operator registers, as they appear in the exposition (histograms with
/// their `_bucket`, `_sum` and `_count` series), plus Prometheus' own `up`.
fn operator_metric_names() -> Result<BTreeSet<String>> {
    let registry = prometheus::Registry::new();
    let metrics = kvpool_operator::metrics::Metrics::register(&registry)?;
    // Label sets appear in the exposition only once used.
    drop(metrics.start("KVCachePool"));
    metrics.finished("KVCachePool", "ok");
    metrics.failed("KVCachePool", "apply");
    metrics.set_leader(true);
    metrics.set_transport_degraded("ns", "pool", 0);
    let mut names = BTreeSet::from(["up".to_owned()]);
    for family in registry.gather() {
        let name = family.name().to_owned();
        if family.get_field_type() == prometheus::proto::MetricType::HISTOGRAM {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{suffix}"));
            }
        }
        names.insert(name);
    }
    Ok(names)
}

/// Metric names used in a PromQL expression: identifiers that start with `kvpool_` or are `up`.
fn metrics_in(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if word.starts_with("kvpool_") || word == "up" {
            names.insert(word.to_owned());
        }
    }
    names
}

/// Release names and namespaces the alert unit tests run under: the one deploy/ uses, and one
/// whose object names get the chart name appended ("ai-platform-kvpool-operator-metrics").
const ALERT_RELEASES: &[(&str, &str)] = &[
    (DEPLOY_RELEASE, DEPLOY_NAMESPACE),
    ("ai-platform", "inference"),
];

#[test]
fn alert_rules_pass_promtool_and_fire_as_intended_under_any_release_name() -> Result<()> {
    let known = operator_metric_names()?;
    let tests = read("charts/kvpool/ci/alerts-test.yaml")?;
    ensure!(
        !tests.contains("\"kvpool-operator-metrics\"") && !tests.contains("\"kvpool-system\""),
        "charts/kvpool/ci/alerts-test.yaml names the default release's Service or namespace; \
         write ${{SERVICE}} and ${{NAMESPACE}}"
    );
    let mut services = BTreeSet::new();
    for (release, namespace) in ALERT_RELEASES {
        let (_, objects) = render_objects_as(release, namespace, &PRODUCTION)?;
        // The operator's rules, and the data plane's (a file of their own, not tied to the
        // release: tests/observability_live.rs checks their metrics against running processes).
        let rules = |data_plane: bool| {
            objects_of!(objects, Object::PrometheusRule).find(|r| {
                r.metadata
                    .name
                    .as_deref()
                    .is_some_and(|n| n.ends_with("-data-plane"))
                    == data_plane
            })
        };
        let (Some(rule), Some(data_plane)) = (rules(false), rules(true)) else {
            bail!("the production example renders no operator or no data-plane PrometheusRule");
        };
        for alert in rule.spec.groups.iter().flat_map(|g| &g.rules) {
            let name = alert.alert.as_deref().unwrap_or_default();
            let used = metrics_in(&alert.expr);
            ensure!(!used.is_empty(), "{name} uses no operator metric");
            for metric in used {
                ensure!(
                    known.contains(&metric),
                    "{name} uses unknown metric {metric}"
                );
            }
        }
        let dir = scratch_dir(&format!("data_plane_rules/{release}"))?;
        let rules = dir.join("rules.yaml");
        std::fs::write(&rules, serde_json::to_string_pretty(&data_plane.spec)?)?;
        let test = dir.join("data-plane-alerts-test.yaml");
        std::fs::write(&test, read("charts/kvpool/ci/data-plane-alerts-test.yaml")?)?;
        run_ok("promtool", &["check", "rules", &rules.to_string_lossy()])?;
        run_ok("promtool", &["test", "rules", &test.to_string_lossy()])
            .with_context(|| format!("data plane, release {release} in namespace {namespace}"))?;
        // The Service the ServiceMonitor scrapes names the targets' `service` label.
        let service = objects_of!(objects, Object::Service)
            .filter(|s| is_metrics_service(s))
            .find_map(|s| s.metadata.name.clone())
            .context("no metrics Service rendered")?;
        services.insert(service.clone());
        let dir = scratch_dir(&format!("alert_rules/{release}"))?;
        let rules = dir.join("rules.yaml");
        std::fs::write(&rules, serde_json::to_string_pretty(&rule.spec)?)?;
        let filled = tests
            .replace("${NAMESPACE}", namespace)
            .replace("${SERVICE}", &service);
        ensure!(
            !filled.contains("${"),
            "alerts-test.yaml uses a placeholder other than ${{NAMESPACE}} and ${{SERVICE}}"
        );
        let test = dir.join("alerts-test.yaml");
        std::fs::write(&test, filled)?;
        run_ok("promtool", &["check", "rules", &rules.to_string_lossy()])?;
        run_ok("promtool", &["test", "rules", &test.to_string_lossy()])
            .with_context(|| format!("release {release} in namespace {namespace}"))?;
    }
    ensure!(
        services.len() == ALERT_RELEASES.len(),
        "the releases must name their Services differently for the test to mean anything: \
         {services:?}"
    );
    Ok(())
}

#[test]
fn dashboard_is_valid_and_queries_real_metrics() -> Result<()> {
    let (_, objects) = render_objects(&PRODUCTION)?;
    let Some(config_map) = objects_of!(objects, Object::ConfigMap).next() else {
        bail!("the production example renders no dashboard ConfigMap");
    };
    assert_eq!(config_map.metadata.namespace.as_deref(), Some("monitoring"));
    let labels = config_map.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels.get("grafana_dashboard").map(String::as_str),
        Some("1")
    );
    let data = config_map.data.clone().unwrap_or_default();
    let json = data
        .get("kvpool-operator.json")
        .context("no kvpool-operator.json key")?;
    let dashboard: Value = serde_json::from_str(json).context("dashboard is not JSON")?;
    assert_eq!(str_at(&dashboard, "/uid"), "kvpool-operator");
    // The data plane's dashboards ride along (their queries are evaluated against running
    // processes by tests/observability_live.rs).
    for name in ["kvpool-pool", "kvpool-conductor", "kvpool-nodes"] {
        let json = data
            .get(&format!("{name}.json"))
            .with_context(|| format!("no {name}.json key"))?;
        let board: Value =
            serde_json::from_str(json).with_context(|| format!("{name}.json is not JSON"))?;
        assert_eq!(str_at(&board, "/uid"), name);
    }
    let known = operator_metric_names()?;
    for variable in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        for name in metrics_in(str_at(variable, "/query/query")) {
            ensure!(
                known.contains(&name),
                "variable {} uses unknown {name}",
                variable["name"]
            );
        }
    }
    let panels = dashboard["panels"].as_array().context("no panels")?;
    let mut ids = BTreeSet::new();
    for panel in panels {
        ensure!(
            ids.insert(panel["id"].to_string()),
            "duplicate panel id {}",
            panel["id"]
        );
        let targets = panel["targets"]
            .as_array()
            .context("panel without targets")?;
        for target in targets {
            let expr = str_at(target, "/expr");
            let used = metrics_in(expr);
            ensure!(
                !used.is_empty(),
                "panel {} queries no metric",
                panel["title"]
            );
            for name in used {
                ensure!(
                    known.contains(&name),
                    "panel {} uses unknown {name}",
                    panel["title"]
                );
            }
        }
    }
    Ok(())
}

/// The stages of a Dockerfile, each as its instructions with continuations joined; the last
/// one is what ships.
fn dockerfile_stages(rel: &str) -> Result<Vec<Vec<String>>> {
    dockerfile_stages_of(rel, &read(rel)?)
}

fn dockerfile_stages_of(rel: &str, text: &str) -> Result<Vec<Vec<String>>> {
    let mut instructions = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || (line.is_empty() && current.is_empty()) {
            continue;
        }
        if let Some(body) = line.strip_suffix('\\') {
            current.push_str(body);
            current.push(' ');
        } else {
            current.push_str(line);
            instructions.push(std::mem::take(&mut current));
        }
    }
    let mut stages: Vec<Vec<String>> = Vec::new();
    for instruction in instructions {
        if instruction.starts_with("FROM ") {
            stages.push(Vec::new());
        }
        if let Some(stage) = stages.last_mut() {
            stage.push(instruction);
        }
    }
    ensure!(stages.len() >= 2, "{rel}: expected a multi-stage build");
    Ok(stages)
}

/// What one image must contain.
struct ImageSpec {
    dockerfile: &'static str,
    package: &'static str,
    binary: &'static str,
    root: bool,
    build_flags: &'static [&'static str],
    runtime_packages: &'static [&'static str],
}

/// Both images hold the one `kvpool` binary: the agent's is built with RDMA and carries the verbs
/// runtime; the other runs the operator, the master, the conductor and the engines.
const IMAGES: &[ImageSpec] = &[
    ImageSpec {
        dockerfile: "docker/kvpool.Dockerfile",
        package: "kvpool",
        binary: "kvpool",
        root: false,
        build_flags: &[],
        runtime_packages: &[],
    },
    ImageSpec {
        dockerfile: "docker/agent.Dockerfile",
        package: "kvpool",
        binary: "kvpool",
        root: true,
        build_flags: &["--features rdma"],
        runtime_packages: &["libibverbs1", "ibverbs-providers", "librdmacm1"],
    },
];

#[test]
fn dockerfiles_build_and_ship_the_binaries_the_chart_runs() -> Result<()> {
    for image in IMAGES {
        let stages = dockerfile_stages(image.dockerfile)?;
        let build = stages[..stages.len() - 1].concat().join("\n");
        let build_cmd = format!(
            "cargo build --release --locked -p {} --bin {}",
            image.package, image.binary
        );
        ensure!(
            build.contains(&build_cmd),
            "{}: no `{build_cmd}`",
            image.dockerfile
        );
        for flag in image.build_flags {
            ensure!(
                build.contains(&format!("{build_cmd} {flag}")),
                "{}: not built with {flag}",
                image.dockerfile
            );
        }
        // The images run in a cluster: the full binary (default features: the operator, the
        // agent's Node object, the conductor's discovery), never the lean build of
        // docs/adr/0011-lean-embedded-build.md.
        ensure!(
            !build.contains("--no-default-features"),
            "{}: images need the default features (k8s)",
            image.dockerfile
        );
        let last = &stages[stages.len() - 1];
        let binary_path = format!("/usr/local/bin/{}", image.binary);
        ensure!(
            last.iter()
                .any(|i| i.starts_with("COPY --from=build") && i.ends_with(&binary_path)),
            "{}: the final stage does not copy the binary to {binary_path}",
            image.dockerfile
        );
        ensure!(
            last.iter()
                .any(|i| i == &format!("ENTRYPOINT [\"{binary_path}\"]")),
            "{}: entrypoint is not {binary_path}",
            image.dockerfile
        );
        let user = last
            .iter()
            .rev()
            .find_map(|i| i.strip_prefix("USER "))
            .with_context(|| format!("{}: final stage sets no USER", image.dockerfile))?;
        assert_eq!(
            user.starts_with("0"),
            image.root,
            "{}: USER {user}",
            image.dockerfile
        );
        let runtime = last.join("\n");
        for package in image.runtime_packages {
            ensure!(
                runtime.contains(package),
                "{}: runtime package {package} not installed",
                image.dockerfile
            );
        }
        let ignore = format!("{}.dockerignore", image.dockerfile);
        ensure!(
            read(&ignore)?.lines().any(|l| l == "target/"),
            "{ignore} must skip target/"
        );
    }
    // The chart starts the operator image at the path that image puts the binary.
    assert_eq!(
        OPERATOR_BINARY_PATH,
        format!("/usr/local/bin/{}", IMAGES[0].binary)
    );
    Ok(())
}

#[test]
fn agent_crate_has_the_rdma_feature_its_image_is_built_with() -> Result<()> {
    let manifest = read("Cargo.toml")?;
    let features = manifest
        .split("\n[")
        .find(|section| section.starts_with("features]"))
        .unwrap_or("");
    ensure!(
        features
            .lines()
            .any(|l| l.trim_start().starts_with("rdma ")),
        "docker/agent.Dockerfile builds kvpool with --features rdma, but Cargo.toml declares no \
         rdma feature"
    );
    Ok(())
}

#[test]
fn chart_version_follows_the_workspace_version() -> Result<()> {
    let chart: Value = serde_saphyr::from_str(&read("charts/kvpool/Chart.yaml")?)?;
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        str_at(&chart, "/appVersion"),
        version,
        "Chart.yaml appVersion"
    );
    assert_eq!(str_at(&chart, "/version"), version, "Chart.yaml version");
    assert_eq!(kvpool_operator::cli::DEFAULT_IMAGE_TAG, version);
    Ok(())
}

fn labels_match(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

#[test]
fn service_account_service_and_service_monitor_reach_the_operator_pod() -> Result<()> {
    let render = Render {
        values: Some("charts/kvpool/ci/production-values.yaml"),
        sets: &[],
    };
    let (_, objects) = render_objects(&render)?;
    let deployment = deployments(&objects)[0];
    let template = &deployment.spec.as_ref().context("no spec")?.template;
    let pod_labels = template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    let pod = template.spec.as_ref().context("no pod spec")?;

    let Some(account) = objects_of!(objects, Object::ServiceAccount).next() else {
        bail!("no ServiceAccount rendered");
    };
    assert_eq!(account.metadata.name, pod.service_account_name);
    // Only the operator's pod mounts the token, not every pod that might reuse the account.
    assert_eq!(account.automount_service_account_token, Some(false));
    assert_eq!(pod.automount_service_account_token, Some(true));

    let Some(service) = objects_of!(objects, Object::Service).find(|s| is_metrics_service(s))
    else {
        bail!("no metrics Service rendered");
    };
    let spec = service.spec.as_ref().context("Service without spec")?;
    let selector = spec.selector.clone().unwrap_or_default();
    ensure!(
        labels_match(&selector, &pod_labels),
        "Service selects {selector:?}, pod has {pod_labels:?}"
    );
    let port = spec
        .ports
        .iter()
        .flatten()
        .next()
        .context("Service without ports")?;
    assert_eq!(
        port.target_port,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("admin".into()))
    );

    let Some(monitor) = objects_of!(objects, Object::ServiceMonitor).next() else {
        bail!("no ServiceMonitor rendered");
    };
    let service_labels = service.metadata.labels.clone().unwrap_or_default();
    let wanted = monitor
        .spec
        .selector
        .match_labels
        .clone()
        .unwrap_or_default();
    ensure!(
        labels_match(&wanted, &service_labels),
        "ServiceMonitor selects {wanted:?}"
    );
    assert_eq!(
        monitor.spec.namespace_selector.match_names,
        vec![DEPLOY_NAMESPACE.to_owned()]
    );
    for endpoint in &monitor.spec.endpoints {
        assert_eq!(Some(&endpoint.port), port.name.as_ref());
        assert_eq!(endpoint.path, "/metrics");
    }
    let extra = monitor.metadata.labels.clone().unwrap_or_default();
    assert_eq!(extra.get("release").map(String::as_str), Some("prometheus"));
    Ok(())
}

#[test]
fn chart_refuses_clusters_older_than_the_operator_supports() -> Result<()> {
    let out = run_tool(
        "helm",
        &[
            "template",
            "kvpool",
            "charts/kvpool",
            "--kube-version",
            "1.31.0",
        ],
    )?;
    ensure!(!out.ok, "the chart rendered for Kubernetes 1.31");
    ensure!(
        out.stderr.contains(">=1.32.0"),
        "unexpected error: {}",
        out.stderr
    );
    Ok(())
}

#[test]
fn a_missing_tool_fails_with_the_install_command() {
    let err = tool("kvpool-no-such-tool").expect_err("a tool that does not exist was found");
    assert!(err.to_string().contains("run scripts/tools.sh"), "{err}");
    let err = run_ok("kvpool-no-such-tool", &["--version"]).expect_err("ran a missing tool");
    assert!(err.to_string().contains("not found"), "{err}");
}

#[test]
fn several_replicas_get_a_disruption_budget_and_rolling_updates() -> Result<()> {
    let (_, objects) = render_objects(&PRODUCTION)?;
    let Some(pdb) = objects_of!(objects, Object::PodDisruptionBudget).next() else {
        bail!("two replicas rendered no PodDisruptionBudget");
    };
    let spec = pdb
        .spec
        .as_ref()
        .context("PodDisruptionBudget without spec")?;
    assert_eq!(
        spec.min_available,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1))
    );
    let deployment = deployments(&objects)[0];
    let deploy_spec = deployment.spec.as_ref().context("no spec")?;
    assert_eq!(spec.selector, Some(deploy_spec.selector.clone()));
    assert_eq!(
        deploy_spec
            .strategy
            .as_ref()
            .and_then(|s| s.type_.as_deref()),
        Some("RollingUpdate")
    );
    // One replica: no budget (it would block node drains) and Recreate, so that two
    // operators without a Lease never run side by side during a rollout.
    let (_, objects) = render_objects(&DEFAULTS)?;
    assert!(
        !objects
            .iter()
            .any(|o| matches!(o, Object::PodDisruptionBudget(_)))
    );
    let deploy_spec = deployments(&objects)[0].spec.clone().context("no spec")?;
    assert_eq!(
        deploy_spec.strategy.and_then(|s| s.type_),
        Some("Recreate".to_owned())
    );
    Ok(())
}

/// Ports an image's final stage declares with EXPOSE.
fn exposed_ports(rel: &str) -> Result<BTreeSet<u16>> {
    let stages = dockerfile_stages(rel)?;
    let mut ports = BTreeSet::new();
    for instruction in stages.last().into_iter().flatten() {
        if let Some(list) = instruction.strip_prefix("EXPOSE ") {
            for port in list.split_whitespace() {
                let number = port.split('/').next().unwrap_or(port);
                ports.insert(
                    number
                        .parse()
                        .with_context(|| format!("{rel}: bad port {port}"))?,
                );
            }
        }
    }
    Ok(ports)
}

/// The kvpool image carries the Python package where the operator's engine pods copy it from:
/// a build stage makes the abi3 wheel with maturin for manylinux_2_28 (through zig, so the
/// extension loads on glibc 2.28) and unpacks it without dependencies at the contract's path,
/// which the final stage copies; the init container's command line is the binary's own.
#[test]
fn kvpool_image_carries_the_python_package_engine_pods_copy() -> Result<()> {
    use kvpool_operator::contract;
    let rel = IMAGES[0].dockerfile;
    let stages = dockerfile_stages(rel)?;
    let (last, builds) = stages.split_last().context("no stages")?;
    let python = builds
        .iter()
        .find(|stage| {
            stage
                .first()
                .is_some_and(|from| from.ends_with(" AS python"))
        })
        .with_context(|| format!("{rel}: no `AS python` build stage"))?
        .join("\n");
    for wanted in [
        "maturin build --release --locked --strip --zig --compatibility manylinux_2_28 -m crates/python/Cargo.toml",
        // GPU engines register their KV caches in place (docs/transfer.md, "GPU memory"); the
        // driver is loaded at run time, so the same wheel imports on hosts without one.
        "--features cuda",
        "pip install --no-cache-dir --no-deps --no-compile --target",
    ] {
        ensure!(
            python.contains(wanted),
            "{rel}: the python stage lacks `{wanted}`"
        );
    }
    let target = format!("--target {} ", contract::PYTHON_PACKAGE_DIR);
    ensure!(
        python.contains(&target),
        "{rel}: the wheel is not installed at {}",
        contract::PYTHON_PACKAGE_DIR
    );
    let copy = format!(
        "COPY --from=python {dir} {dir}",
        dir = contract::PYTHON_PACKAGE_DIR
    );
    ensure!(
        last.iter().any(|i| i == &copy),
        "{rel}: the final stage does not `{copy}`"
    );
    // The init container runs `kvpool operator install-python` from that path.
    let mut argv = contract::kvpool_command();
    argv.extend(contract::install_python_args());
    let cli = Cli::try_parse_from(&argv).with_context(|| format!("{argv:?}"))?;
    let KvpoolCommand::Operator(OperatorCommand::InstallPython(args)) = cli.command else {
        bail!("{argv:?} is not `kvpool operator install-python`");
    };
    assert_eq!(args.from, Path::new(contract::PYTHON_PACKAGE_DIR));
    assert_eq!(args.to, Path::new(contract::PYTHON_STAGING_DIR));
    let ignore = read(&format!("{rel}.dockerignore"))?;
    ensure!(
        ignore.lines().any(|l| l == "**/*.so"),
        "{rel}.dockerignore must keep locally built extensions out of the wheel"
    );
    Ok(())
}

#[test]
fn images_hold_the_binaries_and_ports_the_operator_generates() -> Result<()> {
    use kvpool_operator::contract;
    // The operator starts agents and masters/conductors by bare binary name (found on PATH,
    // which includes /usr/local/bin in both base images), with the role as first argument.
    assert_eq!(contract::agent_command(), vec![IMAGES[1].binary.to_owned()]);
    assert_eq!(contract::agent_args()[..2], ["agent", "run"]);
    assert_eq!(
        contract::kvpool_command(),
        vec![IMAGES[0].binary.to_owned()]
    );
    assert_eq!(contract::KVPOOL_BINARY, IMAGES[0].binary);
    assert_eq!(
        exposed_ports(IMAGES[1].dockerfile)?,
        BTreeSet::from([contract::ADMIN_PORT, contract::AGENT_TRANSFER_PORT])
    );
    // The kvpool image runs the operator (admin port only), the master and the conductor.
    assert_eq!(
        exposed_ports(IMAGES[0].dockerfile)?,
        BTreeSet::from([
            contract::ADMIN_PORT,
            contract::MASTER_PORT,
            contract::CONDUCTOR_PORT
        ])
    );
    // The chart's admin port is the one every kvpool container uses.
    let values: Value = serde_saphyr::from_str(&read("charts/kvpool/values.yaml")?)?;
    assert_eq!(
        values
            .pointer("/operator/adminPort")
            .and_then(Value::as_u64),
        Some(u64::from(contract::ADMIN_PORT))
    );
    Ok(())
}

#[test]
fn packaged_chart_holds_what_a_user_needs_and_renders_like_the_source() -> Result<()> {
    let dir = scratch_dir("packaged_chart")?;
    let dest = dir.to_string_lossy().into_owned();
    run_ok(
        "helm",
        &["package", "charts/kvpool", "--destination", &dest],
    )?;
    let version = env!("CARGO_PKG_VERSION");
    let archive = dir.join(format!("kvpool-{version}.tgz"));
    let archive = archive.to_string_lossy().into_owned();
    // The archive carries the README, the licence, the schema, the CRD copies and the dashboard, and leaves
    // out the test-only ci/ folder.
    let listing = Command::new("tar")
        .args(["-tzf", &archive])
        .output()
        .context("starting tar")?;
    ensure!(listing.status.success(), "tar cannot list {archive}");
    let files: BTreeSet<String> = String::from_utf8_lossy(&listing.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    let mut wanted: Vec<String> = [
        "README.md",
        "LICENSE",
        "values.schema.json",
        "files/dashboards/kvpool-operator.json",
    ]
    .iter()
    .map(|f| format!("kvpool/{f}"))
    .collect();
    wanted.extend(
        crd_files("crds")?
            .keys()
            .map(|name| format!("kvpool/files/crds/{name}")),
    );
    for file in &wanted {
        ensure!(files.contains(file), "{archive} lacks {file}");
    }
    ensure!(
        !files.iter().any(|f| f.starts_with("kvpool/ci/")),
        "{archive} ships the ci/ folder"
    );
    for render in renders() {
        let source = helm_template(&render)?;
        let mut args = helm_args(&render);
        args[2] = &archive;
        ensure!(
            source == run_ok("helm", &args)?,
            "{render:?}: the packaged chart renders differently"
        );
    }
    Ok(())
}

/// Paths of every object key in a JSON value, as JSON pointers ("/operator/replicas").
fn value_paths(value: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    if let Value::Object(map) = value {
        for (key, child) in map {
            let path = format!("{prefix}/{key}");
            value_paths(child, &path, out);
            out.insert(path);
        }
    }
}

/// Paths of the options a JSON schema declares through nested `properties` (free-form maps
/// such as `podAnnotations` stop the walk).
fn schema_paths(schema: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    if let Some(Value::Object(properties)) = schema.get("properties") {
        for (key, child) in properties {
            let path = format!("{prefix}/{key}");
            schema_paths(child, &path, out);
            out.insert(path);
        }
    }
}

#[test]
fn values_file_and_schema_describe_the_same_options() -> Result<()> {
    let values: Value = serde_saphyr::from_str(&read("charts/kvpool/values.yaml")?)?;
    let schema: Value = serde_json::from_str(&read("charts/kvpool/values.schema.json")?)?;
    let mut declared = BTreeSet::new();
    schema_paths(&schema, "", &mut declared);
    let mut defaults = BTreeSet::new();
    value_paths(&values, "", &mut defaults);
    // Keys below a free-form map in the schema (resources.requests.cpu, ...) are not options.
    let free_form = |path: &String| {
        declared
            .iter()
            .any(|d| path.starts_with(&format!("{d}/")) && !declared.contains(path))
    };
    let undeclared: Vec<&String> = defaults
        .iter()
        .filter(|p| !declared.contains(*p) && !free_form(p))
        .collect();
    ensure!(
        undeclared.is_empty(),
        "values.yaml keys missing from the schema: {undeclared:?}"
    );
    let undocumented: Vec<&String> = declared.difference(&defaults).collect();
    // resources.claims is accepted for completeness but has no default.
    ensure!(
        undocumented
            .iter()
            .all(|p| p.as_str() == "/resources/claims"),
        "schema options without a default in values.yaml: {undocumented:?}"
    );
    // Every object in the schema is closed, except the free-form maps and the pass-through
    // Kubernetes structures (security contexts, affinity...), which kubernetes-validate checks
    // once rendered.
    fn closed(schema: &Value, path: &str, open: &mut Vec<String>) {
        if let Some(Value::Object(properties)) = schema.get("properties") {
            if schema.get("additionalProperties") != Some(&Value::Bool(false)) {
                open.push(path.to_owned());
            }
            for (key, child) in properties {
                closed(child, &format!("{path}/{key}"), open);
            }
        }
    }
    let mut open = Vec::new();
    closed(&schema, "", &mut open);
    ensure!(
        open.is_empty(),
        "schema objects accepting unknown keys: {open:?}"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Composition, Kubernetes versions, README, licence

/// (major, minor) of a "1.32.0"-style version.
fn minor_version(version: &str) -> Result<(u32, u32)> {
    let mut parts = version.split('.');
    let major = parts.next().unwrap_or_default().parse()?;
    let minor = parts.next().unwrap_or_default().parse()?;
    Ok((major, minor))
}

#[test]
fn chart_renders_and_lints_with_the_pinned_helms_default_kubernetes_version() -> Result<()> {
    // The tests validate against the version the chart declares as its minimum.
    let chart: Value = serde_saphyr::from_str(&read("charts/kvpool/Chart.yaml")?)?;
    assert_eq!(
        str_at(&chart, "/kubeVersion"),
        format!(">={KUBE_VERSION}-0"),
        "Chart.yaml kubeVersion and KUBE_VERSION"
    );
    // That minimum is true about the CRDs: `selectableFields` (custom resource field
    // selectors) is GA from Kubernetes 1.32; an older API server drops it silently.
    let selectable = crd_files("crds")?
        .values()
        .any(|text| text.contains("selectableFields:"));
    if selectable {
        ensure!(
            minor_version(KUBE_VERSION)? >= (1, 32),
            "the CRDs use selectableFields, GA from 1.32, but the chart allows {KUBE_VERSION}"
        );
    }
    // Without a cluster, helm assumes its own default version: rendering and linting must work
    // without --kube-version (the failure users met with helm 3.17 and `>=1.33.0-0`).
    let yaml = run_ok("helm", &["template", "kvpool", "charts/kvpool"])?;
    ensure!(
        yaml.contains("kind: Deployment"),
        "the default render holds no Deployment"
    );
    run_ok("helm", &["lint", "--strict", "charts/kvpool"])?;
    Ok(())
}

/// A chart of its own that depends on charts/kvpool through `file://`, as an umbrella chart of
/// a platform team would, with `values` as its values.yaml; `helm dependency build` packs the
/// dependency into its charts/ folder.
fn umbrella_chart(test: &str, values: &str) -> Result<PathBuf> {
    umbrella_chart_with(test, values, "")
}

/// [`umbrella_chart`] whose dependency entry also has `extra` (indented YAML lines).
fn umbrella_chart_with(test: &str, values: &str, extra: &str) -> Result<PathBuf> {
    let chart = scratch_dir(test)?.join("platform");
    std::fs::create_dir_all(chart.join("templates"))?;
    let dependency = repo_root().join("charts/kvpool");
    std::fs::write(
        chart.join("Chart.yaml"),
        format!(
            "apiVersion: v2\nname: platform\nversion: 1.0.0\ndependencies:\n  - name: kvpool\n    \
             version: {}\n    repository: file://{}\n{extra}",
            env!("CARGO_PKG_VERSION"),
            dependency.display()
        ),
    )?;
    std::fs::write(chart.join("values.yaml"), values)?;
    run_ok("helm", &["dependency", "build", &chart.to_string_lossy()])?;
    Ok(chart)
}

/// `helm install --dry-run` needs a cluster; `helm lint` and `helm template` run the same
/// schema validation and rendering without one.
#[test]
fn chart_installs_as_a_dependency_of_an_umbrella_chart() -> Result<()> {
    for (case, values) in [
        ("empty", ""),
        (
            "globals",
            "global:\n  imageRegistry: registry.example.com\n  imagePullSecrets:\n    - name: pull\n",
        ),
    ] {
        let chart = umbrella_chart(&format!("umbrella_{case}"), values)?;
        let chart = chart.to_string_lossy().into_owned();
        run_ok("helm", &["lint", "--strict", &chart]).with_context(|| case.to_owned())?;
        let yaml = run_ok(
            "helm",
            &["template", "platform", &chart, "--namespace", "platform"],
        )
        .with_context(|| case.to_owned())?;
        let objects = parse_docs(&yaml)?
            .iter()
            .map(typed)
            .collect::<Result<Vec<_>>>()?;
        let names: Vec<Option<&str>> = deployments(&objects)
            .iter()
            .map(|d| d.metadata.name.as_deref())
            .collect();
        assert_eq!(names, [Some("platform-kvpool-operator")], "{case}");
        ensure!(
            objects
                .iter()
                .filter(|o| matches!(o, Object::Crd(_)))
                .count()
                == crd_files("crds")?.len(),
            "{case}: the CRDs are not rendered"
        );
    }
    // The usual switch of a dependency, `condition: kvpool.enabled`: on by default, off renders
    // nothing of kvpool (issue 34).
    for (case, values, deployments_expected) in [
        ("condition_default", "", 1),
        ("condition_off", "kvpool:\n  enabled: false\n", 0),
    ] {
        let chart = umbrella_chart_with(case, values, "    condition: kvpool.enabled\n")?;
        let chart = chart.to_string_lossy().into_owned();
        run_ok("helm", &["lint", "--strict", &chart]).with_context(|| case.to_owned())?;
        let yaml = run_ok("helm", &["template", "platform", &chart])?;
        let objects = parse_docs(&yaml)?
            .iter()
            .map(typed)
            .collect::<Result<Vec<_>>>()?;
        ensure!(
            deployments(&objects).len() == deployments_expected,
            "{case}: {} deployments",
            deployments(&objects).len()
        );
    }
    // The subchart's schema still guards its own keys.
    let chart = umbrella_chart("umbrella_typo", "kvpool:\n  operator:\n    replicaz: 2\n")?;
    let out = run_tool("helm", &["template", "platform", &chart.to_string_lossy()])?;
    ensure!(
        !out.ok && out.stderr.contains("replicaz"),
        "a misspelt subchart value was not refused: {}",
        out.stderr
    );
    Ok(())
}

#[test]
fn chart_readme_values_table_is_generated_from_values_and_schema() -> Result<()> {
    let values = read("charts/kvpool/values.yaml")?;
    let schema: Value = serde_json::from_str(&read("charts/kvpool/values.schema.json")?)?;
    let table = packaging_support::values_table(&values, &schema)?;
    let readme = read("charts/kvpool/README.md")?;
    let generated = packaging_support::splice(&readme, &table)?;
    if blessing() && generated != readme {
        write_atomically(&repo_root().join("charts/kvpool/README.md"), &generated)?;
        return Ok(());
    }
    ensure!(
        generated == readme,
        "charts/kvpool/README.md's values table differs from values.yaml and values.schema.json: \
         KVPOOL_BLESS=1 cargo test --test packaging chart_readme"
    );
    // Every top-level option appears in the table, itself or through its keys.
    for key in schema["properties"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, _)| k)
    {
        ensure!(
            table.contains(&format!("| `{key}")),
            "the values table has no row for {key}"
        );
    }
    Ok(())
}

#[test]
fn license_is_the_apache_2_text_that_cargo_and_the_images_declare() -> Result<()> {
    let manifest = read("Cargo.toml")?;
    ensure!(
        manifest
            .lines()
            .any(|l| l.trim() == r#"license = "Apache-2.0""#),
        "Cargo.toml does not declare Apache-2.0"
    );
    let license = read("LICENSE")?;
    let lines: Vec<&str> = license
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    ensure!(
        lines.starts_with(&["Apache License", "Version 2.0, January 2004"]),
        "LICENSE does not start as the Apache License 2.0 does"
    );
    for section in [
        "1. Definitions.",
        "4. Redistribution.",
        "9. Accepting Warranty or Additional Liability.",
        "END OF TERMS AND CONDITIONS",
        "APPENDIX: How to apply the Apache License to your work.",
    ] {
        ensure!(
            lines.iter().any(|l| l.starts_with(section)),
            "LICENSE lacks {section:?}"
        );
    }
    // The chart ships a copy; each image labels its licence and carries the text.
    ensure!(
        read("charts/kvpool/LICENSE")? == license,
        "charts/kvpool/LICENSE differs from LICENSE: {REGENERATE}"
    );
    for image in IMAGES {
        let stages = dockerfile_stages(image.dockerfile)?;
        let last = stages.last().context("no stages")?.join("\n");
        ensure!(
            last.contains(r#"org.opencontainers.image.licenses="Apache-2.0""#),
            "{}: no licence label",
            image.dockerfile
        );
        ensure!(
            last.contains("COPY LICENSE /usr/share/doc/kvpool/LICENSE"),
            "{}: the final stage does not carry LICENSE",
            image.dockerfile
        );
        let ignore = read(&format!("{}.dockerignore", image.dockerfile))?;
        ensure!(
            !ignore.lines().any(|l| l == "LICENSE" || l == "*"),
            "{}.dockerignore leaves LICENSE out of the context",
            image.dockerfile
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Base images and SBOMs

fn is_digest(text: &str) -> bool {
    text.strip_prefix("sha256:")
        .is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The images a Dockerfile builds on, with their 1-based line: the `# syntax=` frontend and
/// every `FROM` that names an image (not `scratch` or an earlier stage).
fn base_images(text: &str) -> Vec<(usize, String)> {
    let mut stages = BTreeSet::new();
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if i == 0
            && let Some(frontend) = line.strip_prefix("# syntax=")
        {
            out.push((1, frontend.trim().to_owned()));
        }
        let Some(rest) = line.strip_prefix("FROM ") else {
            continue;
        };
        let words: Vec<&str> = rest
            .split_whitespace()
            .filter(|w| !w.starts_with("--platform="))
            .collect();
        let image = words.first().copied().unwrap_or_default();
        if image != "scratch" && !stages.contains(image) {
            out.push((i + 1, image.to_owned()));
        }
        if let [_, as_, name] = words[..]
            && as_.eq_ignore_ascii_case("as")
        {
            stages.insert(name.to_owned());
        }
    }
    out
}

/// Runs scripts/pin-images.sh from a copy of the repository at `root`.
fn pin_images(root: &Path, args: &[&str], resolver: &Path, fill: &str) -> Result<Output> {
    let out = Command::new("bash")
        .arg(root.join("scripts/pin-images.sh"))
        .args(args)
        .current_dir(root)
        .env("KVPOOL_PIN_RESOLVER", resolver)
        .env("FAKE_DIGEST_FILL", fill)
        .env("FAKE_RESOLVER_LOG", root.join("lookups.log"))
        .output()
        .context("starting scripts/pin-images.sh")?;
    Ok(Output {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

#[test]
fn base_images_are_written_out_and_pinned_or_pinnable_by_digest() -> Result<()> {
    let toolchain = read("rust-toolchain.toml")?;
    let channel = toolchain
        .lines()
        .find_map(|l| l.strip_prefix("channel = "))
        .map(|c| c.trim_matches('"'))
        .context("rust-toolchain.toml names no channel")?;
    let mut pinned = 0;
    let mut bases = 0;
    for image in IMAGES {
        for (line, reference) in base_images(&read(image.dockerfile)?) {
            let at = format!("{}:{line}: {reference}", image.dockerfile);
            ensure!(
                !reference.contains('$'),
                "{at}: a build argument in a base image cannot be pinned"
            );
            let (name, digest) = match reference.split_once('@') {
                Some((name, digest)) => (name, Some(digest)),
                None => (reference.as_str(), None),
            };
            let (repository, tag) = name
                .rsplit_once(':')
                .filter(|(_, tag)| !tag.contains('/'))
                .with_context(|| format!("{at}: no tag"))?;
            ensure!(
                repository
                    .split('/')
                    .next()
                    .is_some_and(|h| h.contains('.')),
                "{at}: name the registry (docker.io/library/..., gcr.io/...)"
            );
            if let Some(digest) = digest {
                ensure!(is_digest(digest), "{at}: not a sha256 digest");
                pinned += 1;
            }
            bases += 1;
            if repository == "docker.io/library/rust" {
                ensure!(
                    tag.starts_with(&format!("{channel}-")),
                    "{at}: the build image is not the toolchain rust-toolchain.toml pins ({channel})"
                );
            }
        }
    }
    ensure!(bases > 0, "no base images found");

    // The script, on a copy of the repository, with a stand-in for the registry.
    let root = scratch_dir("pin_images")?;
    std::fs::create_dir_all(root.join("scripts"))?;
    std::fs::create_dir_all(root.join("docker"))?;
    std::fs::copy(
        repo_root().join("scripts/pin-images.sh"),
        root.join("scripts/pin-images.sh"),
    )?;
    let resolver = root.join("resolver.sh");
    std::fs::write(
        &resolver,
        "#!/bin/sh\nprintf '%s\\n' \"$1\" >>\"$FAKE_RESOLVER_LOG\"\n\
         printf 'sha256:%064d\\n' 0 | tr 0 \"$FAKE_DIGEST_FILL\"\n",
    )?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&resolver, std::fs::Permissions::from_mode(0o755))?;
    }
    let originals: Vec<(&str, String)> = IMAGES
        .iter()
        .map(|i| Ok((i.dockerfile, read(i.dockerfile)?)))
        .collect::<Result<_>>()?;
    for (rel, text) in &originals {
        std::fs::write(root.join(rel), text)?;
    }
    // --check agrees with the parser above, and needs no registry.
    let check = pin_images(&root, &["--check"], &resolver, "a")?;
    assert_eq!(
        check.ok,
        pinned == bases,
        "pin-images.sh --check with {pinned} of {bases} bases pinned: {}",
        check.stderr
    );
    ensure!(
        !root.join("lookups.log").exists(),
        "--check looked a tag up"
    );
    for (fill, previous) in [("a", None), ("b", Some("a"))] {
        let run = pin_images(&root, &[], &resolver, fill)?;
        ensure!(run.ok, "pin-images.sh failed: {}{}", run.stdout, run.stderr);
        let digest = format!("sha256:{}", fill.repeat(64));
        for (rel, original) in &originals {
            let text = std::fs::read_to_string(root.join(rel))?;
            let before = base_images(original);
            let after = base_images(&text);
            assert_eq!(
                before.len(),
                after.len(),
                "{rel}: bases appeared or vanished"
            );
            for ((line, old), (_, new)) in before.iter().zip(&after) {
                let name = old.split('@').next().unwrap_or_default();
                assert_eq!(new, &format!("{name}@{digest}"), "{rel}:{line}");
            }
            // Only the image references changed: same lines, same stages.
            let unpinned = |t: &str| {
                t.lines()
                    .map(|l| match l.find("@sha256:") {
                        Some(i) if l.get(i + 1..i + 72).is_some_and(is_digest) => {
                            format!("{}{}", &l[..i], &l[i + 72..])
                        }
                        _ => l.to_owned(),
                    })
                    .collect::<Vec<_>>()
            };
            assert_eq!(unpinned(&text), unpinned(original), "{rel}");
            assert_eq!(
                dockerfile_stages_of(rel, &text)?.len(),
                dockerfile_stages(rel)?.len()
            );
            if let Some(previous) = previous {
                ensure!(
                    !text.contains(&format!("sha256:{}", previous.repeat(64))),
                    "{rel}: a refresh kept an old digest"
                );
            }
        }
        // Each tag is looked up once per run, by its tag (never by the old digest).
        let log = std::fs::read_to_string(root.join("lookups.log"))?;
        std::fs::remove_file(root.join("lookups.log"))?;
        let lookups: Vec<&str> = log.lines().collect();
        let distinct: BTreeSet<&str> = lookups.iter().copied().collect();
        assert_eq!(lookups.len(), distinct.len(), "a tag was looked up twice");
        ensure!(
            lookups.iter().all(|l| !l.contains('@')),
            "looked up {lookups:?}"
        );
    }
    let check = pin_images(&root, &["--check"], &resolver, "a")?;
    ensure!(check.ok, "--check after pinning: {}", check.stderr);
    // A registry answer that is not a digest stops the script before any file is rewritten.
    let before: Vec<String> = originals
        .iter()
        .map(|(rel, _)| std::fs::read_to_string(root.join(rel)))
        .collect::<std::io::Result<_>>()?;
    let bad = pin_images(&root, &[], &resolver, "z")?;
    ensure!(
        !bad.ok && bad.stderr.contains("not a sha256 digest"),
        "a bad digest was accepted: {}",
        bad.stderr
    );
    for ((rel, _), before) in originals.iter().zip(&before) {
        assert_eq!(&std::fs::read_to_string(root.join(rel))?, before, "{rel}");
    }
    let leftovers: Vec<_> = std::fs::read_dir(root.join("docker"))?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".pin."))
        .collect();
    ensure!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    Ok(())
}

/// The workspace crates a manifest's `[dependencies]` name (`kvpool-*`).
fn workspace_dependencies(manifest: &str) -> Result<BTreeSet<String>> {
    let text = read(manifest)?;
    let section = text
        .split("\n[")
        .find(|s| s.starts_with("dependencies]"))
        .with_context(|| format!("{manifest} has no [dependencies]"))?;
    Ok(section
        .lines()
        .filter_map(|l| l.split_once(" = "))
        .map(|(name, _)| name.trim().to_owned())
        .filter(|name| name.starts_with("kvpool-"))
        .collect())
}

/// Checks one SBOM that scripts/sbom.sh wrote: a well-formed CycloneDX 1.5 document about
/// `subject` whose references all resolve, which lists `linked` and `present` and not `absent`.
fn check_sbom(
    path: &Path,
    subject: &str,
    linked: &BTreeSet<String>,
    present: &[&str],
    absent: &[&str],
) -> Result<()> {
    let at = path.display();
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path)?)
        .with_context(|| format!("{at} is not JSON"))?;
    assert_eq!(str_at(&doc, "/bomFormat"), "CycloneDX", "{at}");
    assert_eq!(str_at(&doc, "/specVersion"), "1.5", "{at}");
    assert_eq!(doc["version"], 1, "{at}");
    // SOURCE_DATE_EPOCH=1700000000, as the test sets it (cargo-cyclonedx then also leaves out
    // the random serial number, so that the document is reproducible).
    ensure!(doc.get("serialNumber").is_none(), "{at}: not reproducible");
    ensure!(
        str_at(&doc, "/metadata/timestamp").starts_with("2023-11-14T22:13:20"),
        "{at}: the timestamp does not follow SOURCE_DATE_EPOCH"
    );
    let component = &doc["metadata"]["component"];
    assert_eq!(str_at(component, "/name"), subject, "{at}");
    assert_eq!(
        str_at(component, "/version"),
        env!("CARGO_PKG_VERSION"),
        "{at}"
    );
    let mut refs = BTreeSet::from([str_at(component, "/bom-ref").to_owned()]);
    let mut names = BTreeSet::new();
    for c in doc["components"].as_array().context("no components")? {
        let name = str_at(c, "/name");
        ensure!(
            !name.is_empty() && !str_at(c, "/version").is_empty(),
            "{at}: a component without name or version: {c}"
        );
        ensure!(
            str_at(c, "/purl").starts_with(&format!("pkg:cargo/{name}@")),
            "{at}: {name} has no cargo package URL"
        );
        ensure!(
            c["licenses"].as_array().is_some_and(|l| !l.is_empty()),
            "{at}: {name} names no licence"
        );
        ensure!(
            refs.insert(str_at(c, "/bom-ref").to_owned()),
            "{at}: {name}'s bom-ref appears twice"
        );
        names.insert(name.to_owned());
    }
    for dependency in doc["dependencies"]
        .as_array()
        .context("no dependency graph")?
    {
        let from = str_at(dependency, "/ref");
        ensure!(refs.contains(from), "{at}: dependency of unknown {from}");
        for to in dependency["dependsOn"].as_array().into_iter().flatten() {
            let to = to.as_str().unwrap_or_default();
            ensure!(refs.contains(to), "{at}: {from} depends on unknown {to}");
        }
    }
    for name in linked
        .iter()
        .map(String::as_str)
        .chain(present.iter().copied())
    {
        ensure!(names.contains(name), "{at} does not list {name}");
    }
    for name in absent {
        ensure!(!names.contains(*name), "{at} lists {name}");
    }
    Ok(())
}

#[test]
fn sbom_script_writes_a_cyclonedx_document_per_image() -> Result<()> {
    tool("cargo-cyclonedx")?;
    let out = scratch_dir("sbom")?;
    let run = Command::new("bash")
        .arg(repo_root().join("scripts/sbom.sh"))
        .arg(&out)
        .current_dir(repo_root())
        .env("SOURCE_DATE_EPOCH", "1700000000")
        .output()
        .context("starting scripts/sbom.sh")?;
    ensure!(
        run.status.success(),
        "scripts/sbom.sh failed:\n{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    let binary = workspace_dependencies("Cargo.toml")?;
    let extension = workspace_dependencies("crates/python/Cargo.toml")?;
    ensure!(!binary.is_empty() && !extension.is_empty());
    // The kvpool image: the binary without RDMA and the Python extension; the agent image: the
    // binary with the rdma feature, which brings the verbs bindings.
    check_sbom(
        &out.join("kvpool/kvpool.cdx.json"),
        "kvpool",
        &binary,
        &[],
        &["rdma-sys"],
    )?;
    check_sbom(
        &out.join("kvpool/kvpool-python.cdx.json"),
        "kvpool-python",
        &extension,
        &["pyo3"],
        &["rdma-sys"],
    )?;
    check_sbom(
        &out.join("kvpool-agent/kvpool.cdx.json"),
        "kvpool",
        &binary,
        &["rdma-sys"],
        &[],
    )?;
    // cargo-cyclonedx writes beside every member's Cargo.toml; the script leaves nothing there.
    let mut stray = Vec::new();
    let mut dirs = vec![repo_root()];
    for parent in ["crates", "."] {
        for entry in std::fs::read_dir(repo_root().join(parent))? {
            let path = entry?.path();
            if path.join("Cargo.toml").is_file() {
                dirs.push(path);
            }
        }
    }
    for dir in dirs {
        for entry in std::fs::read_dir(&dir)? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            if name.starts_with("kvpool-sbom-") {
                stray.push(dir.join(name));
            }
        }
    }
    ensure!(stray.is_empty(), "scripts/sbom.sh left {stray:?}");
    Ok(())
}

/// The PodMonitors select, by the labels the operator puts on every pod it creates
/// (kvpool_crd::labels), each of its workloads exactly once, on the port that serves /metrics.
#[test]
fn pod_monitors_select_every_workload_the_operator_creates() -> Result<()> {
    use kvpool_crd::labels::{APP_MANAGED_BY, COMPONENT, Component, MANAGED_BY_VALUE};
    let (_, objects) = render_objects(&PRODUCTION)?;
    let monitors: Vec<&PodMonitor> = objects_of!(objects, Object::PodMonitor).collect();
    ensure!(
        !monitors.is_empty(),
        "the production example renders no PodMonitor"
    );
    let mut covered = BTreeMap::new();
    for monitor in &monitors {
        let name = monitor.metadata.name.clone().unwrap_or_default();
        let selector = &monitor.spec.selector;
        assert_eq!(
            selector.match_labels.clone().unwrap_or_default(),
            BTreeMap::from([(APP_MANAGED_BY.to_owned(), MANAGED_BY_VALUE.to_owned())]),
            "{name}"
        );
        let expressions = selector.match_expressions.clone().unwrap_or_default();
        let [expression] = expressions.as_slice() else {
            bail!("{name}: one component expression expected, got {expressions:?}");
        };
        assert_eq!(
            (expression.key.as_str(), expression.operator.as_str()),
            (COMPONENT, "In")
        );
        let [endpoint] = monitor.spec.pod_metrics_endpoints.as_slice() else {
            bail!("{name}: one endpoint expected");
        };
        assert_eq!(endpoint.path, "/metrics", "{name}");
        for value in expression.values.clone().unwrap_or_default() {
            let component = Component::from_label(&value)
                .with_context(|| format!("{name} selects unknown component {value}"))?;
            // The servers the operator builds name their admin port `admin`; engines serve
            // /metrics on their API port, `http`.
            let port = match component {
                Component::Prefill | Component::Decode => "http",
                _ => "admin",
            };
            assert_eq!(endpoint.port, port, "{name}: {value}");
            ensure!(
                covered.insert(component, name.clone()).is_none(),
                "{value} is scraped twice"
            );
        }
        let relabeled: BTreeSet<&str> = endpoint
            .relabelings
            .iter()
            .map(|r| r.target_label.as_str())
            .collect();
        assert_eq!(relabeled, BTreeSet::from(["pool", "component"]), "{name}");
        assert_eq!(
            monitor.spec.namespace_selector.match_names,
            vec!["llm".to_owned()],
            "{name}"
        );
    }
    let all: BTreeSet<Component> = Component::ALL.into_iter().collect();
    assert_eq!(covered.keys().copied().collect::<BTreeSet<_>>(), all);
    Ok(())
}

/// One Node update as the API server admits it, through the chart's agent admission policy
/// (`templates/agent-rbac.yaml`), evaluated with the Kubernetes CEL library: `None` when it is
/// admitted (or the policy does not apply to the user), else the message of the first failing
/// validation. Variables are bound in order as `variables.<name>`, as the API server does.
fn admit(
    policy: &ValidatingAdmissionPolicy,
    user: &str,
    token_node: Option<&str>,
    sub_resource: &str,
    old: &Value,
    new: &Value,
) -> Result<Option<String>> {
    use kube_cel::KubeCelExt;
    use kube_cel::cel::{Context as CelContext, Program, Value as CelValue};
    let extra: BTreeMap<&str, Vec<&str>> = token_node
        .map(|n| ("authentication.kubernetes.io/node-name", vec![n]))
        .into_iter()
        .collect();
    let request = serde_json::json!({
        "operation": "UPDATE",
        "subResource": sub_resource,
        "userInfo": {"username": user, "groups": ["system:serviceaccounts"], "extra": extra},
    });
    let mut ctx = CelContext::default();
    ctx.register_all();
    ctx.add_variable("object", new.clone())?;
    ctx.add_variable("oldObject", old.clone())?;
    ctx.add_variable("request", request)?;
    let eval = |ctx: &CelContext, expr: &str| -> Result<CelValue> {
        let program = Program::compile(expr).map_err(|e| anyhow::anyhow!("{expr}: {e}"))?;
        program
            .execute(ctx)
            .map_err(|e| anyhow::anyhow!("{expr}: {e}"))
    };
    let spec = policy.spec.as_ref().context("policy spec")?;
    for m in spec.match_conditions.iter().flatten() {
        if eval(&ctx, &m.expression)? != CelValue::Bool(true) {
            return Ok(None);
        }
    }
    let mut variables: std::collections::HashMap<String, CelValue> = Default::default();
    for v in spec.variables.iter().flatten() {
        let value = eval(&ctx, &v.expression)?;
        variables.insert(v.name.clone(), value);
        ctx.add_variable_from_value("variables", variables.clone());
    }
    for v in spec.validations.iter().flatten() {
        if eval(&ctx, &v.expression)? != CelValue::Bool(true) {
            return Ok(Some(v.message.clone().unwrap_or_default()));
        }
    }
    Ok(None)
}

/// A Node named `name` with `labels`, `annotations` and `spec`.
fn node(name: &str, labels: Value, annotations: Value, spec: Value) -> Value {
    serde_json::json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": spec,
    })
}

/// Issue 38: RBAC gives agents `patch` on every Node; the chart's ValidatingAdmissionPolicy
/// narrows it to the Node the agent's pod runs on and to `kvpool.dev/` labels and annotations.
#[test]
fn the_agent_node_policy_admits_only_the_agents_own_node_and_kvpool_keys() -> Result<()> {
    let (yaml, objects) = render_objects(&AGENT_NODE_ACCESS)?;
    // Agent ServiceAccounts live in the pools' namespaces, so this render stays out of
    // `renders()` (whose checks expect the release namespace); its schemas are checked here.
    kubernetes_validate("agent_node_policy", "agent-node-access", &yaml)?;
    let policy = objects_of!(objects, Object::AdmissionPolicy)
        .next()
        .context("the policy renders with agent ServiceAccounts")?;
    let binding = objects_of!(objects, Object::AdmissionPolicyBinding)
        .next()
        .context("and its binding")?;
    let binding_spec = binding.spec.as_ref().context("binding spec")?;
    assert_eq!(
        binding_spec.policy_name.as_deref(),
        policy.metadata.name.as_deref()
    );
    assert_eq!(
        binding_spec.validation_actions.as_deref(),
        Some(&["Deny".to_owned()][..])
    );

    let agent = "system:serviceaccount:llm:kvpool-agent";
    let other_agent = "system:serviceaccount:ml:agents";
    let spec = serde_json::json!({"podCIDR": "10.0.0.0/24"});
    let labels =
        serde_json::json!({"kubernetes.io/hostname": "gpu-1", "topology.kubernetes.io/zone": "a"});
    let old = node("gpu-1", labels.clone(), serde_json::json!({}), spec.clone());
    let with =
        |labels: Value, annotations: Value, spec: Value| node("gpu-1", labels, annotations, spec);
    let mut kv_labels = labels.clone();
    kv_labels["kvpool.dev/numa-nodes"] = "2".into();
    let labelled = with(
        kv_labels.clone(),
        serde_json::json!({"kvpool.dev/topology": "{}"}),
        spec.clone(),
    );

    // Its own node, kvpool.dev/ keys only: admitted, for either agent ServiceAccount.
    for user in [agent, other_agent] {
        assert_eq!(
            admit(policy, user, Some("gpu-1"), "", &old, &labelled)?,
            None,
            "{user}"
        );
    }
    // Removing its own kvpool.dev/ label again: admitted.
    assert_eq!(
        admit(policy, agent, Some("gpu-1"), "", &labelled, &old)?,
        None
    );
    let denied = |msg: Option<String>, needle: &str| {
        let m = msg.unwrap_or_default();
        assert!(
            m.contains(needle),
            "expected a denial naming {needle:?}, got {m:?}"
        );
    };
    // Another node, or a token bound to no node: denied.
    denied(
        admit(policy, agent, Some("gpu-2"), "", &old, &labelled)?,
        "only the Node its pod runs on",
    );
    denied(
        admit(policy, agent, None, "", &old, &labelled)?,
        "only the Node its pod runs on",
    );
    // Its own node, other keys: denied.
    let mut zone = labels.clone();
    zone["topology.kubernetes.io/zone"] = "b".into();
    denied(
        admit(
            policy,
            agent,
            Some("gpu-1"),
            "",
            &old,
            &with(zone, serde_json::json!({}), spec.clone()),
        )?,
        "kvpool.dev/ labels",
    );
    let mut dropped = labels.clone();
    dropped
        .as_object_mut()
        .context("labels")?
        .remove("topology.kubernetes.io/zone");
    denied(
        admit(
            policy,
            agent,
            Some("gpu-1"),
            "",
            &old,
            &with(dropped, serde_json::json!({}), spec.clone()),
        )?,
        "kvpool.dev/ labels",
    );
    let mut role = labels.clone();
    role["node-role.kubernetes.io/control-plane"] = "".into();
    denied(
        admit(
            policy,
            agent,
            Some("gpu-1"),
            "",
            &old,
            &with(role, serde_json::json!({}), spec.clone()),
        )?,
        "kvpool.dev/ labels",
    );
    denied(
        admit(
            policy,
            agent,
            Some("gpu-1"),
            "",
            &old,
            &with(
                labels.clone(),
                serde_json::json!({"other/x": "1"}),
                spec.clone(),
            ),
        )?,
        "kvpool.dev/ annotations",
    );
    let tainted = serde_json::json!({"podCIDR": "10.0.0.0/24", "taints": [{"key": "k", "effect": "NoSchedule"}]});
    denied(
        admit(
            policy,
            agent,
            Some("gpu-1"),
            "",
            &old,
            &with(labels.clone(), serde_json::json!({}), tainted),
        )?,
        "spec",
    );
    denied(
        admit(policy, agent, Some("gpu-1"), "status", &old, &labelled)?,
        "status",
    );
    // Anyone else is left to RBAC: the policy does not apply.
    let mut zone = labels.clone();
    zone["topology.kubernetes.io/zone"] = "b".into();
    let admin_change = node("gpu-2", zone, serde_json::json!({}), spec.clone());
    assert_eq!(
        admit(policy, "kubernetes-admin", None, "", &old, &admin_change)?,
        None
    );
    assert_eq!(
        admit(
            policy,
            "system:serviceaccount:llm:other",
            Some("gpu-1"),
            "",
            &old,
            &admin_change
        )?,
        None
    );
    Ok(())
}

/// Issue 34: every alert the chart renders carries a `runbook_url` into a section of
/// docs/observability.md ("Runbooks"), made from `metrics.prometheusRule.runbookBaseURL`.
#[test]
fn every_alert_links_its_runbook_section() -> Result<()> {
    let render = Render {
        values: None,
        sets: &[
            "metrics.prometheusRule.enabled=true",
            "operator.leaderElection.enabled=true",
        ],
    };
    let (_, objects) = render_objects(&render)?;
    let docs = read("docs/observability.md")?;
    let anchors: BTreeSet<String> = docs
        .lines()
        .filter_map(|l| l.strip_prefix("### "))
        .map(|h| {
            h.trim()
                .to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-')
                .map(|c| if c == ' ' { '-' } else { c })
                .collect()
        })
        .collect();
    let base = "https://github.com/kvpool/kvpool/blob/main/docs/observability.md#";
    let mut alerts = 0;
    for rule in objects_of!(objects, Object::PrometheusRule) {
        for group in &rule.spec.groups {
            for r in group.rules.iter().filter(|r| r.alert.is_some()) {
                let alert = r.alert.as_deref().unwrap_or_default();
                let url = r
                    .annotations
                    .get("runbook_url")
                    .with_context(|| format!("{alert} has no runbook_url"))?;
                let anchor = url
                    .strip_prefix(base)
                    .with_context(|| format!("{alert}: {url} is not under {base}"))?;
                ensure!(anchor == alert.to_lowercase(), "{alert}: {url}");
                ensure!(
                    anchors.contains(anchor),
                    "{alert}: docs/observability.md has no section #{anchor}"
                );
                alerts += 1;
            }
        }
    }
    ensure!(alerts >= 16, "only {alerts} alerts rendered");
    Ok(())
}

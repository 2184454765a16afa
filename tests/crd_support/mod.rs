//! Test helpers for the kvpool custom resources: what an API server would check on a create or
//! update, run in-process. The OpenAPI half uses `jsonschema` on the CRD's openAPIV3Schema
//! (strict: unknown fields are errors, as `kubectl apply --validate=strict` reports them); the
//! CEL half uses `kube-cel` on the same schema's `x-kubernetes-validations`, after applying the
//! schema's defaults like the API server. The rule texts always come from the generated CRD.
#![allow(dead_code)]

pub mod reference;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use kvpool_crd::{
    DecodePool, KVCachePool, PrefillPool, ValidatedEnginePool, ValidatedKVCachePool, validate_name,
};
use serde_json::{Map, Value, json};

/// The three kinds (named as the API names them).
#[allow(clippy::enum_variant_names)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    KVCachePool,
    PrefillPool,
    DecodePool,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::KVCachePool, Kind::PrefillPool, Kind::DecodePool];

    pub fn crd(self) -> CustomResourceDefinition {
        match self {
            Kind::KVCachePool => KVCachePool::crd(),
            Kind::PrefillPool => PrefillPool::crd(),
            Kind::DecodePool => DecodePool::crd(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::KVCachePool => "KVCachePool",
            Kind::PrefillPool => "PrefillPool",
            Kind::DecodePool => "DecodePool",
        }
    }

    pub fn from_name(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }
}

fn generate_schema(kind: Kind) -> Value {
    let crd = kind.crd();
    assert_eq!(crd.spec.versions.len(), 1, "one version per CRD");
    let schema = crd.spec.versions[0]
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .expect("generated CRD has an openAPIV3Schema");
    serde_json::to_value(schema).expect("schema serializes")
}

fn index(kind: Kind) -> usize {
    match kind {
        Kind::KVCachePool => 0,
        Kind::PrefillPool => 1,
        Kind::DecodePool => 2,
    }
}

/// The openAPIV3Schema of the (only) version of a CRD, as JSON (generated once per process).
pub fn schema(kind: Kind) -> Value {
    static SCHEMAS: std::sync::OnceLock<[Value; 3]> = std::sync::OnceLock::new();
    SCHEMAS.get_or_init(|| Kind::ALL.map(generate_schema))[index(kind)].clone()
}

thread_local! {
    /// Compiled CEL rules of each kind, compiled once per test thread.
    static COMPILED: [kube_cel::CompiledSchema; 3] =
        Kind::ALL.map(|k| kube_cel::compile_schema(&schema(k)));
}

/// One `x-kubernetes-validations` entry and where it sits.
#[derive(Debug, Clone)]
pub struct RuleAt {
    /// Property path from the object root, e.g. `spec.dram`.
    pub path: String,
    pub rule: String,
    pub message: String,
    /// The rule's `fieldPath`, relative to `path`, if it has one.
    pub field_path: Option<String>,
}

/// Every CEL rule in a schema, depth first.
pub fn rules(schema: &Value) -> Vec<RuleAt> {
    fn walk(s: &Value, path: &str, out: &mut Vec<RuleAt>) {
        if let Some(list) = s.get("x-kubernetes-validations").and_then(Value::as_array) {
            for r in list {
                out.push(RuleAt {
                    path: path.to_owned(),
                    rule: r["rule"].as_str().expect("rule is a string").to_owned(),
                    message: r["message"]
                        .as_str()
                        .expect("every rule has a message")
                        .to_owned(),
                    field_path: r["fieldPath"].as_str().map(str::to_owned),
                });
            }
        }
        if let Some(props) = s.get("properties").and_then(Value::as_object) {
            for (name, sub) in props {
                let p = if path.is_empty() {
                    name.clone()
                } else {
                    format!("{path}.{name}")
                };
                walk(sub, &p, out);
            }
        }
        if let Some(items) = s.get("items") {
            walk(items, &format!("{path}[]"), out);
        }
        if let Some(extra) = s.get("additionalProperties").filter(|a| a.is_object()) {
            walk(extra, &format!("{path}{{}}"), out);
        }
    }
    let mut out = Vec::new();
    walk(schema, "", &mut out);
    out
}

/// A failed CEL rule: where the API server reports it and its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CelFailure {
    /// Field path from the object root, e.g. `spec.transport.sriov`.
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for CelFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// The CEL rules that `object` fails (as an update of `old` when given).
pub fn cel_failures(kind: Kind, object: &Value, old: Option<&Value>) -> Vec<CelFailure> {
    let result = COMPILED.with(|c| kube_cel::validate_compiled(&c[index(kind)], object, old));
    match result {
        Ok(()) => Vec::new(),
        Err(errors) => errors
            .into_vec()
            .into_iter()
            .map(|e| CelFailure {
                path: e.field_path,
                message: e.message,
            })
            .collect(),
    }
}

/// Messages of the CEL rules that `object` fails.
pub fn cel_errors(kind: Kind, object: &Value, old: Option<&Value>) -> Vec<String> {
    cel_failures(kind, object, old)
        .into_iter()
        .map(|f| f.message)
        .collect()
}

/// The schema in the form a JSON-schema validator understands, made strict the way the API
/// server's strict field validation is: OpenAPI `nullable` becomes a `null` type,
/// `x-kubernetes-int-or-string` becomes integer-or-string, `x-kubernetes-list-type: set` (and
/// `map`) becomes `uniqueItems`, and objects with declared properties reject unknown ones. The implicit root fields (apiVersion, kind, metadata) are declared.
pub fn strict_json_schema(kind: Kind) -> Value {
    fn convert(s: &Value) -> Value {
        let Some(map) = s.as_object() else {
            return s.clone();
        };
        let mut out = Map::new();
        for (k, v) in map {
            let converted = match k.as_str() {
                "properties" => Value::Object(
                    v.as_object()
                        .expect("properties is an object")
                        .iter()
                        .map(|(name, sub)| (name.clone(), convert(sub)))
                        .collect(),
                ),
                "items" | "additionalProperties" | "not" => convert(v),
                "allOf" | "anyOf" | "oneOf" => {
                    Value::Array(v.as_array().expect("array").iter().map(convert).collect())
                }
                _ => v.clone(),
            };
            out.insert(k.clone(), converted);
        }
        if map.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true))
            && !map.contains_key("type")
        {
            out.insert("type".into(), json!(["integer", "string"]));
        }
        if map.get("nullable") == Some(&Value::Bool(true)) {
            match out.get("type").cloned() {
                Some(Value::String(t)) => {
                    out.insert("type".into(), json!([t, "null"]));
                }
                Some(Value::Array(mut ts)) => {
                    ts.push(json!("null"));
                    out.insert("type".into(), Value::Array(ts));
                }
                _ => {}
            }
        }
        // A list map refuses two items with equal keys; JSON schema can only refuse equal
        // items, which covers the repeated-entry case (the Rust-side check covers the rest).
        if map.get("x-kubernetes-list-type") == Some(&json!("set"))
            || map.get("x-kubernetes-list-type") == Some(&json!("map"))
        {
            out.insert("uniqueItems".into(), Value::Bool(true));
        }
        let preserve = map.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
        if map.contains_key("properties") && !map.contains_key("additionalProperties") && !preserve
        {
            out.insert("additionalProperties".into(), Value::Bool(false));
        }
        Value::Object(out)
    }
    let mut root = convert(&schema(kind));
    let props = root["properties"]
        .as_object_mut()
        .expect("root has properties");
    props.insert(
        "apiVersion".into(),
        json!({"type": "string", "enum": ["kvpool.dev/v1alpha1"]}),
    );
    props.insert(
        "kind".into(),
        json!({"type": "string", "enum": [kind.name()]}),
    );
    props.insert("metadata".into(), json!({"type": "object"}));
    root
}

/// OpenAPI (non-CEL) violations of `object`, each as `path: message`.
pub fn openapi_errors(kind: Kind, object: &Value) -> Vec<String> {
    static VALIDATORS: std::sync::OnceLock<Vec<jsonschema::Validator>> = std::sync::OnceLock::new();
    let validators = VALIDATORS.get_or_init(|| {
        Kind::ALL
            .map(|k| {
                jsonschema::draft4::new(&strict_json_schema(k))
                    .expect("CRD schema compiles as JSON schema")
            })
            .into()
    });
    validators[index(kind)]
        .iter_errors(object)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

/// Everything an API server would reject on create (or on update from `old`): OpenAPI errors
/// first, then failing CEL rules.
pub fn admission_errors(kind: Kind, object: &Value, old: Option<&Value>) -> Vec<String> {
    let mut errors = openapi_errors(kind, object);
    errors.extend(
        cel_failures(kind, object, old)
            .iter()
            .map(ToString::to_string),
    );
    errors
}

/// Parses a YAML document into JSON.
pub fn yaml_to_json(text: &str) -> Value {
    serde_saphyr::from_str(text).expect("fixture is valid YAML")
}

/// All CRDs' rule messages per kind.
pub fn all_rules() -> Vec<(Kind, RuleAt)> {
    Kind::ALL
        .into_iter()
        .flat_map(|k| rules(&schema(k)).into_iter().map(move |r| (k, r)))
        .collect()
}

/// What the operator's own checks say about an object: it parses into its Rust type, its name
/// fits, and its spec validates.
pub fn rust_validation(kind: Kind, object: &Value) -> Result<(), String> {
    fn parse<T: serde::de::DeserializeOwned>(object: &Value) -> Result<T, String> {
        serde_json::from_value(object.clone()).map_err(|e| format!("does not parse: {e}"))
    }
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    validate_name(name).map_err(|e| e.to_string())?;
    let checked = match kind {
        Kind::KVCachePool => {
            ValidatedKVCachePool::validate(&parse::<KVCachePool>(object)?.spec).map(drop)
        }
        Kind::PrefillPool => {
            ValidatedEnginePool::from_prefill(&parse::<PrefillPool>(object)?.spec).map(drop)
        }
        Kind::DecodePool => {
            ValidatedEnginePool::from_decode(&parse::<DecodePool>(object)?.spec).map(drop)
        }
    };
    checked.map_err(|e| e.to_string())
}

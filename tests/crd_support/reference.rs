//! Renders the field reference of docs/crds.md from the generated CRDs (fields, types, defaults,
//! schema constraints, CEL rules, printer columns), so the document cannot drift from the types.

use std::fmt::Write as _;

use serde_json::Value;

use super::{Kind, rules, schema};

pub const BEGIN: &str =
    "<!-- BEGIN GENERATED REFERENCE (tests/crd_drift.rs; do not edit by hand) -->";
pub const END: &str = "<!-- END GENERATED REFERENCE -->";

/// Fields whose type comes from Kubernetes itself: shown by name, not expanded.
const EXTERNAL: &[(&str, &str)] = &[
    ("spec.tolerations", "[]Toleration (core/v1)"),
    ("spec.agent.resources", "ResourceRequirements (core/v1)"),
    ("spec.master.resources", "ResourceRequirements (core/v1)"),
    ("spec.conductor.resources", "ResourceRequirements (core/v1)"),
    ("spec.engine.env", "[]EnvVar (core/v1)"),
    ("spec.resources.container", "ResourceRequirements (core/v1)"),
    ("spec.imagePullSecrets", "[]LocalObjectReference (core/v1)"),
    ("spec.template.spec.containers", "[]Container (core/v1)"),
    ("spec.template.spec.initContainers", "[]Container (core/v1)"),
    ("spec.template.spec.volumes", "[]Volume (core/v1)"),
    (
        "spec.template.spec.imagePullSecrets",
        "[]LocalObjectReference (core/v1)",
    ),
    ("spec.template.spec.affinity", "Affinity (core/v1)"),
    ("spec.template.spec.tolerations", "[]Toleration (core/v1)"),
    (
        "spec.template.spec.topologySpreadConstraints",
        "[]TopologySpreadConstraint (core/v1)",
    ),
    (
        "spec.template.spec.securityContext",
        "PodSecurityContext (core/v1)",
    ),
    ("status.conditions", "[]Condition (meta/v1)"),
];

fn one_line(text: &str) -> String {
    let first_paragraph = text.split("\n\n").next().unwrap_or_default();
    first_paragraph
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

fn type_of(s: &Value) -> String {
    if s.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true)) {
        return "quantity".into();
    }
    if let Some(values) = s.get("enum").and_then(Value::as_array) {
        let names: Vec<String> = values
            .iter()
            .filter_map(Value::as_str)
            .map(|v| format!("`{v}`"))
            .collect();
        return format!("enum: {}", names.join(", "));
    }
    match s.get("type").and_then(Value::as_str) {
        Some("array") => format!("[]{}", s.get("items").map_or_else(|| "?".into(), type_of)),
        Some("object") => match s.get("additionalProperties").filter(|a| a.is_object()) {
            Some(values) => format!("map[string]{}", type_of(values)),
            None => "object".into(),
        },
        Some(t) => t.to_owned(),
        None => "any".into(),
    }
}

fn number(v: &Value) -> String {
    v.as_f64()
        .map_or_else(|| v.to_string(), |f| format!("{}", f as i64))
}

fn constraints(s: &Value, required: bool) -> String {
    let mut out = Vec::new();
    if required {
        out.push("required".to_owned());
    }
    match (s.get("minimum"), s.get("maximum")) {
        (Some(lo), Some(hi)) => out.push(format!("{}–{}", number(lo), number(hi))),
        (Some(lo), None) => out.push(format!("≥ {}", number(lo))),
        (None, Some(hi)) => out.push(format!("≤ {}", number(hi))),
        (None, None) => {}
    }
    match (s.get("minLength"), s.get("maxLength")) {
        (Some(lo), Some(hi)) => out.push(format!("length {}–{}", number(lo), number(hi))),
        (None, Some(hi)) => out.push(format!("length ≤ {}", number(hi))),
        (Some(lo), None) => out.push(format!("length ≥ {}", number(lo))),
        (None, None) => {}
    }
    if let Some(p) = s.get("pattern").and_then(Value::as_str) {
        out.push(format!("pattern `{}`", p.replace('|', "\\|")));
    }
    match s.get("x-kubernetes-list-type").and_then(Value::as_str) {
        Some("set") => out.push("unique items".to_owned()),
        Some("map") => {
            let keys: Vec<String> = s
                .get("x-kubernetes-list-map-keys")
                .and_then(Value::as_array)
                .map(|k| {
                    k.iter()
                        .filter_map(Value::as_str)
                        .map(|k| format!("`{k}`"))
                        .collect()
                })
                .unwrap_or_default();
            out.push(format!("unique by {}", keys.join(", ")));
        }
        _ => {}
    }
    if let Some(n) = s.get("maxItems") {
        out.push(format!("≤ {} items", number(n)));
    }
    if let Some(items) = s.get("items") {
        if let (Some(lo), Some(hi)) = (items.get("minLength"), items.get("maxLength")) {
            out.push(format!("items: length {}–{}", number(lo), number(hi)));
        }
        if let Some(p) = items.get("pattern").and_then(Value::as_str) {
            out.push(format!("items: pattern `{p}`"));
        }
    }
    out.join("; ")
}

fn default_of(s: &Value) -> String {
    match s.get("default") {
        None => String::new(),
        Some(Value::Object(_)) => String::new(),
        Some(Value::Array(a)) if a.is_empty() => String::new(),
        Some(Value::String(v)) => format!("`{v}`"),
        Some(v) => format!("`{v}`"),
    }
}

fn fields(s: &Value, path: &str, out: &mut String) {
    let Some(props) = s.get("properties").and_then(Value::as_object) else {
        return;
    };
    let required: Vec<&str> = s
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    for (name, sub) in props {
        let p = if path.is_empty() {
            name.clone()
        } else {
            format!("{path}.{name}")
        };
        let external = EXTERNAL.iter().find(|(x, _)| *x == p).map(|(_, t)| *t);
        let ty = external.map_or_else(|| type_of(sub), str::to_owned);
        let description = sub
            .get("description")
            .and_then(Value::as_str)
            .map(one_line)
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "| `{p}` | {ty} | {} | {} | {description} |",
            default_of(sub),
            constraints(sub, required.contains(&name.as_str()))
        );
        if external.is_none() {
            fields(sub, &p, out);
            if let Some(items) = sub.get("items") {
                fields(items, &format!("{p}[]"), out);
            }
        }
    }
}

/// `one`, or `many` for more than one name, then the names in backticks: "short names `a`, `b`".
fn named_list(one: &str, many: &str, names: Option<&[String]>) -> String {
    let names = names.unwrap_or_default();
    let listed: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    let noun = if names.len() > 1 { many } else { one };
    format!("{noun} {}", listed.join(", "))
}

fn kind_section(kind: Kind, out: &mut String) {
    let crd = kind.crd();
    let names = &crd.spec.names;
    let version = &crd.spec.versions[0];
    let s = schema(kind);
    let _ = writeln!(out, "### {} reference\n", kind.name());
    let _ = writeln!(
        out,
        "`{}`, plural `{}`, {}, {}; scope {}; subresources: {}.\n",
        crd.metadata.name.as_deref().unwrap_or_default(),
        names.plural,
        named_list("short name", "short names", names.short_names.as_deref()),
        named_list("category", "categories", names.categories.as_deref()),
        crd.spec.scope,
        {
            let sub = version.subresources.as_ref();
            let mut v = Vec::new();
            if sub.is_some_and(|s| s.status.is_some()) {
                v.push("status");
            }
            if sub.is_some_and(|s| s.scale.is_some()) {
                v.push("scale (`spec.replicas`, `status.replicas`, `status.selector`)");
            }
            v.join(", ")
        }
    );
    out.push_str("| Field | Type | Default | Constraints | Description |\n|---|---|---|---|---|\n");
    for part in ["spec", "status"] {
        if let Some(sub) = s["properties"].get(part) {
            let wrapper = serde_json::json!({"properties": {part: sub}, "required": s.get("required").cloned().unwrap_or_default()});
            let mut rows = String::new();
            fields(&wrapper, "", &mut rows);
            out.push_str(&rows);
        }
    }
    let kind_rules = rules(&s);
    if !kind_rules.is_empty() {
        let _ = writeln!(
            out,
            "\nValidation rules (CEL, `x-kubernetes-validations`):\n"
        );
        out.push_str("| On | Rule | Message |\n|---|---|---|\n");
        for r in kind_rules {
            let _ = writeln!(
                out,
                "| `{}` | `{}` | {} |",
                if r.path.is_empty() {
                    "(object)"
                } else {
                    r.path.as_str()
                },
                r.rule.replace('|', "\\|"),
                r.message
            );
        }
    }
    if let Some(fields) = version.selectable_fields.as_ref().filter(|f| !f.is_empty()) {
        let paths: Vec<String> = fields
            .iter()
            .map(|f| format!("`{}`", f.json_path))
            .collect();
        let _ = writeln!(
            out,
            "\nField selectors (`kubectl get --field-selector`): {}.",
            paths.join(", ")
        );
    }
    let _ = writeln!(
        out,
        "\nPrinter columns (`kubectl get`; `-o wide` adds the priority-1 ones):\n"
    );
    out.push_str("| Column | Type | JSONPath | Wide only |\n|---|---|---|---|\n");
    for c in version.additional_printer_columns.iter().flatten() {
        let _ = writeln!(
            out,
            "| {} | {} | `{}` | {} |",
            c.name,
            c.type_,
            c.json_path,
            if c.priority.unwrap_or(0) > 0 {
                "yes"
            } else {
                ""
            }
        );
    }
    out.push('\n');
}

/// The generated block, markers included.
pub fn render() -> String {
    for (path, _) in EXTERNAL {
        let known = Kind::ALL.into_iter().any(|k| {
            let s = schema(k);
            let mut node = &s;
            path.split('.').all(
                |seg| match node.get("properties").and_then(|p| p.get(seg)) {
                    Some(next) => {
                        node = next;
                        true
                    }
                    None => false,
                },
            )
        });
        assert!(known, "EXTERNAL lists {path}, which no CRD has");
    }
    let mut out = format!("{BEGIN}\n\n");
    for kind in Kind::ALL {
        kind_section(kind, &mut out);
    }
    out.push_str(END);
    out
}

/// Replaces the generated block of a document with a fresh one.
pub fn splice_into(doc: &str) -> Result<String, String> {
    let start = doc
        .find(BEGIN)
        .ok_or_else(|| format!("missing marker {BEGIN}"))?;
    let end = doc
        .find(END)
        .ok_or_else(|| format!("missing marker {END}"))?;
    if end < start {
        return Err("END marker before BEGIN marker".into());
    }
    Ok(format!(
        "{}{}{}",
        &doc[..start],
        render(),
        &doc[end + END.len()..]
    ))
}

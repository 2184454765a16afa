//! The user's part of the engine pods (`spec.template`) merged under the pod the operator
//! built, so that the operator's fields always win: objects merge field by field, and wherever
//! both set a value the operator's stays and the template's field is reported (the
//! `TemplateConflict` condition names it). Lists merge by key: containers by name (the one named
//! `engine` is merged into the engine container, any other is added as a sidecar), init
//! containers, volumes and pull secrets by name, the engine container's `env` by name,
//! `volumeMounts` by path and `ports` by number or name, each added when new and kept as the
//! operator's when the key is the operator's; tolerations are joined. Two operator values are
//! defaults that the template replaces: `automountServiceAccountToken` and the `shm` volume
//! behind `/dev/shm`. I/O boundary: none.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::PodTemplateSpec;
use kvpool_crd::EnginePodTemplate;
use serde_json::{Map, Value};

/// How the engine pool's field is named in conflicts: the root of the template.
const ROOT: &str = "spec.template";

/// The volume behind `/dev/shm`, which a template's volume of that name replaces.
pub const SHM_VOLUME: &str = "shm";

/// Fields (by shape) whose operator value is a default the template replaces.
const REPLACEABLE: [&str; 1] = [".spec.automountServiceAccountToken"];

/// Objects (by the end of their shape) that are one value: a template's probe, lifecycle or
/// seccomp profile is not mixed with the operator's (two handlers would be invalid).
const ATOMIC: [&str; 5] = [
    ".readinessProbe",
    ".livenessProbe",
    ".startupProbe",
    ".lifecycle",
    ".seccompProfile",
];

/// Maps (by the end of their shape) whose keys are shown as `["key"]` in conflicts.
const MAPS: [&str; 5] = [
    ".labels",
    ".annotations",
    ".nodeSelector",
    ".limits",
    ".requests",
];

/// How the items of a list merge.
#[derive(Clone, Copy)]
enum Items {
    /// An item of the template with the key of an operator item is merged into it.
    Merged,
    /// An item of the template with the key of an operator item is a conflict unless equal.
    Whole,
}

/// The lists merged by key: their shape, the fields that identify an item (an item shares any
/// of them with another: the same item; none: equal items are one) and how items merge.
const LISTS: [(&str, &[&str], Items); 8] = [
    (".spec.containers", &["name"], Items::Merged),
    (".spec.initContainers", &["name"], Items::Whole),
    (".spec.volumes", &["name"], Items::Whole),
    (".spec.imagePullSecrets", &["name"], Items::Whole),
    (".spec.tolerations", &[], Items::Whole),
    (".spec.containers[].env", &["name"], Items::Whole),
    (
        ".spec.containers[].volumeMounts",
        &["mountPath"],
        Items::Whole,
    ),
    (
        ".spec.containers[].ports",
        &["name", "containerPort"],
        Items::Whole,
    ),
];

/// Merges `template` under `pod` (the operator's, complete) and returns the template's fields
/// that the operator's values overrode, as paths below the engine pool (`spec.template...`),
/// each once, in the order found.
pub fn merge(template: &EnginePodTemplate, pod: &mut PodTemplateSpec) -> Vec<String> {
    let mut m = Merge::default();
    let template = m.without_clashing_names(template, pod);
    let (Ok(theirs), Ok(ours)) = (serde_json::to_value(&template), serde_json::to_value(&*pod))
    else {
        // Both are plain data; serializing them cannot fail. Keep the operator's pod.
        return vec![ROOT.to_owned()];
    };
    let merged = m.value("", ROOT, theirs, ours);
    match serde_json::from_value(merged) {
        Ok(p) => *pod = p,
        // Objects and lists of a pod template merged by field stay a pod template; should
        // that not hold, the operator's pod runs and the whole template is named.
        Err(_) => return vec![ROOT.to_owned()],
    }
    m.conflicts
}

#[derive(Default)]
struct Merge {
    conflicts: Vec<String>,
}

impl Merge {
    fn conflict(&mut self, shown: String) {
        if !self.conflicts.contains(&shown) {
            self.conflicts.push(shown);
        }
    }

    /// `template` without the containers named like an init container of `pod` and the init
    /// containers named like a container of `pod` (a pod's container names are one namespace).
    fn without_clashing_names(
        &mut self,
        template: &EnginePodTemplate,
        pod: &PodTemplateSpec,
    ) -> EnginePodTemplate {
        let mut template = template.clone();
        let Some((spec, ours)) = template.spec.as_mut().zip(pod.spec.as_ref()) else {
            return template;
        };
        let names = |list: &[k8s_openapi::api::core::v1::Container]| -> BTreeSet<String> {
            list.iter().map(|c| c.name.clone()).collect()
        };
        let init = names(ours.init_containers.as_deref().unwrap_or_default());
        let main = names(&ours.containers);
        let mut keep = |list: &mut Vec<k8s_openapi::api::core::v1::Container>,
                        field: &str,
                        taken: &BTreeSet<String>| {
            list.retain(|c| {
                let clash = taken.contains(&c.name);
                if clash {
                    self.conflict(format!("{ROOT}.spec.{field}[{}]", c.name));
                }
                !clash
            });
        };
        keep(&mut spec.containers, "containers", &init);
        keep(&mut spec.init_containers, "initContainers", &main);
        template
    }

    /// `theirs` under `ours` at `shape` (the field names from the pod template, `[]` for list
    /// items), reported as `shown`.
    fn value(&mut self, shape: &str, shown: &str, theirs: Value, ours: Value) -> Value {
        if theirs == ours {
            return ours;
        }
        match (theirs, ours) {
            (Value::Object(t), Value::Object(o)) if !ATOMIC.iter().any(|a| shape.ends_with(a)) => {
                Value::Object(self.object(shape, shown, t, o))
            }
            (Value::Array(t), Value::Array(o)) => match LISTS.iter().find(|l| l.0 == shape) {
                Some(&(_, keys, items)) => Value::Array(self.list(shape, shown, keys, items, t, o)),
                None => {
                    self.conflict(shown.to_owned());
                    Value::Array(o)
                }
            },
            (_, o) => {
                self.conflict(shown.to_owned());
                o
            }
        }
    }

    fn object(
        &mut self,
        shape: &str,
        shown: &str,
        mut theirs: Map<String, Value>,
        ours: Map<String, Value>,
    ) -> Map<String, Value> {
        let map = MAPS.iter().any(|m| shape.ends_with(m));
        let mut out = Map::new();
        for (key, o) in ours {
            let field_shape = format!("{shape}.{key}");
            let field_shown = if map {
                format!("{shown}[{key:?}]")
            } else {
                format!("{shown}.{key}")
            };
            let merged = match theirs.remove(&key) {
                Some(t) if REPLACEABLE.contains(&field_shape.as_str()) => t,
                Some(t) => self.value(&field_shape, &field_shown, t, o),
                None => o,
            };
            out.insert(key, merged);
        }
        // What only the template sets.
        out.extend(theirs);
        out
    }

    fn list(
        &mut self,
        shape: &str,
        shown: &str,
        keys: &[&str],
        items: Items,
        theirs: Vec<Value>,
        ours: Vec<Value>,
    ) -> Vec<Value> {
        let mut out = ours;
        let item_shape = format!("{shape}[]");
        for t in theirs {
            let Some(i) = out.iter().position(|o| same_item(keys, &t, o)) else {
                out.push(t);
                continue;
            };
            let item_shown = format!("{shown}[{}]", label(keys, &t));
            let o = std::mem::take(&mut out[i]);
            out[i] = match items {
                Items::Merged => self.value(&item_shape, &item_shown, t, o),
                Items::Whole if shape == ".spec.volumes" && name(&t) == Some(SHM_VOLUME) => t,
                Items::Whole => {
                    if t != o {
                        self.conflict(item_shown);
                    }
                    o
                }
            };
        }
        out
    }
}

/// Whether two list items are the same one: they share a value of a key field or, for lists
/// without keys, are equal.
fn same_item(keys: &[&str], a: &Value, b: &Value) -> bool {
    if keys.is_empty() {
        return a == b;
    }
    keys.iter().any(|k| {
        a.get(*k)
            .is_some_and(|v| !v.is_null() && b.get(*k) == Some(v))
    })
}

fn name(item: &Value) -> Option<&str> {
    item.get("name").and_then(Value::as_str)
}

/// How an item is shown in a conflict: the value of its first key field it has.
fn label(keys: &[&str], item: &Value) -> String {
    match keys.iter().find_map(|k| item.get(*k)) {
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => String::new(),
    }
}

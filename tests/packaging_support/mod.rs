//! The chart README's values table, generated from charts/kvpool/values.yaml (its `# --`
//! comments and defaults) and charts/kvpool/values.schema.json (types, allowed values, and the
//! description of a key that has no comment). tests/packaging.rs compares the committed README
//! with it and rewrites the README under `KVPOOL_BLESS=1`. Pure: text in, text out.

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

/// First and last line of the generated part of the README.
pub const BEGIN: &str = "<!-- values table: generated from values.yaml and values.schema.json by \
                         tests/packaging.rs; edit those, then run \
                         `KVPOOL_BLESS=1 cargo test --test packaging` -->";
pub const END: &str = "<!-- end of values table -->";

/// One key of values.yaml as the parser found it: its path, and the `# --` comment above it.
#[derive(Debug, PartialEq)]
pub struct Key {
    pub path: Vec<String>,
    pub comment: Option<String>,
}

/// The mapping keys of a values file in file order, with their `# --` comments (helm-docs'
/// convention: `# -- text` directly above the key, continued on the `#` lines that follow).
/// Comments without `--` are section notes and are not used. List items and what is nested in
/// them are values, not keys. A `# --` comment that no key follows is an error.
pub fn keys(values_yaml: &str) -> Result<Vec<Key>> {
    let mut out = Vec::new();
    let mut stack: Vec<(usize, String)> = Vec::new();
    let mut pending: Option<String> = None;
    // Indentation of the list item being skipped, if any.
    let mut in_list: Option<usize> = None;
    for (number, line) in values_yaml.lines().enumerate() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if trimmed.is_empty() {
            ensure!(
                pending.is_none(),
                "line {}: a `# --` comment is followed by a blank line, not by its key",
                number + 1
            );
            continue;
        }
        if let Some(comment) = trimmed.strip_prefix('#') {
            if let Some(text) = comment.strip_prefix(" --") {
                ensure!(
                    pending.is_none(),
                    "line {}: two `# --` comments for one key",
                    number + 1
                );
                pending = Some(text.trim().to_owned());
            } else if let Some(text) = pending.as_mut() {
                text.push(' ');
                text.push_str(comment.trim());
            }
            continue;
        }
        if let Some(list_indent) = in_list {
            if indent > list_indent || (indent == list_indent && trimmed.starts_with("- ")) {
                continue;
            }
            in_list = None;
        }
        if trimmed.starts_with("- ") || trimmed == "-" {
            ensure!(
                pending.is_none(),
                "line {}: a `# --` comment above a list item",
                number + 1
            );
            in_list = Some(indent);
            continue;
        }
        let Some((key, _)) = trimmed.split_once(':') else {
            bail!(
                "line {}: expected `key: value`, got {trimmed:?}",
                number + 1
            );
        };
        let key = key.trim().trim_matches('"').to_owned();
        while stack.last().is_some_and(|(i, _)| *i >= indent) {
            stack.pop();
        }
        stack.push((indent, key));
        out.push(Key {
            path: stack.iter().map(|(_, k)| k.clone()).collect(),
            comment: pending.take(),
        });
    }
    ensure!(pending.is_none(), "a `# --` comment at the end of the file");
    Ok(out)
}

fn at<'v>(value: &'v Value, path: &[String]) -> Option<&'v Value> {
    path.iter().try_fold(value, |v, key| v.get(key))
}

fn schema_at<'s>(schema: &'s Value, path: &[String]) -> Option<&'s Value> {
    path.iter()
        .try_fold(schema, |s, key| s.get("properties")?.get(key))
}

/// A table cell: no line breaks, `|` escaped.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

/// The values table. A key with a `# --` comment is one row holding its whole default (its
/// children get no rows); a map without one is broken into its keys; any other key is a row
/// described by the schema. A row with no description at all is an error, so a new option
/// cannot land undocumented.
pub fn values_table(values_yaml: &str, schema: &Value) -> Result<String> {
    let values: Value = serde_saphyr::from_str(values_yaml).context("parsing values.yaml")?;
    let mut rows = vec![
        "| Key | Type | Default | Description |".to_owned(),
        "| --- | --- | --- | --- |".to_owned(),
    ];
    let mut covered: Option<Vec<String>> = None;
    for key in keys(values_yaml)? {
        if covered
            .as_ref()
            .is_some_and(|c| key.path.starts_with(c) && key.path.len() > c.len())
        {
            ensure!(
                key.comment.is_none(),
                "{}: a `# --` comment inside {}, which is documented as a whole",
                key.path.join("."),
                covered.as_deref().unwrap_or_default().join(".")
            );
            continue;
        }
        covered = None;
        let name = key.path.join(".");
        let default = at(&values, &key.path)
            .with_context(|| format!("{name}: the parser found a key serde does not"))?;
        let schema = schema_at(schema, &key.path)
            .with_context(|| format!("{name}: not in values.schema.json"))?;
        let is_map = matches!(default, Value::Object(m) if !m.is_empty());
        if key.comment.is_none() && is_map {
            continue;
        }
        covered = Some(key.path.clone());
        let mut description = key
            .comment
            .or_else(|| {
                schema
                    .get("description")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            })
            .with_context(|| {
                format!("{name}: no `# --` comment in values.yaml and no description in the schema")
            })?;
        if let Some(Value::Array(allowed)) = schema.get("enum") {
            let allowed: Vec<String> = allowed
                .iter()
                .map(|a| match a.as_str() {
                    Some(s) if !s.is_empty() => format!("`{s}`"),
                    _ => format!("`{a}`"),
                })
                .collect();
            description.push_str(&format!(" One of {}.", allowed.join(", ")));
        }
        let kind = schema.get("type").and_then(Value::as_str).unwrap_or("any");
        rows.push(format!(
            "| `{}` | {} | `{}` | {} |",
            cell(&name),
            kind,
            cell(&serde_json::to_string(default)?),
            cell(&description)
        ));
    }
    Ok(rows.join("\n") + "\n")
}

/// `readme` with the text between [`BEGIN`] and [`END`] replaced by `table`.
pub fn splice(readme: &str, table: &str) -> Result<String> {
    let start = readme
        .find(BEGIN)
        .with_context(|| format!("the README lacks the line {BEGIN}"))?;
    let end = readme
        .find(END)
        .with_context(|| format!("the README lacks the line {END}"))?;
    ensure!(start < end, "the README's markers are out of order");
    Ok(format!(
        "{}{BEGIN}\n{table}{}",
        &readme[..start],
        &readme[end..]
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALUES: &str = r#"# Section note, not a description.
# -- Replicas of the thing,
# on two lines.
replicas: 1
image:
  # -- Registry host.
  registry: ghcr.io
  tag: ""
# -- Security context, as a whole.
securityContext:
  capabilities:
    drop:
      - ALL
tolerations:
  - key: a
    operator: Exists
after: {}
"#;

    fn path(p: &str) -> Vec<String> {
        p.split('.').map(str::to_owned).collect()
    }

    #[test]
    fn keys_follow_indentation_and_skip_list_items() {
        let found = keys(VALUES).expect("parses");
        let paths: Vec<String> = found.iter().map(|k| k.path.join(".")).collect();
        assert_eq!(
            paths,
            [
                "replicas",
                "image",
                "image.registry",
                "image.tag",
                "securityContext",
                "securityContext.capabilities",
                "securityContext.capabilities.drop",
                "tolerations",
                "after"
            ]
        );
        assert_eq!(
            found[0].comment.as_deref(),
            Some("Replicas of the thing, on two lines.")
        );
        assert_eq!(
            found[1].comment, None,
            "a section note is not a description"
        );
        assert_eq!(found[2].path, path("image.registry"));
    }

    #[test]
    fn a_dangling_comment_is_an_error() {
        let err = keys("# -- orphan\n\nkey: 1\n").expect_err("blank line after comment");
        assert!(err.to_string().contains("blank line"), "{err}");
        assert!(keys("a: 1\n# -- at the end\n").is_err());
    }

    #[test]
    fn table_rows_take_comments_then_schema_descriptions() {
        let schema = serde_json::json!({"properties": {
            "replicas": {"type": "integer"},
            "image": {"type": "object", "properties": {
                "registry": {"type": "string"},
                "tag": {"type": "string", "description": "Tag | or digest", "enum": ["", "1"]}
            }},
            "securityContext": {"type": "object"},
            "tolerations": {"type": "array", "description": "Tolerations."},
            "after": {"type": "object", "description": "Empty map."}
        }});
        let table = values_table(VALUES, &schema).expect("table");
        let rows: Vec<&str> = table.lines().skip(2).collect();
        assert_eq!(
            rows,
            [
                "| `replicas` | integer | `1` | Replicas of the thing, on two lines. |",
                "| `image.registry` | string | `\"ghcr.io\"` | Registry host. |",
                "| `image.tag` | string | `\"\"` | Tag \\| or digest One of `\"\"`, `1`. |",
                "| `securityContext` | object | `{\"capabilities\":{\"drop\":[\"ALL\"]}}` | Security context, as a whole. |",
                "| `tolerations` | array | `[{\"key\":\"a\",\"operator\":\"Exists\"}]` | Tolerations. |",
                "| `after` | object | `{}` | Empty map. |",
            ]
        );
        let undocumented = serde_json::json!({"properties": {"replicas": {"type": "integer"}}});
        let err = values_table("replicas: 1\n", &undocumented).expect_err("no description");
        assert!(err.to_string().contains("replicas"), "{err}");
    }

    #[test]
    fn splice_replaces_only_the_generated_part() {
        let readme = format!("intro\n{BEGIN}\nold\n{END}\nrest\n");
        assert_eq!(
            splice(&readme, "new\n").expect("spliced"),
            format!("intro\n{BEGIN}\nnew\n{END}\nrest\n")
        );
        assert!(splice("no markers\n", "x\n").is_err());
    }
}

//! Why a custom resource's spec cannot be used ([`SpecError`], naming the field), and the rule
//! every kvpool resource's name follows so that its children's names are DNS labels.
//! Pure, no I/O.

use crate::quantity::QuantityError;

/// Why a spec cannot be used. Each variant names the field (its path below `spec`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum SpecError {
    /// A quantity field does not hold a byte size.
    #[error("spec.{field}: {source}")]
    #[strum(serialize = "invalid_quantity")]
    Quantity {
        /// Path of the field below `spec`.
        field: &'static str,
        /// What is wrong with the quantity.
        #[source]
        source: QuantityError,
    },
    /// A number lies outside its allowed range.
    #[error("spec.{field}: {value} is outside {min}..={max}")]
    OutOfRange {
        /// Path of the field below `spec`.
        field: &'static str,
        /// The value found.
        value: i64,
        /// Smallest allowed value.
        min: i64,
        /// Largest allowed value.
        max: i64,
    },
    /// Fields that cannot be combined.
    #[error("spec.{field}: {message}")]
    #[strum(serialize = "conflicting_fields")]
    Conflict {
        /// Path of the field below `spec`.
        field: &'static str,
        /// What conflicts with what.
        message: &'static str,
    },
    /// The resource's name cannot prefix its children's names.
    #[error("metadata.name {name:?}: {message}")]
    InvalidName {
        /// The name found.
        name: String,
        /// What is wrong with it.
        message: &'static str,
    },
    /// A field does not hold a Kubernetes label key.
    #[error("spec.{field}: {value:?} is not a label key ([prefix/]name): the {part} {message}")]
    InvalidLabelKey {
        /// Path of the field below `spec`.
        field: &'static str,
        /// The value found.
        value: String,
        /// The part that is wrong: `prefix` or `name`.
        part: &'static str,
        /// What is wrong with it.
        message: &'static str,
    },
    /// An entry of a map of labels holds a value that is not a label value.
    #[error("spec.{field}[{key:?}]: the value {value:?} is not a label value: it {message}")]
    InvalidLabelValue {
        /// Path of the map below `spec`.
        field: &'static str,
        /// The entry's key.
        key: String,
        /// The value found.
        value: String,
        /// What is wrong with it.
        message: &'static str,
    },
    /// A field that the other fields make necessary is absent.
    #[error("spec.{field}: {message}")]
    #[strum(serialize = "missing_field")]
    Missing {
        /// Path of the field below `spec`.
        field: &'static str,
        /// Why it is needed.
        message: &'static str,
    },
}

impl SpecError {
    /// Short stable label for metrics and Events.
    pub fn category(&self) -> &'static str {
        self.into()
    }

    /// Path of the offending field below `spec`, or `metadata.name`.
    pub fn field(&self) -> &'static str {
        match self {
            Self::InvalidName { .. } => "metadata.name",
            Self::Quantity { field, .. }
            | Self::OutOfRange { field, .. }
            | Self::Conflict { field, .. }
            | Self::InvalidLabelKey { field, .. }
            | Self::InvalidLabelValue { field, .. }
            | Self::Missing { field, .. } => field,
        }
    }
}

/// Longest name of a kvpool resource: children append up to 10 characters (`-conductor`) and
/// Service names are DNS labels of at most 63.
pub const MAX_NAME_LEN: usize = 53;

/// Checks a resource name the way the CRDs' root rule does: at most [`MAX_NAME_LEN`] characters
/// and no dots, so that `<name>-<component>` is a valid Service name.
pub fn validate_name(name: &str) -> Result<(), SpecError> {
    if name.len() > MAX_NAME_LEN || name.contains('.') {
        return Err(SpecError::InvalidName {
            name: name.to_owned(),
            message: "must be at most 53 characters and contain no dots: it prefixes the names of Services",
        });
    }
    Ok(())
}

/// Checks that `value` of `field` is a Kubernetes label key: an optional DNS-subdomain prefix
/// (at most 253 characters) and `/`, then a name of 1-63 alphanumerics, `-`, `_` and `.` that
/// starts and ends with an alphanumeric.
pub fn validate_label_key(field: &'static str, value: &str) -> Result<(), SpecError> {
    let bad = |part, message| {
        Err(SpecError::InvalidLabelKey {
            field,
            value: value.to_owned(),
            part,
            message,
        })
    };
    let (prefix, name) = match value.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, value),
    };
    if let Some(p) = prefix {
        if p.is_empty() || p.len() > 253 {
            return bad("prefix", "must be 1-253 characters");
        }
        let dns_label = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        if !p.split('.').all(dns_label) {
            return bad(
                "prefix",
                "must be a DNS subdomain (lowercase, digits, '-', '.')",
            );
        }
    }
    check_label_value(name).or_else(|message| bad("name", message))
}

/// Checks that `value` is a Kubernetes label value (the rule of a label key's name part too):
/// 1-63 alphanumerics, `-`, `_` and `.`, starting and ending with an alphanumeric. The problem
/// otherwise, worded to follow its subject ("must be ...").
pub fn check_label_value(value: &str) -> Result<(), &'static str> {
    if value.is_empty() || value.len() > 63 {
        return Err("must be 1-63 characters");
    }
    let alnum = |b: Option<u8>| b.is_some_and(|b| b.is_ascii_alphanumeric());
    if !alnum(value.bytes().next())
        || !alnum(value.bytes().last())
        || !value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err(
            "must be alphanumerics, '-', '_' and '.', starting and ending with an alphanumeric",
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_keys_are_checked_like_the_api_server_does() {
        for good in [
            "kubernetes.io/hostname",
            "topology.kubernetes.io/zone",
            "rack",
            "example.com/Rack_1.a",
            format!("{}/{}", "a".repeat(63), "b".repeat(63)).as_str(),
        ] {
            assert_eq!(validate_label_key("f", good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "/rack",
            "example.com/",
            "Example.com/rack",
            "a..b/rack",
            "-a/rack",
            "rack-",
            "ra ck",
            "a/b/c",
            "x".repeat(64).as_str(),
            format!("{}/x", "a".repeat(254)).as_str(),
        ] {
            let e = validate_label_key("replication.spreadLabelKey", bad).expect_err(bad);
            assert_eq!(e.field(), "replication.spreadLabelKey");
            assert_eq!(e.category(), "invalid_label_key");
        }
        // The message names the part that is wrong.
        for (bad, says) in [
            (
                "rack-",
                "the name must be alphanumerics, '-', '_' and '.', starting and ending",
            ),
            ("a/", "the name must be 1-63 characters"),
            ("/rack", "the prefix must be 1-253 characters"),
            ("A/rack", "the prefix must be a DNS subdomain"),
        ] {
            let e = validate_label_key("f", bad).expect_err(bad).to_string();
            assert!(
                e.starts_with(&format!(
                    "spec.f: {bad:?} is not a label key ([prefix/]name): {says}"
                )),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn names_leave_room_for_child_suffixes() {
        assert_eq!(validate_name(&"a".repeat(53)), Ok(()));
        let long = validate_name(&"a".repeat(54)).expect_err("too long");
        assert_eq!(
            (long.field(), long.category()),
            ("metadata.name", "invalid_name")
        );
        assert!(long.to_string().starts_with("metadata.name \""), "{long}");
        assert!(validate_name("cache.v2").is_err());
        assert_eq!(format!("{}-conductor", "a".repeat(MAX_NAME_LEN)).len(), 63);
    }
}

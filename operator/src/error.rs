//! Errors of a reconcile, one variant per failing operation, with a `category()` label used in
//! metrics and Events. `error_policy` uses [`Error::is_invalid_spec`] to tell a spec that must be
//! fixed by a person (report, wait for a change) from a transient failure (back off and retry).
//! I/O boundary: none.

/// A reconcile failure.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum Error {
    /// The object that triggered the reconcile lacks a name, namespace or uid.
    #[error("object has no {0}")]
    MissingObjectKey(&'static str),

    /// The spec cannot be turned into children; the message names the field.
    #[error("invalid spec: {0}")]
    InvalidSpec(String),

    /// Reading an object (a referenced pool) failed.
    #[error("cannot get {kind} {name}")]
    Get {
        kind: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },

    /// Server-side apply of a child failed.
    #[error("cannot apply {kind} {name}")]
    Apply {
        kind: String,
        name: String,
        #[source]
        source: kube::Error,
    },

    /// Creating a child that must never be overwritten (the auth Secret) failed.
    #[error("cannot create {kind} {name}")]
    Create {
        kind: String,
        name: String,
        #[source]
        source: kube::Error,
    },

    /// Listing children by label (to find orphans) failed.
    #[error("cannot list {kind} by label {selector}")]
    List {
        kind: String,
        selector: String,
        #[source]
        source: kube::Error,
    },

    /// Deleting an orphaned child failed.
    #[error("cannot delete {kind} {name}")]
    Delete {
        kind: String,
        name: String,
        #[source]
        source: kube::Error,
    },

    /// Writing the status subresource failed.
    #[error("cannot patch status of {kind} {name}")]
    PatchStatus {
        kind: String,
        name: String,
        #[source]
        source: kube::Error,
    },

    /// Publishing an Event failed.
    #[error("cannot publish event {reason}")]
    PublishEvent {
        reason: &'static str,
        #[source]
        source: kube::Error,
    },

    /// Serialising a generated object or config failed.
    #[error("cannot serialise {what}")]
    Serialize {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },

    /// Rendering the pool's effective config as YAML failed.
    #[error("cannot render the effective config as YAML")]
    RenderConfig(#[source] serde_saphyr::ser::Error),
}

kvpool_runtime::error_category!(Error);

impl Error {
    /// True when retrying cannot help until the object changes.
    pub fn is_invalid_spec(&self) -> bool {
        matches!(self, Error::InvalidSpec(_) | Error::MissingObjectKey(_))
    }
}

/// Result of a reconcile step.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_specs_are_told_apart_from_transient_failures() {
        assert!(Error::InvalidSpec("spec.replicas".into()).is_invalid_spec());
        let transient = Error::Serialize {
            what: "config",
            source: serde_json::from_str::<u8>("x").expect_err("not json"),
        };
        assert!(!transient.is_invalid_spec());
        assert_eq!(transient.category(), "serialize");
        assert_eq!(Error::InvalidSpec(String::new()).category(), "invalid_spec");
    }
}

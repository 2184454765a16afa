//! `spec.dram.persistence` of a `KVCachePool`: whether the agents keep the DRAM tier in files on
//! a tmpfs or hugetlbfs hostPath so that it survives an agent restart or rollout, the CEL rules
//! that name its fields, the allow-list of its host directories (the same shape as
//! `ssd.hostPath`'s), and its effective form in the pool document. Pure types and checks.

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::SpecError;

/// Directories below which `dram.persistence.hostPath` and `indexHostPath` may lie: memory
/// filesystems set aside for it, never a directory the engine pods also mount.
pub const DRAM_HOST_PATH_PREFIXES: [&str; 3] = ["/dev/shm/", "/dev/hugepages/", "/mnt/huge/"];

/// Message of the rule on `dram.persistence.hostPath`, the same in CEL and in Rust.
pub const DRAM_HOST_PATH_MESSAGE: &str = "dram.persistence.hostPath must be a directory below /dev/shm/, /dev/hugepages/ or /mnt/huge/ with no '.', '..' or empty segments (the agent mounts it read-write on every node)";

/// Message of the rule on `dram.persistence.indexHostPath`.
pub const DRAM_INDEX_HOST_PATH_MESSAGE: &str = "dram.persistence.indexHostPath must be a directory below /dev/shm/, /dev/hugepages/ or /mnt/huge/ with no '.', '..' or empty segments (the agent mounts it read-write on every node)";

/// The CEL rule of the persistence host paths (see [`dram_host_path_allowed`]).
pub const DRAM_HOST_PATH_RULE: &str = "self.matches('^/(dev/shm|dev/hugepages|mnt/huge)/[^/]+(/[^/]+)*/?$') && !self.matches('/[.][.]?(/|$)')";

/// Whether `path` is an allowed persistence directory (the Rust twin of
/// [`DRAM_HOST_PATH_RULE`]).
pub fn dram_host_path_allowed(path: &str) -> bool {
    crate::network::host_path_below(&DRAM_HOST_PATH_PREFIXES, path)
}

/// What backs a persistent DRAM tier.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum PersistenceMode {
    /// Anonymous memory: the tier is lost when the agent restarts.
    #[default]
    None,
    /// Files in a tmpfs directory of the node (e.g. `/dev/shm/kvpool`).
    Tmpfs,
    /// Files on a hugetlbfs mount of the node (huge pages of the mount's size); the index lives
    /// in `indexHostPath` on tmpfs.
    Hugetlbfs,
}

/// Keep the DRAM tier in memory that outlives the agent process.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.mode) || self.mode == 'none' || has(self.hostPath)").message("dram.persistence.hostPath is required when dram.persistence.mode is tmpfs or hugetlbfs").field_path(".hostPath").reason(Reason::FieldValueRequired),
    validation = Rule::new("!has(self.mode) || self.mode != 'hugetlbfs' || has(self.indexHostPath)").message("dram.persistence.indexHostPath (a tmpfs directory) is required with mode hugetlbfs: files on hugetlbfs cannot hold the index").field_path(".indexHostPath").reason(Reason::FieldValueRequired)
)]
pub struct DramPersistenceSpec {
    /// `none` (default), `tmpfs` or `hugetlbfs`.
    #[serde(default)]
    pub mode: PersistenceMode,

    /// Node directory holding the tier's files, mounted read-write into the agent at the same
    /// path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 2, max = 4096), regex(pattern = r"^/"))]
    #[x_kube(validation = Rule::new(DRAM_HOST_PATH_RULE).message(DRAM_HOST_PATH_MESSAGE).reason(Reason::FieldValueInvalid))]
    pub host_path: Option<String>,

    /// Node directory (on tmpfs) holding the tier's indexes; default: `hostPath`. Required with
    /// mode `hugetlbfs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 2, max = 4096), regex(pattern = r"^/"))]
    #[x_kube(validation = Rule::new(DRAM_HOST_PATH_RULE).message(DRAM_INDEX_HOST_PATH_MESSAGE).reason(Reason::FieldValueInvalid))]
    pub index_host_path: Option<String>,
}

/// The effective persistence of the DRAM tier (pool document).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DramPersistenceConfig {
    /// `tmpfs` or `hugetlbfs`.
    pub mode: PersistenceMode,
    /// Directory of the tier's files (same path on the node and in the agent).
    pub host_path: String,
    /// Directory of the indexes (same path on the node and in the agent).
    pub index_host_path: String,
}

/// Check `spec.dram.persistence` again (the CEL rules' Rust twin): `None` when the tier is
/// not persistent.
pub fn validate_persistence(
    spec: Option<&DramPersistenceSpec>,
    hugepages: crate::Hugepages,
) -> Result<Option<DramPersistenceConfig>, SpecError> {
    let Some(p) = spec.filter(|p| p.mode != PersistenceMode::None) else {
        return Ok(None);
    };
    let host_path = p.host_path.clone().ok_or(SpecError::Missing {
        field: "dram.persistence.hostPath",
        message: "required when dram.persistence.mode is tmpfs or hugetlbfs",
    })?;
    let index_host_path = match (p.mode, &p.index_host_path) {
        (PersistenceMode::Hugetlbfs, None) => {
            return Err(SpecError::Missing {
                field: "dram.persistence.indexHostPath",
                message: "a tmpfs directory is required with mode hugetlbfs: files on hugetlbfs cannot hold the index",
            });
        }
        (_, Some(i)) => i.clone(),
        (_, None) => host_path.clone(),
    };
    for (field, path) in [
        ("dram.persistence.hostPath", &host_path),
        ("dram.persistence.indexHostPath", &index_host_path),
    ] {
        if !dram_host_path_allowed(path) {
            return Err(SpecError::Conflict {
                field,
                message: "must be a directory below /dev/shm/, /dev/hugepages/ or /mnt/huge/ with no '.', '..' or empty segments (the agent mounts it read-write on every node)",
            });
        }
    }
    if p.mode == PersistenceMode::Hugetlbfs && hugepages == crate::Hugepages::None {
        return Err(SpecError::Conflict {
            field: "dram.persistence.mode",
            message: "hugetlbfs requires dram.hugepages (the agent pod must request the huge pages its files hold)",
        });
    }
    Ok(Some(DramPersistenceConfig {
        mode: p.mode,
        host_path,
        index_host_path,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Hugepages;

    fn spec(mode: PersistenceMode, host: Option<&str>, index: Option<&str>) -> DramPersistenceSpec {
        DramPersistenceSpec {
            mode,
            host_path: host.map(str::to_owned),
            index_host_path: index.map(str::to_owned),
        }
    }

    fn field(r: Result<Option<DramPersistenceConfig>, SpecError>) -> String {
        r.expect_err("refused").to_string()
    }

    #[test]
    fn persistence_is_checked_naming_the_field() {
        assert_eq!(
            validate_persistence(None, Hugepages::None).expect("none"),
            None
        );
        let off = spec(PersistenceMode::None, Some("/etc"), None);
        assert_eq!(
            validate_persistence(Some(&off), Hugepages::None).expect("off"),
            None
        );
        let tmpfs = spec(PersistenceMode::Tmpfs, Some("/dev/shm/kvpool"), None);
        assert_eq!(
            validate_persistence(Some(&tmpfs), Hugepages::None).expect("tmpfs"),
            Some(DramPersistenceConfig {
                mode: PersistenceMode::Tmpfs,
                host_path: "/dev/shm/kvpool".into(),
                index_host_path: "/dev/shm/kvpool".into(),
            })
        );
        let cases = [
            (
                spec(PersistenceMode::Tmpfs, None, None),
                Hugepages::None,
                "dram.persistence.hostPath",
            ),
            (
                spec(PersistenceMode::Tmpfs, Some("/etc/kvpool"), None),
                Hugepages::None,
                "dram.persistence.hostPath",
            ),
            (
                spec(PersistenceMode::Tmpfs, Some("/dev/shm/../etc"), None),
                Hugepages::None,
                "dram.persistence.hostPath",
            ),
            (
                spec(PersistenceMode::Tmpfs, Some("/dev/shm/a"), Some("/var/x")),
                Hugepages::None,
                "dram.persistence.indexHostPath",
            ),
            (
                spec(PersistenceMode::Hugetlbfs, Some("/dev/hugepages/kv"), None),
                Hugepages::Size2Mi,
                "dram.persistence.indexHostPath",
            ),
            (
                spec(
                    PersistenceMode::Hugetlbfs,
                    Some("/dev/hugepages/kv"),
                    Some("/dev/shm/kv"),
                ),
                Hugepages::None,
                "dram.persistence.mode",
            ),
        ];
        for (s, pages, name) in cases {
            let e = field(validate_persistence(Some(&s), pages));
            assert!(e.contains(name), "{s:?}: {e}");
        }
        let huge = spec(
            PersistenceMode::Hugetlbfs,
            Some("/mnt/huge/kv"),
            Some("/dev/shm/kv-index"),
        );
        let c = validate_persistence(Some(&huge), Hugepages::Size1Gi)
            .expect("valid")
            .expect("persistent");
        assert_eq!(c.index_host_path, "/dev/shm/kv-index");
    }
}

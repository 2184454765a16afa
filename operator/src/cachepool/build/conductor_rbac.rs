//! The conductor's identity: a ServiceAccount, and a Role with its RoleBinding that let it list
//! and watch the Pods of its namespace (engine discovery). All three are named
//! `<pool>-conductor` and exist only while the conductor is enabled. I/O boundary: none.

use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};

use super::meta;
use crate::cachepool::validate::ValidCachePool;
use crate::labels::{self, Component};

/// ServiceAccount, Role and RoleBinding of the conductor (all named `<pool>-conductor`).
#[derive(Clone, Debug, PartialEq)]
pub struct ConductorRbac {
    pub service_account: ServiceAccount,
    pub role: Role,
    pub role_binding: RoleBinding,
}

/// What the conductor's Role grants: listing and watching the Pods of its namespace (engine
/// discovery). The operator must hold these itself (`crate::rbac`), since RBAC forbids granting
/// more than one has.
pub const CONDUCTOR_POD_VERBS: [&str; 2] = ["list", "watch"];

/// The conductor's ServiceAccount, Role and RoleBinding.
pub fn conductor_rbac(pool: &ValidCachePool) -> ConductorRbac {
    let name = labels::child_name(&pool.name, Component::Conductor);
    ConductorRbac {
        service_account: ServiceAccount {
            metadata: meta(pool, Component::Conductor),
            automount_service_account_token: Some(false),
            ..ServiceAccount::default()
        },
        role: Role {
            metadata: meta(pool, Component::Conductor),
            rules: Some(vec![PolicyRule {
                api_groups: Some(vec![String::new()]),
                resources: Some(vec!["pods".to_owned()]),
                verbs: CONDUCTOR_POD_VERBS
                    .iter()
                    .map(|v| (*v).to_owned())
                    .collect(),
                ..PolicyRule::default()
            }]),
        },
        role_binding: RoleBinding {
            metadata: meta(pool, Component::Conductor),
            role_ref: RoleRef {
                api_group: "rbac.authorization.k8s.io".to_owned(),
                kind: "Role".to_owned(),
                name: name.clone(),
            },
            subjects: Some(vec![Subject {
                kind: "ServiceAccount".to_owned(),
                name,
                namespace: Some(pool.namespace.clone()),
                ..Subject::default()
            }]),
        },
    }
}

//! The pool's auth Secret: the pool key (item `key`, mounted by the master only) and one
//! credential file per role derived from it (items `agent`, `engine`, `conductor`,
//! `observer`; see [`kvpool_proto::auth`]), each workload mounting only its own item. Created
//! once and never overwritten (`apply::create_if_absent`), so the key passed in counts only
//! for a new pool. I/O boundary: none.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kvpool_proto::auth::Role;

use super::meta;
use crate::cachepool::validate::ValidCachePool;
use crate::contract;
use crate::labels::Component;

/// The roles whose credential files the Secret carries next to the pool key.
pub const ROLE_ITEMS: [Role; 4] = [Role::Agent, Role::Engine, Role::Conductor, Role::Observer];

/// The auth Secret holding `key` (hex) and the role files derived from it. Created once; see
/// `apply::create_if_absent`.
pub fn auth_secret(pool: &ValidCachePool, key_hex: &str) -> Secret {
    let mut data = BTreeMap::from([(
        contract::AUTH_KEY_KEY.to_owned(),
        ByteString(key_hex.as_bytes().to_vec()),
    )]);
    for role in ROLE_ITEMS {
        // The operator's own keys are 32 random bytes in hex: always long enough.
        if let Some(file) = kvpool_client::credentials::role_file(key_hex.as_bytes(), role) {
            data.insert(role.name().to_owned(), ByteString(file.into_bytes()));
        }
    }
    Secret {
        metadata: meta(pool, Component::Auth),
        type_: Some("Opaque".to_owned()),
        data: Some(data),
        ..Secret::default()
    }
}

/// The role items an existing auth Secret lacks (one written before per-role credentials, or
/// edited by hand); its workloads cannot mount them.
pub fn missing_role_items(secret: &Secret) -> Vec<&'static str> {
    ROLE_ITEMS
        .iter()
        .map(|r| r.name())
        .filter(|item| secret.data.as_ref().is_none_or(|d| !d.contains_key(*item)))
        .collect()
}

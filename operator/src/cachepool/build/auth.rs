//! The pool's auth Secret: the pool key (item `key`, mounted by the master only) and one
//! credential file per role derived from it (items `agent`, `engine`, `conductor`,
//! `observer`; see [`kvpool_proto::auth`]), each workload mounting only its own item. The key is
//! derived from the operator's root key ([`crate::root_key`]) and the Secret carries the
//! annotation `kvpool.dev/auth-derivation: v1` saying so. Created once and never overwritten
//! (`apply::create_if_absent`) nor read back: a Secret made otherwise (by hand, or by an operator
//! that generated random keys) keeps its key, which the master then holds and the operator's
//! derived key does not match (the `AuthKeyRejected` condition). I/O boundary: none.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kvpool_proto::auth::Role;

use super::meta;
use crate::cachepool::validate::ValidCachePool;
use crate::contract;
use crate::labels::Component;
use crate::root_key;

/// The roles whose credential files the Secret carries next to the pool key.
pub const ROLE_ITEMS: [Role; 4] = [Role::Agent, Role::Engine, Role::Conductor, Role::Observer];

/// The auth Secret holding `key` (hex, derived from the root key) and the role files derived
/// from it. Created once; see `apply::create_if_absent`.
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
    let mut metadata = meta(pool, Component::Auth);
    metadata.annotations.get_or_insert_default().insert(
        root_key::DERIVATION_ANNOTATION.to_owned(),
        root_key::DERIVATION_VERSION.to_owned(),
    );
    Secret {
        metadata,
        type_: Some("Opaque".to_owned()),
        data: Some(data),
        ..Secret::default()
    }
}

//! The pool's auth Secret: the shared peer-authentication key every process of the pool
//! mounts. Created once and never overwritten (`apply::create_if_absent`), so the key passed in
//! counts only for a new pool. I/O boundary: none.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;

use super::meta;
use crate::cachepool::validate::ValidCachePool;
use crate::contract;
use crate::labels::Component;

/// The auth Secret holding `key` (hex). Created once; see `apply::create_if_absent`.
pub fn auth_secret(pool: &ValidCachePool, key_hex: &str) -> Secret {
    Secret {
        metadata: meta(pool, Component::Auth),
        type_: Some("Opaque".to_owned()),
        data: Some(BTreeMap::from([(
            contract::AUTH_KEY_KEY.to_owned(),
            ByteString(key_hex.as_bytes().to_vec()),
        )])),
        ..Secret::default()
    }
}

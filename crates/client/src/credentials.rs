//! Role credential files made from the pool key (see [`kvpool_proto::auth`]): each role's
//! master key, and, for the roles that move KV bytes, the transfer plane's key
//! ([`kvpool_transfer::auth::derive_transfer_key`]). The operator puts them in the pool's auth
//! Secret, `kvpool up` writes them next to its pool key, `kvpool auth derive` prints one.
//! Pure.

use kvpool_proto::auth::{AuthKey, Role, RoleDocument};

/// The credential document of `role` under the pool key `pool_key` (surrounding whitespace
/// ignored, as key files are read); `None` for a key shorter than 16 bytes or the `admin`
/// role (whose key file is the pool key itself).
pub fn role_document(pool_key: &[u8], role: Role) -> Option<RoleDocument> {
    if role == Role::Admin {
        return None;
    }
    let pool = AuthKey::from_bytes(pool_key)?;
    let transfer = kvpool_transfer::auth::derive_transfer_key(pool_key.trim_ascii());
    pool.role_document(role, Some(&transfer))
}

/// The credential document of the agent on `node` under the pool key `pool_key`: the agent
/// role bound to that node (see [`kvpool_proto::auth::node_key`]); `None` for a key shorter
/// than 16 bytes or a node name that cannot be bound.
pub fn node_document(pool_key: &[u8], node: &str) -> Option<RoleDocument> {
    let pool = AuthKey::from_bytes(pool_key)?;
    let transfer = kvpool_transfer::auth::derive_transfer_key(pool_key.trim_ascii());
    pool.node_document(node, Some(&transfer))
}

/// [`node_document`] as the text of its file.
pub fn node_file(pool_key: &[u8], node: &str) -> Option<String> {
    node_document(pool_key, node).map(|d| d.to_json())
}

/// [`role_document`] as the text of its file.
pub fn role_file(pool_key: &[u8], role: Role) -> Option<String> {
    role_document(pool_key, role).map(|d| d.to_json())
}

#[cfg(test)]
mod tests {
    use kvpool_proto::auth::Verifier;

    use super::*;

    const POOL: &[u8] = b"0123456789abcdef0123456789abcdef\n";

    #[test]
    fn role_files_load_as_their_role_on_both_planes() {
        let dir = tempfile::tempdir().expect("tmp");
        let verifier = Verifier::new(&AuthKey::from_bytes(POOL).expect("pool")).expect("pool");
        let pool_transfer = kvpool_transfer::auth::AuthKey::new(POOL.trim_ascii()).expect("key");
        let proof = pool_transfer.prove(b"client", b"c", b"s");
        for role in [Role::Agent, Role::Engine, Role::Conductor, Role::Observer] {
            let path = dir.path().join(role.name());
            std::fs::write(&path, role_file(POOL, role).expect("file")).expect("write");
            let master = AuthKey::from_file(&path).expect("master key");
            assert_eq!(master.role(), role);
            let method = if role == Role::Conductor {
                "LongestPrefix"
            } else {
                "Stats"
            };
            let checked = verifier.verify(Some(&master.sign(method)), method);
            assert_eq!(checked.expect("signed with the derived key").role, role);
            let transfer = kvpool_transfer::auth::AuthKey::from_file(&path);
            if role.holds_transfer_key() {
                let transfer = transfer.expect("transfer key");
                assert!(transfer.verify(b"client", b"c", b"s", &proof), "{role}");
            } else {
                assert!(transfer.is_err(), "{role} must hold no transfer key");
            }
        }
        assert!(role_document(POOL, Role::Admin).is_none());
        assert!(role_document(b"short", Role::Engine).is_none());
    }
}

//! The operator's root key and the pool keys derived from it. Each `KVCachePool`'s key is
//! `HMAC-SHA256(root key, "kvpool-pool-key-v1\n<namespace>/<name>/<uid>")` in lower-case hex,
//! so the operator can compute it again on every pass instead of reading the pool's auth
//! Secret back: it needs `create` on Secrets and nothing more (docs/adr/0008-operator-root-key.md).
//! The uid in the input makes a pool deleted and created again under the same name get a new
//! key. I/O boundary: reading the key file in [`RootKey::from_file`]; derivation is pure.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Fewest bytes a root key may hold (after surrounding whitespace is trimmed):
/// `openssl rand -hex 32` gives 64.
pub const MIN_ROOT_KEY_LEN: usize = 32;
/// First line of the derivation input; a new derivation gets a new label.
pub const DERIVATION_LABEL: &str = "kvpool-pool-key-v1";
/// Annotation the operator puts on every auth Secret whose key it derived.
pub const DERIVATION_ANNOTATION: &str = "kvpool.dev/auth-derivation";
/// Value of [`DERIVATION_ANNOTATION`] for keys derived as this module does.
pub const DERIVATION_VERSION: &str = "v1";
/// Root key of the test twin of the context (`Context::for_tests`).
pub const TEST_ROOT_KEY: &[u8] = b"kvpool-test-root-key-0123456789abcdef";

/// Why the root key cannot be used.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum RootKeyError {
    #[error(
        "cannot read the operator root key file {path} (--root-key-file; the chart mounts the \
         Secret named by operator.rootKey)"
    )]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the operator root key file {path} holds {len} bytes, fewer than {MIN_ROOT_KEY_LEN} \
         (make one with `openssl rand -hex 32`)"
    )]
    Short { path: PathBuf, len: usize },
}

/// The root secret every pool key is derived from. Its `Debug` shows no byte of it.
#[derive(Clone, derive_more::Debug)]
pub struct RootKey(#[debug(skip)] Arc<[u8]>);

impl RootKey {
    /// The key from bytes, surrounding whitespace trimmed; `None` when fewer than
    /// [`MIN_ROOT_KEY_LEN`] remain.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let trimmed = bytes.trim_ascii();
        (trimmed.len() >= MIN_ROOT_KEY_LEN).then(|| Self(Arc::from(trimmed)))
    }

    /// Read the key file `path` (`--root-key-file`).
    pub fn from_file(path: &Path) -> Result<Self, RootKeyError> {
        let bytes = std::fs::read(path).map_err(|source| RootKeyError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_bytes(&bytes).ok_or_else(|| RootKeyError::Short {
            path: path.to_owned(),
            len: bytes.trim_ascii().len(),
        })
    }

    /// The test twin's key ([`TEST_ROOT_KEY`]).
    pub fn for_tests() -> Self {
        Self(Arc::from(TEST_ROOT_KEY))
    }

    /// A 32-byte secret for one purpose of the operator's own (`label`, e.g. the agent
    /// credential issuer's CA key): `HMAC-SHA256(root key, label)`, the same on every replica
    /// and every start, so what is made from it needs no Secret of its own.
    pub fn derive_secret(&self, label: &str) -> [u8; 32] {
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0)
            .unwrap_or_else(|_| <Hmac<Sha256> as KeyInit>::new(&Default::default()));
        mac.update(label.as_bytes());
        mac.finalize().into_bytes().into()
    }

    /// The pool key of the `KVCachePool` `namespace/name` with `uid`, as the hex text the
    /// auth Secret's `key` item holds (64 characters).
    pub fn pool_key_hex(&self, namespace: &str, name: &str, uid: &str) -> String {
        // HMAC takes keys of any length: the error branch cannot happen.
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0)
            .unwrap_or_else(|_| <Hmac<Sha256> as KeyInit>::new(&Default::default()));
        mac.update(DERIVATION_LABEL.as_bytes());
        mac.update(b"\n");
        mac.update(format!("{namespace}/{name}/{uid}").as_bytes());
        mac.finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROOT: &[u8] = b"0123456789abcdef0123456789abcdef";

    #[test]
    fn derivation_is_stable_and_follows_the_documented_formula() {
        let root = RootKey::from_bytes(ROOT).expect("root");
        let key = root.pool_key_hex("llm", "roce", "6f1d2c3b-0000-4000-8000-000000000001");
        // Fixed vector, also given in docs/adr/0008-operator-root-key.md: a change here
        // changes every pool's key and locks every running pool out.
        assert_eq!(
            key,
            "dcba475fa09be99fbc8fdbf9fd211934d6d01cdd39dd68c2bcf1693b08f2b2bc"
        );
        // Same as the formula computed by hand.
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(ROOT).expect("hmac");
        mac.update(b"kvpool-pool-key-v1\nllm/roce/6f1d2c3b-0000-4000-8000-000000000001");
        let by_hand: String = mac
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(key, by_hand);
        assert_eq!(key.len(), 64);
        // And the pool key it gives is one the master accepts (16 bytes or more).
        assert!(kvpool_proto::auth::AuthKey::from_bytes(key.as_bytes()).is_some());
    }

    #[test]
    fn another_uid_name_namespace_or_root_gives_another_key() {
        let root = RootKey::from_bytes(ROOT).expect("root");
        let base = root.pool_key_hex("llm", "roce", "uid-1");
        assert_eq!(base, root.pool_key_hex("llm", "roce", "uid-1"));
        for other in [
            root.pool_key_hex("llm", "roce", "uid-2"),
            root.pool_key_hex("llm", "tcp", "uid-1"),
            root.pool_key_hex("prod", "roce", "uid-1"),
            // The separators keep the fields apart.
            root.pool_key_hex("llm/roce", "", "uid-1"),
            RootKey::from_bytes(b"another root key, 32 bytes long!")
                .expect("root")
                .pool_key_hex("llm", "roce", "uid-1"),
        ] {
            assert_ne!(base, other);
        }
    }

    #[test]
    fn a_missing_or_short_key_file_is_refused_with_its_path() {
        let dir = tempfile::tempdir().expect("tmp");
        let missing = dir.path().join("absent");
        let e = RootKey::from_file(&missing).expect_err("missing");
        assert!(e.to_string().contains("absent"), "{e}");
        assert!(e.to_string().contains("--root-key-file"), "{e}");

        let short = dir.path().join("short");
        std::fs::write(&short, "  0123456789\n").expect("write");
        let e = RootKey::from_file(&short).expect_err("short");
        let text = e.to_string();
        assert!(
            text.contains("short") && text.contains("10 bytes") && text.contains("32"),
            "{text}"
        );

        let good = dir.path().join("good");
        std::fs::write(&good, format!("{}\n", "ab".repeat(32))).expect("write");
        let a = RootKey::from_file(&good).expect("good");
        let b = RootKey::from_bytes("ab".repeat(32).as_bytes()).expect("same");
        assert_eq!(a.pool_key_hex("n", "p", "u"), b.pool_key_hex("n", "p", "u"));
        assert_eq!(format!("{a:?}"), "RootKey(..)");
    }
}

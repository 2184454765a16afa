//! The transfer plane's key and the HMAC-SHA256 proofs of the connection handshake. The key
//! is derived from the pool key (HMAC-SHA256(pool key, `kvpool-transfer-key-v1`)), so the
//! master's keys and the transfer plane's are independent: a role credential file carries it
//! only for roles that move KV bytes (agents, engines), never for the conductor.
//! I/O boundary: reading the key from an environment variable or a file (the operator mounts it
//! from a Secret): a raw pool key, or a role's credential file (a JSON document whose
//! `transfer` field is the derived key in hex); the proof computation itself is pure.

use std::path::{Path, PathBuf};

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Environment variable holding the key itself.
pub const ENV_KEY: &str = "KVPOOL_AUTH_KEY";
/// Environment variable holding the path of a file that contains the key.
pub const ENV_KEY_FILE: &str = "KVPOOL_AUTH_KEY_FILE";
/// Shortest key accepted, in bytes.
pub const MIN_KEY_LEN: usize = 16;
/// Length of the handshake nonces.
pub const NONCE_LEN: usize = 32;
/// Length of a proof (HMAC-SHA256 output).
pub const PROOF_LEN: usize = 32;
/// Context of the transfer key's derivation from the pool key.
const TRANSFER_CONTEXT: &[u8] = b"kvpool-transfer-key-v1";

type HmacSha256 = Hmac<Sha256>;

/// Errors of loading the key.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum AuthError {
    #[error("auth key is {len} bytes; at least {MIN_KEY_LEN} are required")]
    TooShort { len: usize },
    #[error("cannot read auth key file {path}")]
    ReadFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no auth key: set {ENV_KEY} or {ENV_KEY_FILE}, or pass a key file")]
    Missing,
    #[error("credential file {path}: {reason}")]
    Document { path: PathBuf, reason: String },
}

impl AuthError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// The transfer plane's key, kept only as a keyed HMAC state. `Debug` never prints it.
#[derive(Clone)]
pub struct AuthKey {
    len: usize,
    keyed: HmacSha256,
}

impl std::fmt::Debug for AuthKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AuthKey(<{} bytes redacted>)", self.len)
    }
}

/// The transfer plane's key under the pool key `pool`.
pub fn derive_transfer_key(pool: &[u8]) -> [u8; 32] {
    // HMAC takes keys of any length; the error branch cannot happen.
    let mut mac = HmacSha256::new_from_slice(pool)
        .unwrap_or_else(|_| <HmacSha256 as KeyInit>::new(&Default::default()));
    mac.update(TRANSFER_CONTEXT);
    mac.finalize().into_bytes().into()
}

impl AuthKey {
    /// The key of the pool whose key is `bytes` (at least [`MIN_KEY_LEN`]).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, AuthError> {
        let bytes = bytes.into();
        if bytes.len() < MIN_KEY_LEN {
            return Err(AuthError::TooShort { len: bytes.len() });
        }
        Self::from_transfer_key(&derive_transfer_key(&bytes))
    }

    /// The transfer key itself, as [`derive_transfer_key`] made it (a role credential file's
    /// `transfer` field).
    pub fn from_transfer_key(key: &[u8]) -> Result<Self, AuthError> {
        if key.len() < MIN_KEY_LEN {
            return Err(AuthError::TooShort { len: key.len() });
        }
        let keyed =
            HmacSha256::new_from_slice(key).map_err(|_| AuthError::TooShort { len: key.len() })?;
        Ok(AuthKey {
            len: key.len(),
            keyed,
        })
    }

    /// A fresh random 32-byte key (tests and the single-process benchmark).
    pub fn random() -> Result<Self, AuthError> {
        let bytes: [u8; 32] = rand::random();
        Self::new(bytes)
    }

    /// Read the key from a file: a role's credential file (a JSON document, first
    /// character `{`) gives its `transfer` key; anything else is the raw pool key, of which
    /// one trailing newline (as `echo` writes) is ignored.
    pub fn from_file(path: &Path) -> Result<Self, AuthError> {
        let mut bytes = std::fs::read(path).map_err(|source| AuthError::ReadFile {
            path: path.to_owned(),
            source,
        })?;
        if bytes.trim_ascii_start().first() == Some(&b'{') {
            return Self::from_document(&bytes).map_err(|reason| AuthError::Document {
                path: path.to_owned(),
                reason,
            });
        }
        if bytes.last() == Some(&b'\n') {
            bytes.pop();
            if bytes.last() == Some(&b'\r') {
                bytes.pop();
            }
        }
        Self::new(bytes)
    }

    /// The `transfer` key of a role's credential document (in memory: an agent's credential
    /// issued over the network); the error says which field is wrong.
    pub fn from_document(bytes: &[u8]) -> Result<Self, String> {
        let doc: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| format!("not a JSON document: {e}"))?;
        let role = doc
            .get("role")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("?")
            .chars()
            .take(32)
            .collect::<String>();
        let Some(hex) = doc.get("transfer").and_then(serde_json::Value::as_str) else {
            return Err(format!(
                "role {role} holds no transfer key (only agents and engines move KV bytes)"
            ));
        };
        let key = unhex(hex).ok_or("\"transfer\" is not lower-case hex")?;
        Self::from_transfer_key(&key).map_err(|e| format!("\"transfer\": {e}"))
    }

    /// The key from `KVPOOL_AUTH_KEY`, else from the file named by `KVPOOL_AUTH_KEY_FILE`.
    pub fn from_env() -> Result<Self, AuthError> {
        if let Some(v) = std::env::var_os(ENV_KEY) {
            return Self::new(v.into_encoded_bytes());
        }
        if let Some(p) = std::env::var_os(ENV_KEY_FILE) {
            return Self::from_file(Path::new(&p));
        }
        Err(AuthError::Missing)
    }

    /// An explicit key file if given, else the environment.
    pub fn load(file: Option<&Path>) -> Result<Self, AuthError> {
        match file {
            Some(p) => Self::from_file(p),
            None => Self::from_env(),
        }
    }

    fn mac(&self, role: &[u8], client_nonce: &[u8], server_nonce: &[u8]) -> HmacSha256 {
        let mut mac = self.keyed.clone();
        mac.update(b"kvpool-transfer-v1/");
        mac.update(role);
        mac.update(&(client_nonce.len() as u32).to_le_bytes());
        mac.update(client_nonce);
        mac.update(server_nonce);
        mac
    }

    /// The proof that the party playing `role` knows the key, bound to both nonces.
    pub fn prove(&self, role: &[u8], client_nonce: &[u8], server_nonce: &[u8]) -> [u8; PROOF_LEN] {
        let out = self
            .mac(role, client_nonce, server_nonce)
            .finalize()
            .into_bytes();
        let mut proof = [0u8; PROOF_LEN];
        proof.copy_from_slice(&out[..PROOF_LEN]);
        proof
    }

    /// Constant-time check of a peer's proof.
    pub fn verify(
        &self,
        role: &[u8],
        client_nonce: &[u8],
        server_nonce: &[u8],
        proof: &[u8],
    ) -> bool {
        self.mac(role, client_nonce, server_nonce)
            .verify_slice(proof)
            .is_ok()
    }
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_key_role_and_nonces() {
        let k = AuthKey::new(*b"0123456789abcdef").unwrap();
        let other = AuthKey::new(*b"0123456789abcdeX").unwrap();
        let p = k.prove(b"client", b"c", b"s");
        assert!(k.verify(b"client", b"c", b"s", &p));
        assert!(!other.verify(b"client", b"c", b"s", &p));
        assert!(!k.verify(b"server", b"c", b"s", &p));
        assert!(!k.verify(b"client", b"c2", b"s", &p));
        assert!(!k.verify(b"client", b"c", b"s", &p[..31]));
        assert!(format!("{k:?}").contains("redacted"));
    }

    #[test]
    fn keys_load_from_files_and_reject_short_ones() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, "a-long-enough-shared-key\n").unwrap();
        let k = AuthKey::from_file(&path).unwrap();
        let same = AuthKey::new(*b"a-long-enough-shared-key").unwrap();
        let p = k.prove(b"client", b"c", b"s");
        assert!(same.verify(b"client", b"c", b"s", &p));
        std::fs::write(&path, "short").unwrap();
        assert!(matches!(
            AuthKey::from_file(&path),
            Err(AuthError::TooShort { len: 5 })
        ));
        assert!(matches!(
            AuthKey::from_file(&dir.path().join("missing")),
            Err(AuthError::ReadFile { .. })
        ));
    }

    #[test]
    fn role_files_carry_the_derived_key_and_the_conductor_has_none() {
        let pool = b"a-long-enough-shared-key";
        let derived = derive_transfer_key(pool);
        assert_ne!(&derived[..], &pool[..]);
        let hex: String = derived.iter().map(|b| format!("{b:02x}")).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("engine.json");
        std::fs::write(
            &path,
            format!(r#"{{"role":"engine","master":"00","transfer":"{hex}"}}"#),
        )
        .unwrap();
        let from_doc = AuthKey::from_file(&path).unwrap();
        let from_pool = AuthKey::new(*pool).unwrap();
        let p = from_pool.prove(b"client", b"c", b"s");
        assert!(from_doc.verify(b"client", b"c", b"s", &p), "same plane key");
        // Keyed with the pool key itself, a peer does not pass.
        let raw = AuthKey::from_transfer_key(pool).unwrap();
        assert!(!raw.verify(b"client", b"c", b"s", &p));
        std::fs::write(&path, r#"{"role":"conductor","master":"00"}"#).unwrap();
        let e = AuthKey::from_file(&path).unwrap_err();
        assert!(
            matches!(e, AuthError::Document { .. }) && e.to_string().contains("conductor"),
            "{e}"
        );
        for bad in [
            "{",
            r#"{"role":"engine","transfer":"XY"}"#,
            r#"{"role":"engine","transfer":"00"}"#,
        ] {
            std::fs::write(&path, bad).unwrap();
            assert!(
                matches!(AuthKey::from_file(&path), Err(AuthError::Document { .. })),
                "{bad}"
            );
        }
    }
}

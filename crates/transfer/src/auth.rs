//! The pool's shared key and the HMAC-SHA256 proofs of the connection handshake.
//! I/O boundary: reading the key from an environment variable or a file (the operator mounts it
//! from a Secret); the proof computation itself is pure.

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
}

impl AuthError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// The pool's shared secret, kept only as a keyed HMAC state. `Debug` never prints it.
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

impl AuthKey {
    /// A key from raw bytes (at least [`MIN_KEY_LEN`]).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, AuthError> {
        let bytes = bytes.into();
        if bytes.len() < MIN_KEY_LEN {
            return Err(AuthError::TooShort { len: bytes.len() });
        }
        let keyed = HmacSha256::new_from_slice(&bytes)
            .map_err(|_| AuthError::TooShort { len: bytes.len() })?;
        Ok(AuthKey {
            len: bytes.len(),
            keyed,
        })
    }

    /// A fresh random 32-byte key (tests and the single-process benchmark).
    pub fn random() -> Result<Self, AuthError> {
        let bytes: [u8; 32] = rand::random();
        Self::new(bytes)
    }

    /// Read the key from a file; one trailing newline (as `echo` writes) is ignored.
    pub fn from_file(path: &Path) -> Result<Self, AuthError> {
        let mut bytes = std::fs::read(path).map_err(|source| AuthError::ReadFile {
            path: path.to_owned(),
            source,
        })?;
        if bytes.last() == Some(&b'\n') {
            bytes.pop();
            if bytes.last() == Some(&b'\r') {
                bytes.pop();
            }
        }
        Self::new(bytes)
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
}

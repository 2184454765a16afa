//! Request authentication with the pool's shared key. Each call carries
//! `x-kvpool-auth: v1.<unix ms>.<nonce hex>.<hmac hex>` where the MAC is HMAC-SHA256 over
//! `kvpool-master-v1\n<unix ms>\n<nonce>`. The server accepts a timestamp within a skew window
//! and each nonce once inside that window (replays are refused). I/O boundary: reading the
//! key file; signing and checking are pure apart from the wall clock.

use std::collections::{HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, KeyInit, Mac};
use parking_lot::Mutex;
use sha2::Sha256;

/// Metadata header that carries the credential.
pub const AUTH_HEADER: &str = "x-kvpool-auth";
const CONTEXT: &str = "kvpool-master-v1";
/// Largest accepted clock difference between client and master.
pub const MAX_SKEW: Duration = Duration::from_secs(60);
/// Bound on remembered nonces (about 50 MB; memory stays fixed under any request rate). Above
/// ~8k calls/s sustained, nonces are forgotten before the window ends, shortening the replay
/// window accordingly.
const MAX_NONCES: usize = 1 << 20;

/// Errors of authentication.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum AuthError {
    #[error("cannot read auth key file {path}")]
    ReadKey {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("auth key file {0} holds fewer than 16 bytes")]
    ShortKey(PathBuf),
    #[error("missing {AUTH_HEADER} header")]
    Missing,
    #[error("malformed {AUTH_HEADER} header")]
    Malformed,
    #[error("credential timestamp is {0:?} away from the master's clock")]
    Skew(Duration),
    #[error("credential does not match the pool key")]
    BadMac,
    #[error("credential replayed")]
    Replay,
}

impl AuthError {
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// The pool's shared key.
#[derive(Clone)]
pub struct AuthKey(Arc<Vec<u8>>);

impl std::fmt::Debug for AuthKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AuthKey(..)")
    }
}

impl AuthKey {
    /// Key from bytes; at least 16 bytes (surrounding whitespace ignored).
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let trimmed = bytes.trim_ascii();
        (trimmed.len() >= 16).then(|| Self(Arc::new(trimmed.to_vec())))
    }

    pub fn from_file(path: &Path) -> Result<Self, AuthError> {
        let bytes = std::fs::read(path).map_err(|source| AuthError::ReadKey {
            path: path.to_owned(),
            source,
        })?;
        Self::from_bytes(&bytes).ok_or_else(|| AuthError::ShortKey(path.to_owned()))
    }

    fn mac(&self, ts: u64, nonce: &str) -> Hmac<Sha256> {
        // HMAC takes keys of any length; the error branch cannot happen.
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0)
            .unwrap_or_else(|_| <Hmac<Sha256> as KeyInit>::new(&Default::default()));
        mac.update(format!("{CONTEXT}\n{ts}\n{nonce}").as_bytes());
        mac
    }

    /// A fresh credential for one request.
    pub fn sign(&self) -> String {
        let ts = unix_ms();
        let nonce = format!("{:032x}", rand::random::<u128>());
        let tag = self.mac(ts, &nonce).finalize().into_bytes();
        format!("v1.{ts}.{nonce}.{}", hex(&tag))
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Server-side checker with a replay cache.
#[derive(Clone, Debug)]
pub struct Verifier {
    key: AuthKey,
    seen: Arc<Mutex<Seen>>,
}

/// Nonces accepted within the replay window (16 bytes each, plus arrival time).
#[derive(Debug, Default)]
struct Seen {
    nonces: HashSet<u128>,
    order: VecDeque<(u64, u128)>,
}

impl Verifier {
    pub fn new(key: AuthKey) -> Self {
        Self {
            key,
            seen: Arc::new(Mutex::new(Seen::default())),
        }
    }

    /// Check one credential at wall time `now_ms`.
    pub fn verify_at(&self, header: Option<&str>, now_ms: u64) -> Result<(), AuthError> {
        let header = header.ok_or(AuthError::Missing)?;
        let mut parts = header.split('.');
        let (Some("v1"), Some(ts), Some(nonce), Some(tag), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return Err(AuthError::Malformed);
        };
        let ts: u64 = ts.parse().map_err(|_| AuthError::Malformed)?;
        if nonce.len() != 32 {
            return Err(AuthError::Malformed);
        }
        let nonce_value = u128::from_str_radix(nonce, 16).map_err(|_| AuthError::Malformed)?;
        let tag = unhex(tag).ok_or(AuthError::Malformed)?;
        let skew = Duration::from_millis(ts.abs_diff(now_ms));
        if skew > MAX_SKEW {
            return Err(AuthError::Skew(skew));
        }
        self.key
            .mac(ts, nonce)
            .verify_slice(&tag)
            .map_err(|_| AuthError::BadMac)?;
        let mut seen = self.seen.lock();
        let window = u64::try_from(MAX_SKEW.as_millis()).unwrap_or(u64::MAX);
        while let Some((t, _)) = seen.order.front() {
            if t.saturating_add(2 * window) >= now_ms && seen.order.len() < MAX_NONCES {
                break;
            }
            if let Some((_, n)) = seen.order.pop_front() {
                seen.nonces.remove(&n);
            }
        }
        if !seen.nonces.insert(nonce_value) {
            return Err(AuthError::Replay);
        }
        seen.order.push_back((now_ms, nonce_value));
        Ok(())
    }

    pub fn verify(&self, header: Option<&str>) -> Result<(), AuthError> {
        self.verify_at(header, unix_ms())
    }
}

impl tonic::service::Interceptor for Verifier {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let header = req
            .metadata()
            .get(AUTH_HEADER)
            .and_then(|v| v.to_str().ok());
        match self.verify(header) {
            Ok(()) => Ok(req),
            Err(e) => {
                tracing::debug!(error = %e, "unauthenticated request refused");
                Err(tonic::Status::unauthenticated(e.to_string()))
            }
        }
    }
}

/// Client-side interceptor adding a fresh credential to every call.
#[derive(Clone, Debug)]
pub struct Signer(pub AuthKey);

impl tonic::service::Interceptor for Signer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let value = self
            .0
            .sign()
            .parse()
            .map_err(|_| tonic::Status::internal("credential is not a valid header value"))?;
        req.metadata_mut().insert(AUTH_HEADER, value);
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: &[u8]) -> AuthKey {
        AuthKey::from_bytes(b).expect("key")
    }

    #[test]
    fn signed_credentials_verify_once() {
        let k = key(b"0123456789abcdef-secret");
        let v = Verifier::new(k.clone());
        let cred = k.sign();
        v.verify(Some(&cred)).expect("valid");
        assert!(matches!(v.verify(Some(&cred)), Err(AuthError::Replay)));
        v.verify(Some(&k.sign())).expect("fresh nonce");
    }

    #[test]
    fn wrong_key_stale_and_garbage_are_refused() {
        let v = Verifier::new(key(b"0123456789abcdef-secret"));
        let other = key(b"another key of 16+ bytes");
        assert!(matches!(
            v.verify(Some(&other.sign())),
            Err(AuthError::BadMac)
        ));
        assert!(matches!(v.verify(None), Err(AuthError::Missing)));
        for bad in [
            "",
            "v1",
            "v2.1.2.3",
            "v1.x.n.00",
            "v1.1.n.zz",
            "v1.1.n.00.extra",
            "v1.1.0123456789abcdef0123456789abcdeg.00",
            "v1.1.0123456789abcdef0123456789abcdef.zz",
        ] {
            assert!(
                matches!(v.verify(Some(bad)), Err(AuthError::Malformed)),
                "{bad}"
            );
        }
        let k = key(b"0123456789abcdef-secret");
        let cred = k.sign();
        let far = unix_ms() + 10 * 60_000;
        assert!(matches!(
            v.verify_at(Some(&cred), far),
            Err(AuthError::Skew(_))
        ));
        assert!(AuthKey::from_bytes(b"short\n").is_none());
    }

    #[test]
    fn key_file_is_read_and_trimmed() {
        let dir = tempfile::tempdir().expect("tmp");
        let p = dir.path().join("key");
        std::fs::write(&p, "0123456789abcdef0123\n").expect("write");
        let k = AuthKey::from_file(&p).expect("key");
        Verifier::new(key(b"0123456789abcdef0123"))
            .verify(Some(&k.sign()))
            .expect("same key");
        std::fs::write(&p, "short").expect("write");
        assert!(matches!(
            AuthKey::from_file(&p),
            Err(AuthError::ShortKey(_))
        ));
        assert!(matches!(
            AuthKey::from_file(&dir.path().join("none")),
            Err(AuthError::ReadKey { .. })
        ));
    }
}

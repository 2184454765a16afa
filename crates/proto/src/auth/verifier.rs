//! The master's check of a call's credential: the MAC under the claimed role's key (every
//! role key is derived from the pool key at start), the clock window, the role's permission
//! for the method, and the replay cache. Pure apart from the wall clock in [`Verifier::verify`].

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use hmac::Hmac;
use parking_lot::Mutex;
use sha2::Sha256;

use super::credential::{self, body_digest};
use super::role::{Role, role_key};
use super::{AuthError, AuthKey, MAX_SKEW, keyed, unix_ms};

/// Bound on remembered nonces (about 50 MB; memory stays fixed under any request rate). Above
/// ~8k calls/s sustained, nonces are forgotten before the window ends, shortening the replay
/// window accordingly.
const MAX_NONCES: usize = 1 << 20;

/// What a credential that checked out says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verified {
    pub role: Role,
    /// When the caller made it (its clock, milliseconds since the epoch).
    pub ts_ms: u64,
    body: Option<[u8; 32]>,
}

impl Verified {
    /// A fast-lane call: the credential must be bound to exactly `body` (the frame's bytes
    /// after the credential).
    pub fn check_body(&self, body: &[u8]) -> Result<(), AuthError> {
        match self.body {
            None => Err(AuthError::Binding(
                "a fast-lane credential must carry the body's digest",
            )),
            Some(d) if d == body_digest(body) => Ok(()),
            Some(_) => Err(AuthError::BodyMismatch),
        }
    }

    /// A gRPC call: its body streams past the check, so a credential bound to a body is
    /// refused (it was made for the fast lane).
    pub fn check_unbound(&self) -> Result<(), AuthError> {
        match self.body {
            None => Ok(()),
            Some(_) => Err(AuthError::Binding(
                "a body-bound credential is not accepted on gRPC",
            )),
        }
    }
}

/// Server-side checker with a replay cache (cheap to clone; clones share the cache).
#[derive(Clone)]
pub struct Verifier {
    /// Each role's key state, in [`Role::ALL`] order.
    keys: Arc<[Hmac<Sha256>; 5]>,
    seen: Arc<Mutex<Seen>>,
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Verifier(..)")
    }
}

/// Nonces accepted within the replay window (16 bytes each, plus arrival time).
#[derive(Debug, Default)]
struct Seen {
    nonces: HashSet<u128>,
    order: VecDeque<(u64, u128)>,
}

impl Verifier {
    /// A verifier for the pool whose key is `pool` (the `admin` key; a role's key cannot
    /// check the other roles' credentials).
    pub fn new(pool: &AuthKey) -> Result<Self, AuthError> {
        let bytes = pool
            .pool_bytes()
            .ok_or(AuthError::NotPoolKey(pool.role()))?;
        let keys = Role::ALL.map(|r| keyed(&role_key(bytes, r)));
        Ok(Self {
            keys: Arc::new(keys),
            seen: Arc::new(Mutex::new(Seen::default())),
        })
    }

    /// Check the credential `header` of a call of `method` (its gRPC name) at wall time
    /// `now_ms`. Order: format, clock window, MAC, permission, replay; the nonce is
    /// remembered only once everything else passed.
    pub fn verify_at(
        &self,
        header: Option<&str>,
        method: &str,
        now_ms: u64,
    ) -> Result<Verified, AuthError> {
        let header = header.ok_or(AuthError::Missing)?;
        let cred = credential::parse(header)?;
        let skew = Duration::from_millis(cred.ts_ms.abs_diff(now_ms));
        if skew > MAX_SKEW {
            return Err(AuthError::Skew(skew));
        }
        let index = Role::ALL.iter().position(|r| *r == cred.role).unwrap_or(0);
        let keyed = self.keys.get(index).ok_or(AuthError::BadMac)?;
        if !cred.mac_matches(keyed, method) {
            return Err(AuthError::BadMac);
        }
        if !cred.role.allows(method) {
            return Err(AuthError::Forbidden {
                role: cred.role,
                method: method.chars().take(64).collect(),
            });
        }
        self.remember(cred.nonce, now_ms)?;
        Ok(Verified {
            role: cred.role,
            ts_ms: cred.ts_ms,
            body: cred.body,
        })
    }

    /// [`Self::verify_at`] now.
    pub fn verify(&self, header: Option<&str>, method: &str) -> Result<Verified, AuthError> {
        self.verify_at(header, method, unix_ms())
    }

    fn remember(&self, nonce: u128, now_ms: u64) -> Result<(), AuthError> {
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
        if !seen.nonces.insert(nonce) {
            return Err(AuthError::Replay);
        }
        seen.order.push_back((now_ms, nonce));
        Ok(())
    }
}

//! The master's check of a call's credential: the MAC under the claimed role's key (every
//! role key is derived from the pool key at start), the clock window, the role's permission
//! for the method, and the replay cache. Pure apart from the wall clock in [`Verifier::verify`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use hmac::Hmac;
use parking_lot::Mutex;
use sha2::Sha256;

use super::credential::{self, body_digest};
use super::role::{Role, node_key, role_key};
use super::{AuthError, AuthKey, MAX_SKEW, keyed, unix_ms};

/// Bound on remembered nonces (about 50 MB; memory stays fixed under any request rate). Above
/// ~8k calls/s sustained, nonces are forgotten before the window ends, shortening the replay
/// window accordingly.
const MAX_NONCES: usize = 1 << 20;

/// What a credential that checked out says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verified {
    pub role: Role,
    /// The node a node-bound agent credential speaks for.
    pub node: Option<String>,
    /// When the caller made it (its clock, milliseconds since the epoch).
    pub ts_ms: u64,
    body: Option<[u8; 32]>,
    /// Whether the verifier let node-less agent credentials make node calls.
    shared_agents: bool,
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

impl Verified {
    /// Whether this caller may make a node call (see [`Role::is_node_call`]) for `node`:
    /// `admin` for any node; an agent bound to `node`; a node-less agent credential only where
    /// the verifier allows shared agent credentials. The error names why.
    pub fn may_act_for(&self, node: &str) -> Result<(), String> {
        let shared_agents = self.shared_agents;
        match (self.role, &self.node) {
            (Role::Admin, _) => Ok(()),
            (Role::Agent, Some(own)) if own == node => Ok(()),
            (Role::Agent, Some(own)) => Err(format!(
                "the agent credential of node {own:?} may not act for node {:?}",
                node.chars().take(64).collect::<String>()
            )),
            (Role::Agent, None) if shared_agents => Ok(()),
            (Role::Agent, None) => Err(
                "an agent credential not bound to a node may not make node calls here (this \
                 master requires node-bound agent credentials: kvpool auth derive --role agent \
                 --node NODE)"
                    .to_owned(),
            ),
            (role, _) => Err(format!("role {role} may not make node calls")),
        }
    }
}

/// Server-side checker with a replay cache (cheap to clone; clones share the cache).
#[derive(Clone)]
pub struct Verifier {
    /// Each role's key state, in [`Role::ALL`] order.
    keys: Arc<[Hmac<Sha256>; 5]>,
    /// The pool key, to derive a node-bound agent's key.
    pool: Arc<[u8]>,
    /// Whether node-less agent credentials may make node calls (for any node).
    shared_agents: bool,
    seen: Arc<Mutex<Seen>>,
    /// Node-bound agents' keyed states, derived once per node (each call would otherwise
    /// derive the node key and key an HMAC again). Filled only after a MAC matched, so names
    /// sent by callers without the key never enter; emptied when it reaches
    /// [`MAX_CACHED_NODES`].
    pub(super) nodes: Arc<Mutex<HashMap<String, Hmac<Sha256>>>>,
}

/// Most node keys [`Verifier`] keeps derived.
pub(super) const MAX_CACHED_NODES: usize = 4096;

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
            pool: Arc::from(bytes),
            shared_agents: false,
            seen: Arc::new(Mutex::new(Seen::default())),
            nodes: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    /// Let node-less agent credentials (the agent role's key, shared by every agent) make node
    /// calls for any node: for deployments that cannot give each agent its own node's
    /// credential yet. Off by default.
    pub fn allow_shared_agents(mut self, allow: bool) -> Self {
        self.shared_agents = allow;
        self
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
        match &cred.node {
            // Only agent credentials name a node (`parse` refuses the rest).
            Some(node) => {
                let cached = self.nodes.lock().get(node.as_str()).cloned();
                let fresh = cached.is_none();
                let node_keyed = cached.unwrap_or_else(|| keyed(&node_key(&self.pool, node)));
                if !cred.mac_matches(&node_keyed, method) {
                    return Err(AuthError::BadMac);
                }
                if fresh {
                    let mut nodes = self.nodes.lock();
                    if nodes.len() >= MAX_CACHED_NODES {
                        nodes.clear();
                    }
                    nodes.insert(node.clone(), node_keyed);
                }
            }
            None => {
                let index = Role::ALL.iter().position(|r| *r == cred.role).unwrap_or(0);
                let keyed = self.keys.get(index).ok_or(AuthError::BadMac)?;
                if !cred.mac_matches(keyed, method) {
                    return Err(AuthError::BadMac);
                }
            }
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
            node: cred.node,
            ts_ms: cred.ts_ms,
            body: cred.body,
            shared_agents: self.shared_agents,
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

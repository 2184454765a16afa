//! Request authentication with per-role keys derived from the pool key. Each call carries
//! `x-kvpool-auth: v2.<role>.<unix ms>.<nonce>.<body digest>.<mac>` (see `credential`), made
//! with the caller's role key over the role, the call's method, the time, the nonce and, on
//! the fast lane, the body's SHA-256. The master derives every role's key from the pool key,
//! checks the MAC, refuses a method the role may not call, accepts a timestamp within a skew
//! window and each nonce once inside that window.
//!
//! - `role`: the roles, what each may call, and the derivation of their keys.
//! - `credential`: the credential's format, signing and parsing.
//! - `verifier`: the master's check and its replay cache.
//!
//! Key files: a raw pool key (16 bytes or more; surrounding whitespace ignored) is the
//! `admin` role; a role's credential file is a JSON document
//! `{"role":"engine","master":"<hex>","transfer":"<hex>"}` (see [`RoleDocument`]), told apart
//! by its first character `{`. I/O boundary: reading the key file; signing and checking are
//! pure apart from the wall clock.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, KeyInit};
use sha2::Sha256;

mod credential;
mod role;
mod verifier;

pub use credential::{Parsed, VERSION, body_digest, parse};
pub use role::{MAX_NODE_LEN, METHODS, Role, node_key, role_key, valid_node};
pub use verifier::{Verified, Verifier};

/// Metadata header that carries the credential.
pub const AUTH_HEADER: &str = "x-kvpool-auth";
/// Largest accepted clock difference between client and master.
pub const MAX_SKEW: Duration = Duration::from_secs(60);
/// Shortest key accepted, in bytes.
pub const MIN_KEY_LEN: usize = 16;

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
    #[error("credential file {path}: {reason}")]
    Document { path: PathBuf, reason: String },
    #[error("the pool key is needed here, not a credential file of role {0}")]
    NotPoolKey(Role),
    #[error("missing {AUTH_HEADER} header")]
    Missing,
    #[error("malformed {AUTH_HEADER} header: {0}")]
    Malformed(&'static str),
    #[error("credential timestamp is {0:?} away from the master's clock")]
    Skew(Duration),
    #[error("credential does not match its role's key for this method")]
    BadMac,
    #[error("role {role} may not call {method}")]
    Forbidden { role: Role, method: String },
    #[error("credential replayed")]
    Replay,
    #[error("{0}")]
    Binding(&'static str),
    #[error("request body does not match the credential's digest")]
    BodyMismatch,
}

impl AuthError {
    pub fn category(&self) -> &'static str {
        self.into()
    }

    /// The gRPC status of a refused call: PERMISSION_DENIED for an authenticated caller
    /// whose role may not make the call, UNAUTHENTICATED otherwise.
    pub fn status(&self) -> tonic::Status {
        match self {
            AuthError::Forbidden { .. } => tonic::Status::permission_denied(self.to_string()),
            _ => tonic::Status::unauthenticated(self.to_string()),
        }
    }
}

/// A caller's key for the master: its role and that role's key (the pool key for `admin`), or
/// a node-bound agent's node and that node's key.
#[derive(Clone)]
pub struct AuthKey {
    role: Role,
    /// The node of a node-bound agent key.
    node: Option<Arc<str>>,
    /// The principal field of this key's credentials (`engine`, `agent@<hex node>`).
    principal: Arc<str>,
    keyed: Hmac<Sha256>,
    /// The pool key, held by `admin` only (to derive the other roles' keys).
    pool: Option<Arc<[u8]>>,
}

impl std::fmt::Debug for AuthKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AuthKey({}, ..)", self.principal)
    }
}

fn keyed(key: &[u8]) -> Hmac<Sha256> {
    // HMAC takes keys of any length; the error branch cannot happen.
    <Hmac<Sha256> as KeyInit>::new_from_slice(key)
        .unwrap_or_else(|_| <Hmac<Sha256> as KeyInit>::new(&Default::default()))
}

impl AuthKey {
    /// The pool key (`admin`) from bytes; at least 16 bytes (surrounding whitespace ignored).
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let trimmed = bytes.trim_ascii();
        (trimmed.len() >= MIN_KEY_LEN).then(|| Self {
            role: Role::Admin,
            node: None,
            principal: Arc::from(Role::Admin.name()),
            keyed: keyed(trimmed),
            pool: Some(Arc::from(trimmed)),
        })
    }

    /// A role's key as derived by [`role_key`] (for `admin`: the pool key).
    pub fn from_role_key(role: Role, key: &[u8]) -> Option<Self> {
        if role == Role::Admin {
            return Self::from_bytes(key);
        }
        (key.len() >= MIN_KEY_LEN).then(|| Self {
            role,
            node: None,
            principal: Arc::from(role.name()),
            keyed: keyed(key),
            pool: None,
        })
    }

    /// The key of the agent on `node`, as derived by [`node_key`]; `None` for a short key or a
    /// node name that cannot be bound (see [`valid_node`]).
    pub fn from_node_key(node: &str, key: &[u8]) -> Option<Self> {
        (key.len() >= MIN_KEY_LEN && valid_node(node)).then(|| Self {
            role: Role::Agent,
            node: Some(Arc::from(node)),
            principal: Arc::from(credential::principal(Role::Agent, Some(node))),
            keyed: keyed(key),
            pool: None,
        })
    }

    /// Read a key file: a raw pool key, or a role's credential file (see [`RoleDocument`]).
    pub fn from_file(path: &Path) -> Result<Self, AuthError> {
        let bytes = std::fs::read(path).map_err(|source| AuthError::ReadKey {
            path: path.to_owned(),
            source,
        })?;
        if !RoleDocument::looks_like(&bytes) {
            return Self::from_bytes(&bytes).ok_or_else(|| AuthError::ShortKey(path.to_owned()));
        }
        Self::from_document(&bytes).map_err(|reason| AuthError::Document {
            path: path.to_owned(),
            reason,
        })
    }

    /// The master key of a role's credential document held in memory (an agent's credential
    /// issued over the network); the error says which field is wrong.
    pub fn from_document(bytes: &[u8]) -> Result<Self, String> {
        let doc = RoleDocument::parse(bytes)?;
        let key = match &doc.node {
            Some(node) => Self::from_node_key(node, &doc.master),
            None => Self::from_role_key(doc.role, &doc.master),
        };
        key.ok_or_else(|| format!("master key is shorter than {MIN_KEY_LEN} bytes"))
    }

    /// The role this key signs as.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The node this key is bound to (a node-bound agent key), if any.
    pub fn node(&self) -> Option<&str> {
        self.node.as_deref()
    }

    fn pool_bytes(&self) -> Option<&[u8]> {
        self.pool.as_deref()
    }

    /// `role`'s key, derived from this pool key; `None` unless this is the pool key.
    pub fn derive(&self, role: Role) -> Option<AuthKey> {
        let pool = self.pool_bytes()?;
        Self::from_role_key(role, &role_key(pool, role))
    }

    /// The key of the agent on `node`, derived from this pool key; `None` unless this is the
    /// pool key and `node` can be bound.
    pub fn derive_node(&self, node: &str) -> Option<AuthKey> {
        let pool = self.pool_bytes()?;
        Self::from_node_key(node, &node_key(pool, node))
    }

    /// The credential file of the agent on `node` (its node's master key and the transfer
    /// plane's key); `None` unless this is the pool key and `node` can be bound.
    pub fn node_document(&self, node: &str, transfer: Option<&[u8]>) -> Option<RoleDocument> {
        let pool = self.pool_bytes()?;
        valid_node(node).then(|| RoleDocument {
            role: Role::Agent,
            node: Some(node.to_owned()),
            master: node_key(pool, node),
            transfer: transfer.map(<[u8]>::to_vec),
        })
    }

    /// The credential file of `role` (its master key and, for roles that move KV bytes,
    /// `transfer`, the transfer plane's key); `None` unless this is the pool key.
    pub fn role_document(&self, role: Role, transfer: Option<&[u8]>) -> Option<RoleDocument> {
        let pool = self.pool_bytes()?;
        Some(RoleDocument {
            role,
            node: None,
            master: role_key(pool, role),
            transfer: transfer
                .filter(|_| role.holds_transfer_key())
                .map(<[u8]>::to_vec),
        })
    }

    /// A credential for one gRPC call of `method` (its gRPC name, `PutStart`), made now.
    pub fn sign(&self, method: &str) -> String {
        self.sign_at(method, None, unix_ms(), rand::random())
    }

    /// A credential for one fast-lane call of `method`, bound to `body` (the frame's bytes
    /// after the credential).
    pub fn sign_body(&self, method: &str, body: &[u8]) -> String {
        self.sign_at(method, Some(body), unix_ms(), rand::random())
    }

    /// The credential for `method` (bound to `body` if given) at `ts_ms` with `nonce`.
    pub fn sign_at(&self, method: &str, body: Option<&[u8]>, ts_ms: u64, nonce: u128) -> String {
        credential::sign(&self.keyed, &self.principal, method, body, ts_ms, nonce)
    }
}

/// A role's credential file: `{"role":"engine","master":"<hex>","transfer":"<hex>"}`, hex in
/// lower case; `transfer` only for roles that move KV bytes; a node-bound agent's file also
/// names its node (`"node":"gpu-node-7"`) and holds that node's key as `master`. The `admin`
/// role has no such file: its key file is the raw pool key.
#[derive(Clone, PartialEq, Eq)]
pub struct RoleDocument {
    pub role: Role,
    /// The node a node-bound agent's file is for.
    pub node: Option<String>,
    pub master: Vec<u8>,
    pub transfer: Option<Vec<u8>>,
}

impl std::fmt::Debug for RoleDocument {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.node {
            Some(n) => write!(f, "RoleDocument({}@{n}, ..)", self.role),
            None => write!(f, "RoleDocument({}, ..)", self.role),
        }
    }
}

impl RoleDocument {
    /// Whether a key file's bytes are a credential document rather than a raw pool key.
    pub fn looks_like(bytes: &[u8]) -> bool {
        bytes.trim_ascii_start().first() == Some(&b'{')
    }

    /// The document as written to a file (one line).
    pub fn to_json(&self) -> String {
        let mut doc = serde_json::json!({
            "role": self.role.name(),
            "master": credential::hex(&self.master),
        });
        if let Some(n) = &self.node {
            doc["node"] = n.clone().into();
        }
        if let Some(t) = &self.transfer {
            doc["transfer"] = credential::hex(t).into();
        }
        format!("{doc}\n")
    }

    /// Parse a document; the error says which field is wrong.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        let doc: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| format!("not a JSON document: {e}"))?;
        let field = |name: &str| doc.get(name).and_then(serde_json::Value::as_str);
        let role = field("role").ok_or("no \"role\" string")?;
        let role = Role::from_name(role).ok_or_else(|| {
            format!(
                "unknown role {:?} (one of agent, engine, conductor, observer)",
                role.chars().take(32).collect::<String>()
            )
        })?;
        if role == Role::Admin {
            return Err("the admin role's key file is the raw pool key, not a document".into());
        }
        let hex_field = |name: &str| -> Result<Option<Vec<u8>>, String> {
            let Some(v) = doc.get(name) else {
                return Ok(None);
            };
            let s = v.as_str().ok_or(format!("\"{name}\" is not a string"))?;
            let bytes = credential::unhex(s).ok_or(format!("\"{name}\" is not lower-case hex"))?;
            if bytes.len() < MIN_KEY_LEN {
                return Err(format!("\"{name}\" is shorter than {MIN_KEY_LEN} bytes"));
            }
            Ok(Some(bytes))
        };
        let master = hex_field("master")?.ok_or("no \"master\" key")?;
        let transfer = hex_field("transfer")?;
        let node = match doc.get("node") {
            None => None,
            Some(v) => {
                let n = v.as_str().ok_or("\"node\" is not a string")?;
                if role != Role::Agent {
                    return Err(format!(
                        "a {role} credential names no node (only agents' do)"
                    ));
                }
                if !valid_node(n) {
                    return Err(format!(
                        "\"node\" is not a node name (1 to {MAX_NODE_LEN} bytes, no control characters)"
                    ));
                }
                Some(n.to_owned())
            }
        };
        Ok(RoleDocument {
            role,
            node,
            master,
            transfer,
        })
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Client-side interceptor adding a fresh credential, for the call's method, to every call
/// (the method comes from the [`tonic::GrpcMethod`] the generated client attaches).
#[derive(Clone, Debug)]
pub struct Signer(pub AuthKey);

impl tonic::service::Interceptor for Signer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let method = req
            .extensions()
            .get::<tonic::GrpcMethod<'static>>()
            .map(|m| m.method())
            .ok_or_else(|| tonic::Status::internal("the call names no gRPC method to sign"))?;
        let value = self
            .0
            .sign(method)
            .parse()
            .map_err(|_| tonic::Status::internal("credential is not a valid header value"))?;
        req.metadata_mut().insert(AUTH_HEADER, value);
        Ok(req)
    }
}

#[cfg(test)]
mod tests;

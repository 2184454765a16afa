//! The per-call credential, version 2, bound to its role and method (and, on the fast lane,
//! to its body):
//!
//! ```text
//! v2.<principal>.<unix ms>.<nonce: 32 hex>.<body SHA-256: 64 hex, or empty>.<mac: 64 hex>
//! principal = <role> | agent@<node name in hex>
//! mac = HMAC-SHA256(key, "kvpool-master-v2\n<principal>\n<method>\n<ms>\n<nonce>\n<body hex>")
//! ```
//! `key` is the role's key, or for a node-bound agent its node's key (see `role`). `method` is
//! the gRPC method name (`PutStart`); it is not sent, both ends know it. Pure.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use super::AuthError;
use super::role::{Role, valid_node};

/// Version tag of the credentials this build speaks (and the only one it accepts).
pub const VERSION: &str = "v2";
const CONTEXT: &str = "kvpool-master-v2";
/// Hex digits of a nonce.
const NONCE_HEX: usize = 32;
/// Hex digits of a SHA-256 (body digest and MAC).
const SHA_HEX: usize = 64;

/// A credential's fields, parsed but not checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed<'a> {
    pub role: Role,
    /// The node a node-bound agent credential speaks for.
    pub node: Option<String>,
    principal_text: &'a str,
    pub ts_ms: u64,
    pub nonce: u128,
    nonce_text: &'a str,
    /// The SHA-256 of the body the credential was made for, if it is bound to one.
    pub body: Option<[u8; 32]>,
    body_text: &'a str,
    tag: [u8; 32],
}

/// Split and decode a credential; every failure names the part that is wrong.
pub fn parse(header: &str) -> Result<Parsed<'_>, AuthError> {
    let mut parts = header.split('.');
    let (Some(version), Some(role), Some(ts), Some(nonce), Some(body), Some(tag), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return Err(AuthError::Malformed("not six dot-separated fields"));
    };
    if version != VERSION {
        return Err(AuthError::Malformed("version is not v2"));
    }
    let principal_text = role;
    let (role, node) = match role.split_once('@') {
        None => (role, None),
        Some((role, node_hex)) => {
            let node = unhex(node_hex)
                .and_then(|b| String::from_utf8(b).ok())
                .filter(|n| valid_node(n))
                .ok_or(AuthError::Malformed("node is not a hex-encoded node name"))?;
            (role, Some(node))
        }
    };
    let role = Role::from_name(role).ok_or(AuthError::Malformed("unknown role"))?;
    if node.is_some() && role != Role::Agent {
        return Err(AuthError::Malformed(
            "only an agent credential names a node",
        ));
    }
    if ts.is_empty() || ts.len() > 20 || !ts.bytes().all(|b| b.is_ascii_digit()) {
        return Err(AuthError::Malformed(
            "timestamp is not a number of milliseconds",
        ));
    }
    let ts_ms: u64 = ts
        .parse()
        .map_err(|_| AuthError::Malformed("timestamp is not a number of milliseconds"))?;
    if nonce.len() != NONCE_HEX || !is_lower_hex(nonce) {
        return Err(AuthError::Malformed("nonce is not 32 hex digits"));
    }
    let nonce_value =
        u128::from_str_radix(nonce, 16).map_err(|_| AuthError::Malformed("nonce is not hex"))?;
    let body_digest = match body {
        "" => None,
        b => Some(unhex32(b).ok_or(AuthError::Malformed("body digest is not 64 hex digits"))?),
    };
    let tag = unhex32(tag).ok_or(AuthError::Malformed("mac is not 64 hex digits"))?;
    Ok(Parsed {
        role,
        node,
        principal_text,
        ts_ms,
        nonce: nonce_value,
        nonce_text: nonce,
        body: body_digest,
        body_text: body,
        tag,
    })
}

impl Parsed<'_> {
    /// Whether the MAC is right for `method` under `keyed` (the role key's HMAC state).
    pub fn mac_matches(&self, keyed: &Hmac<Sha256>, method: &str) -> bool {
        mac(
            keyed,
            self.principal_text,
            method,
            self.ts_ms,
            self.nonce_text,
            self.body_text,
        )
        .verify_slice(&self.tag)
        .is_ok()
    }
}

fn mac(
    keyed: &Hmac<Sha256>,
    principal: &str,
    method: &str,
    ts_ms: u64,
    nonce: &str,
    body: &str,
) -> Hmac<Sha256> {
    let mut mac = keyed.clone();
    mac.update(format!("{CONTEXT}\n{principal}\n{method}\n{ts_ms}\n{nonce}\n{body}").as_bytes());
    mac
}

/// The principal field of a credential of `role`, bound to `node` when given.
pub fn principal(role: Role, node: Option<&str>) -> String {
    match node {
        None => role.name().to_owned(),
        Some(n) => format!("{role}@{}", hex(n.as_bytes())),
    }
}

/// The credential of `principal` (see [`principal`]; key state `keyed`) for one call of
/// `method` at `ts_ms` with `nonce`, bound to `body` when given.
pub fn sign(
    keyed: &Hmac<Sha256>,
    principal: &str,
    method: &str,
    body: Option<&[u8]>,
    ts_ms: u64,
    nonce: u128,
) -> String {
    let nonce = format!("{nonce:032x}");
    let body = body.map(|b| hex(&body_digest(b))).unwrap_or_default();
    let tag = mac(keyed, principal, method, ts_ms, &nonce, &body)
        .finalize()
        .into_bytes();
    format!("{VERSION}.{principal}.{ts_ms}.{nonce}.{body}.{}", hex(&tag))
}

/// SHA-256 of a request body, as the credential carries it.
pub fn body_digest(body: &[u8]) -> [u8; 32] {
    Sha256::digest(body).into()
}

pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn is_lower_hex(s: &str) -> bool {
    s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Lower-case hex of any even length into bytes.
pub(super) fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !is_lower_hex(s) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn unhex32(s: &str) -> Option<[u8; 32]> {
    if s.len() != SHA_HEX {
        return None;
    }
    unhex(s)?.try_into().ok()
}

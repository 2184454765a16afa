//! Roles: who may call which method of the master, and each role's key, derived from the
//! pool key. Pure.
//!
//! | role | holds | may call |
//! | --- | --- | --- |
//! | `admin` | the pool key itself (master, operator, `kvpool up`, tests) | every method |
//! | `agent` | node agents | the node calls (segments, heartbeats, tasks, adoption) for its own node, and the object calls (it puts and gets for the engines on its node) |
//! | `engine` | pool clients: engines, the Python package | the object calls only: no membership call, no `RemoveAll` |
//! | `conductor` | the HTTP-facing conductor | `Exists`, `LongestPrefix` (read-only lookups), `ShareLoad` (its replicas' bookings), `ReplicateHot` (more copies of hot blocks) |
//! | `observer` | status readers | `Stats` |
//!
//! A role's master key is HMAC-SHA256(pool key, `kvpool-role-v1\n<role>`); `admin` signs with
//! the pool key. An agent's credential is bound to its node: its key is HMAC-SHA256(pool key,
//! `kvpool-node-v1\nagent\n<node>`), which only a holder of the pool key can make, and the
//! master lets it make node calls for that node only. A node-less agent credential (the role
//! key) makes node calls only where the master allows shared agent credentials.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Context of a role key's derivation.
const ROLE_CONTEXT: &str = "kvpool-role-v1";
/// Context of a node-bound agent key's derivation.
const NODE_CONTEXT: &str = "kvpool-node-v1";
/// Longest node name a credential may be bound to (a Kubernetes node name is at most 253).
pub const MAX_NODE_LEN: usize = 253;

/// Who a credential speaks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, strum::IntoStaticStr, strum::EnumString)]
#[strum(serialize_all = "snake_case")]
pub enum Role {
    Admin,
    Agent,
    Engine,
    Conductor,
    Observer,
}

/// The master's methods, by their gRPC names (`kvpool.master.v1.Master/<name>`): the groups
/// below, each method named once, so a new method must join a group to exist.
pub const METHODS: [&str; 19] = join(&[
    &SEGMENT_CALLS,
    &["AdoptReplicas"],
    &CLIENT_CALLS,
    &["RemoveAll"],
    &CONDUCTOR_CALLS,
]);

/// The conductors' own calls: their replicas' shared bookings and hot-block replication.
const CONDUCTOR_CALLS: [&str; 2] = ["ShareLoad", "ReplicateHot"];

/// The calls of a pool client that only touch objects.
const CLIENT_CALLS: [&str; 11] = [
    "PutStart",
    "PutEnd",
    "PutRevoke",
    "Get",
    "ReleaseLeases",
    "Exists",
    "LongestPrefix",
    "Remove",
    "Pin",
    "Unpin",
    "Stats",
];

/// The calls of a holder of segments (the memory it lends to the pool); with `AdoptReplicas`,
/// the node calls: each names the node it acts for.
const SEGMENT_CALLS: [&str; 4] = [
    "MountSegment",
    "UnmountSegment",
    "Heartbeat",
    "CompleteTask",
];

/// `groups` one after another; compilation fails unless they hold exactly `N` names.
const fn join<const N: usize>(groups: &[&[&'static str]]) -> [&'static str; N] {
    let mut out = [""; N];
    let mut filled = 0;
    let mut g = 0;
    while g < groups.len() {
        let mut i = 0;
        while i < groups[g].len() {
            out[filled] = groups[g][i];
            filled += 1;
            i += 1;
        }
        g += 1;
    }
    assert!(filled == N, "the method groups do not fill METHODS");
    out
}

impl Role {
    /// Every role.
    pub const ALL: [Role; 5] = [
        Role::Admin,
        Role::Agent,
        Role::Engine,
        Role::Conductor,
        Role::Observer,
    ];

    /// The role's name as credentials and files spell it (`engine`).
    pub fn name(self) -> &'static str {
        self.into()
    }

    /// The role of a name, if it is one.
    pub fn from_name(name: &str) -> Option<Role> {
        name.parse().ok()
    }

    /// Whether the role may call the master's `method` (its gRPC name).
    pub fn allows(self, method: &str) -> bool {
        let client = CLIENT_CALLS.contains(&method);
        let segments = SEGMENT_CALLS.contains(&method);
        match self {
            Role::Admin => METHODS.contains(&method),
            Role::Agent => client || segments || method == "AdoptReplicas",
            Role::Engine => client,
            Role::Conductor => {
                matches!(method, "Exists" | "LongestPrefix") || CONDUCTOR_CALLS.contains(&method)
            }
            Role::Observer => method == "Stats",
        }
    }

    /// Whether `method` acts for a node (names the node in its request): the segment calls and
    /// `AdoptReplicas`. The master lets a node-bound credential make them for its node only.
    pub fn is_node_call(method: &str) -> bool {
        SEGMENT_CALLS.contains(&method) || method == "AdoptReplicas"
    }

    /// Whether the role's holders move KV bytes, so its credential file carries the transfer
    /// plane's key (the conductor and observers do not).
    pub fn holds_transfer_key(self) -> bool {
        matches!(self, Role::Admin | Role::Agent | Role::Engine)
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether `node` can be bound into a credential: 1 to [`MAX_NODE_LEN`] bytes, no control
/// characters.
pub fn valid_node(node: &str) -> bool {
    !node.is_empty() && node.len() <= MAX_NODE_LEN && !node.chars().any(char::is_control)
}

/// The master key of the agent on `node` under the pool key `pool`.
pub fn node_key(pool: &[u8], node: &str) -> Vec<u8> {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(pool)
        .unwrap_or_else(|_| <Hmac<Sha256> as KeyInit>::new(&Default::default()));
    mac.update(format!("{NODE_CONTEXT}\n{}\n{node}", Role::Agent).as_bytes());
    mac.finalize().into_bytes().to_vec()
}

/// The master key of `role` under the pool key `pool`; `admin`'s is the pool key itself.
pub fn role_key(pool: &[u8], role: Role) -> Vec<u8> {
    if role == Role::Admin {
        return pool.to_vec();
    }
    // HMAC takes keys of any length; the error branch cannot happen.
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(pool)
        .unwrap_or_else(|_| <Hmac<Sha256> as KeyInit>::new(&Default::default()));
    mac.update(format!("{ROLE_CONTEXT}\n{role}").as_bytes());
    mac.finalize().into_bytes().to_vec()
}

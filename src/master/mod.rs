//! kvpool master: the pool's metadata (segments, object index, replicas, leases, pins,
//! eviction, repair) and the pieces around it. I/O boundaries: the pure core (`state`,
//! `policy`, `alloc`, `clock`, `types`) does none; `service` and `client` own gRPC sockets,
//! `ha` talks to etcd, `simulate` reads trace files, `cmd` wires the `kvpool master` process.

pub mod alloc;
pub mod auth;
pub mod bench;
pub mod client;
pub mod clock;
pub mod cmd;
pub mod data;
pub mod ha;
pub mod metrics;
pub mod policy;
pub mod proto;
pub mod service;
pub mod simulate;
pub mod state;
pub mod testing;
pub mod types;

pub use clock::{Clock, FakeClock, SystemClock};
pub use policy::PolicyKind;
pub use state::{MasterConfig, MasterError, MasterState, Stats};
pub use types::*;

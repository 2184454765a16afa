//! The master's metadata core: segments, the object index, replicas, leases, pins, eviction
//! and repair as a pure state machine over an injected clock. The gRPC service
//! (`kvpool-master`) and the clients (`kvpool-client`) carry these types; nothing here does I/O
//! except `simulate`, which reads a trace file.

pub mod alloc;
pub mod clock;
pub mod policy;
pub mod simulate;
pub mod state;
pub mod types;

pub use clock::{Clock, FakeClock, SystemClock};
pub use policy::PolicyKind;
pub use state::{MasterConfig, MasterError, MasterState, Stats};
pub use types::*;

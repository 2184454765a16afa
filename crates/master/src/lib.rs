//! kvpool master: the pool's metadata service around the pure state machine of
//! `kvpool_core::master`. I/O boundaries: `service` owns the gRPC listener, `ha` talks to etcd,
//! `metrics` exports the core's counters, `events` publishes the pool's block events (vLLM's
//! KV event format on ZMQ), and `cmd` wires the `kvpool master` process (flags,
//! admin server, shutdown); `conductor_loads` keeps the conductor replicas' shared bookings
//! (pure).

pub mod cmd;
pub mod conductor_loads;
pub mod events;
pub mod ha;
pub mod metrics;
pub mod service;

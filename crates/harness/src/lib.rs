//! kvpool's process harness, shared by the root tests, the benchmarks and `kvpool up`: child
//! processes with their output in log files that die with their owner ([`process`]), readiness
//! probes ([`probe`]) over HTTP requests made with hyper-util ([`http`]), polling a condition ([`poll`]), free loopback ports ([`ports`]),
//! throw-away etcd and Prometheus servers ([`etcd`], [`prometheus`]), the kvpool master and agent
//! as children ([`master`], [`agent`], [`command`]) a reader of `/metrics` text ([`scrape`]) and
//! seeded payloads ([`bytes`]), throw-away TLS certificates for the master ([`tls`]).
//! Errors are one [`HarnessError`] naming the process and its log; nothing here panics.
//! I/O boundary: child processes, sockets, the log and config files.

pub mod agent;
pub mod bytes;
pub mod command;
pub mod error;
pub mod etcd;
pub mod http;
pub mod master;
pub mod poll;
pub mod ports;
pub mod probe;
pub mod process;
pub mod prometheus;
pub mod scrape;
pub mod tls;

pub use agent::{AgentConfig, AgentProcess, AgentSpec, PoolConfig};
pub use command::{kvpool_command, output_json, output_ok};
pub use error::{HarnessError, TestingError};
pub use etcd::EtcdServer;
pub use master::{MasterProcess, MasterSpec, master_args};
pub use ports::{
    ephemeral_range, free_addr, free_port, free_ports, free_ports_below_ephemeral, wait_for_port,
};
pub use probe::Probe;
pub use process::{ChildProcess, Launcher, Stopped};
pub use prometheus::{PrometheusServer, ScrapeTarget};

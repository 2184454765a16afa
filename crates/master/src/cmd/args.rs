//! The flags of `kvpool master` (clap), as given; `super` validates them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use kvpool_core::master::policy::PolicyKind;
use kvpool_core::master::types::Spread;
use kvpool_runtime::listen::{AdminListenArgs, AdminListenDefaults};

/// Flags of `kvpool master`.
#[derive(Debug, Clone, clap::Args)]
pub struct MasterArgs {
    /// gRPC listen address.
    #[arg(long, env = "KVPOOL_MASTER_LISTEN", default_value = "0.0.0.0:50051")]
    pub listen: SocketAddr,
    /// Admin (/livez, /readyz, /metrics) listen address (`KVPOOL_MASTER_ADMIN_ADDR` is the old
    /// spelling of its variable).
    #[command(flatten)]
    pub admin: AdminListenArgs<MasterArgs>,
    /// File holding the pool's shared key (at least 16 bytes).
    #[arg(long, env = "KVPOOL_AUTH_KEY_FILE")]
    pub auth_key_file: PathBuf,
    /// etcd endpoints (comma separated); enables leader election and persisted state.
    #[arg(long, env = "KVPOOL_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// Key prefix of this pool in etcd.
    #[arg(long, env = "KVPOOL_ETCD_PREFIX", default_value = "/kvpool/default")]
    pub etcd_prefix: String,
    /// Address clients use to reach this master (default: --listen).
    #[arg(long, env = "KVPOOL_MASTER_ADVERTISE_ADDR")]
    pub advertise_addr: Option<String>,
    /// TTL of the etcd election lease: a crashed leader is replaced within about this long.
    #[arg(long, default_value = "2s", value_parser = kvpool_core::flags::parse_duration)]
    pub election_ttl: Duration,
    /// An agent silent for this long is declared dead.
    #[arg(long, default_value = "10s", value_parser = kvpool_core::flags::parse_duration)]
    pub heartbeat_timeout: Duration,
    /// Read lease lifetime.
    #[arg(long, default_value = "5s", value_parser = kvpool_core::flags::parse_duration)]
    pub lease_ttl: Duration,
    /// A put not ended within this time is revoked.
    #[arg(long, default_value = "30s", value_parser = kvpool_core::flags::parse_duration)]
    pub put_timeout: Duration,
    /// Repair/demotion tasks not completed within this time are abandoned.
    #[arg(long, default_value = "60s", value_parser = kvpool_core::flags::parse_duration)]
    pub task_timeout: Duration,
    /// Space of an abandoned write (revoked or expired put, failed copy) is given out again
    /// only after this long, so that a late write lands where no one reads; 0s: at once.
    #[arg(long, default_value = "10s", value_parser = kvpool_core::flags::parse_duration)]
    pub reuse_delay: Duration,
    /// Period of the background loop (expiries, deaths, repairs, watermarks, metrics).
    #[arg(long, default_value = "200ms", value_parser = kvpool_core::flags::parse_duration)]
    pub tick_interval: Duration,
    /// Eviction policy (of both tiers).
    #[arg(
        long,
        value_enum,
        default_value = "lru",
        env = "KVPOOL_MASTER_EVICTION_POLICY"
    )]
    pub eviction_policy: PolicyKind,
    /// Fraction of the DRAM tier in use at which eviction starts (0 < high <= 1).
    #[arg(long, default_value_t = 0.95)]
    pub dram_high_watermark: f64,
    /// Fraction of the DRAM tier in use at which eviction stops (0 <= low < high).
    #[arg(long, default_value_t = 0.85)]
    pub dram_low_watermark: f64,
    /// Fraction of the SSD tier in use at which eviction starts (0 < high <= 1).
    #[arg(long, default_value_t = 0.95)]
    pub ssd_high_watermark: f64,
    /// Fraction of the SSD tier in use at which eviction stops (0 <= low < high).
    #[arg(long, default_value_t = 0.85)]
    pub ssd_low_watermark: f64,
    /// How every object's replicas spread at least: `node` (distinct nodes) or
    /// `failure-domain` (distinct values of the failure domain the agents announce; agents
    /// that announce none count as distinct nodes). A put may ask for failure domains itself.
    #[arg(
        long,
        value_enum,
        default_value = "node",
        env = "KVPOOL_MASTER_REPLICA_SPREAD"
    )]
    pub replica_spread: Spread,
    /// Largest replica count a put may ask for.
    #[arg(long, default_value_t = 8)]
    pub max_replicas: u8,
    /// Publish the pool's block events in vLLM's KV event format: vLLM's `--kv-events-config`
    /// JSON (`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
    /// "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "", "buffer_steps":
    /// 10000}`). Off by default; only the leader publishes.
    #[arg(long, env = "KVPOOL_MASTER_KV_EVENTS_CONFIG")]
    pub kv_events_config: Option<String>,
    /// Tokens per block written into every published `BlockStored` (vLLM's default block
    /// size, 16, unless the engines that fill the pool use another).
    #[arg(long, default_value_t = 16)]
    pub kv_events_block_size: u32,
    /// A new connection to the gRPC port must authenticate within this: the fast lane's
    /// preface and first call, or a gRPC connection's first authenticated call.
    #[arg(long, default_value = "10s", value_parser = kvpool_core::flags::parse_duration,
        env = "KVPOOL_MASTER_HANDSHAKE_TIMEOUT")]
    pub handshake_timeout: Duration,
    /// An authenticated connection on which no call started for this long is closed; clients
    /// reconnect on their next call (every master call is a short metadata call; none waits
    /// anywhere near this long).
    #[arg(long, default_value = "5m", value_parser = kvpool_core::flags::parse_duration,
        env = "KVPOOL_MASTER_IDLE_TIMEOUT")]
    pub idle_timeout: Duration,
    /// Connections to the gRPC port served at once (gRPC and fast lane together).
    #[arg(long, default_value_t = 4096, env = "KVPOOL_MASTER_MAX_CONNECTIONS")]
    pub max_connections: usize,
    /// Connections to the gRPC port served at once from one source address.
    #[arg(
        long,
        default_value_t = 512,
        env = "KVPOOL_MASTER_MAX_CONNECTIONS_PER_SOURCE"
    )]
    pub max_connections_per_source: usize,
    /// TLS on the gRPC port (gRPC and the fast lane): the server's certificate chain (PEM,
    /// leaf first). Off when unset; needs --tls-key-file.
    #[arg(long, env = "KVPOOL_MASTER_TLS_CERT_FILE", requires = "tls_key_file")]
    pub tls_cert_file: Option<PathBuf>,
    /// The private key of --tls-cert-file (PEM).
    #[arg(long, env = "KVPOOL_MASTER_TLS_KEY_FILE", requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,
    /// Mutual TLS: clients must present a certificate signed by a CA in this PEM file.
    #[arg(
        long,
        env = "KVPOOL_MASTER_TLS_CLIENT_CA_FILE",
        requires = "tls_cert_file"
    )]
    pub tls_client_ca_file: Option<PathBuf>,
    /// Read the TLS files again this often; changed, new connections use them (open ones are
    /// untouched; unusable files keep the old ones serving). 0s: never.
    #[arg(long, default_value = "60s", value_parser = kvpool_core::flags::parse_duration,
        env = "KVPOOL_MASTER_TLS_RELOAD_INTERVAL")]
    pub tls_reload_interval: Duration,
    /// Let agent credentials that name no node (the agent role's key, one file shared by
    /// every agent) mount, unmount, heartbeat and adopt for any node. Off: each agent must
    /// hold its own node's credential (`kvpool auth derive --role agent --node NODE`), and
    /// may act for that node only (docs/reliability.md, "Credentials").
    #[arg(long, env = "KVPOOL_MASTER_SHARED_AGENT_CREDENTIALS")]
    pub shared_agent_credentials: bool,
}

impl AdminListenDefaults for MasterArgs {
    const ADMIN_LISTEN: &'static str = "0.0.0.0:9090";
    const ADMIN_LISTEN_ENV: &'static str = "KVPOOL_MASTER_ADMIN_LISTEN";
}

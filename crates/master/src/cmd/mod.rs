//! `kvpool master`: the master process. Validates flags into [`ValidatedMasterArgs`], binds
//! the gRPC and admin listeners, runs the tick loop and (with `--etcd-endpoints`) leader
//! election, and shuts down in order on SIGTERM: stop serving gRPC, stop HA (resigning), then
//! close the admin server. I/O boundary: listeners, the key file, signals.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use prometheus::Registry;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

mod args;

use super::events::{self, PoolEventsConfig};
use super::ha::{self, HaConfig, HaError};
use super::metrics::{MasterMetrics, MetricsError};
use super::service::{self, ConnLimits, Core, ReloadCounters, ServerTls, ServiceError};
use kvpool_core::master::clock::SystemClock;
use kvpool_core::master::policy::PolicyKind;
use kvpool_core::master::state::{MasterConfig, MasterState, POOL_EVENTS_CAP};
use kvpool_core::master::types::{Spread, Watermarks};
use kvpool_proto::auth::{AuthError, AuthKey, Verifier};
use kvpool_runtime::admin::{self, AdminError, Readiness};
use kvpool_runtime::kv_events::KvEventsConfig;
use kvpool_runtime::listen::AdminListenArgs;

/// Errors of the master process.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum CmdError {
    #[error("invalid --{field}: {reason}")]
    Config { field: &'static str, reason: String },
    #[error("cannot load the pool auth key")]
    Auth(#[source] AuthError),
    #[error("cannot bind gRPC listener on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid TLS set-up of the gRPC port")]
    Tls(#[source] service::TlsError),
    #[error("admin server failed")]
    Admin(#[source] AdminError),
    #[error("metrics set-up failed")]
    Metrics(#[source] MetricsError),
    #[error("gRPC service failed")]
    Serve(#[source] ServiceError),
    #[error("leader election failed")]
    Ha(#[source] HaError),
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
    #[error("KV event publisher")]
    KvEvents(#[source] kvpool_runtime::kv_events::KvEventsError),
    #[error("a master task panicked or was cancelled")]
    Join(#[source] tokio::task::JoinError),
}

kvpool_runtime::error_category!(CmdError);

pub use args::MasterArgs;

/// Flags checked once at start-up.
#[derive(Debug, Clone)]
pub struct ValidatedMasterArgs {
    pub listen: SocketAddr,
    pub admin_addr: SocketAddr,
    pub key: AuthKey,
    pub ha: Option<HaConfig>,
    pub core: MasterConfig,
    pub tick_interval: Duration,
    /// Where the pool's block events go, when published.
    pub events: Option<PoolEventsConfig>,
    /// Connection limits of the gRPC port.
    pub conn_limits: ConnLimits,
    /// TLS on the gRPC port, when on.
    pub tls: Option<ServerTls>,
    /// Whether node-less agent credentials may make node calls.
    pub shared_agent_credentials: bool,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn watermarks(high: f64, low: f64, field: &'static str) -> Result<Watermarks, CmdError> {
    // Low 0 is allowed: a tier above its high watermark is then emptied of every object that
    // may go (the KVCachePool admits lowWatermarkPercent 0).
    if !(low >= 0.0 && low < high && high <= 1.0) {
        return Err(CmdError::Config {
            field,
            reason: format!("need 0 <= low < high <= 1, got low {low}, high {high}"),
        });
    }
    Ok(Watermarks { high, low })
}

impl MasterArgs {
    pub fn validate(&self) -> Result<ValidatedMasterArgs, CmdError> {
        let nonzero = |d: Duration, field: &'static str| {
            if d.is_zero() {
                Err(CmdError::Config {
                    field,
                    reason: "must be > 0".into(),
                })
            } else {
                Ok(ms(d))
            }
        };
        let core = MasterConfig {
            heartbeat_timeout_ms: nonzero(self.heartbeat_timeout, "heartbeat-timeout")?,
            put_timeout_ms: nonzero(self.put_timeout, "put-timeout")?,
            lease_ttl_ms: nonzero(self.lease_ttl, "lease-ttl")?,
            task_timeout_ms: nonzero(self.task_timeout, "task-timeout")?,
            policy: self.eviction_policy,
            watermarks: [
                watermarks(
                    self.dram_high_watermark,
                    self.dram_low_watermark,
                    "dram-low-watermark",
                )?,
                watermarks(
                    self.ssd_high_watermark,
                    self.ssd_low_watermark,
                    "ssd-low-watermark",
                )?,
            ],
            max_replicas: if self.max_replicas == 0 {
                return Err(CmdError::Config {
                    field: "max-replicas",
                    reason: "must be >= 1".into(),
                });
            } else {
                self.max_replicas
            },
            spread: self.replica_spread,
            reuse_delay_ms: ms(self.reuse_delay),
            ..MasterConfig::default()
        };
        nonzero(self.tick_interval, "tick-interval")?;
        let key = AuthKey::from_file(&self.auth_key_file).map_err(CmdError::Auth)?;
        // The master checks every role's credentials: it needs the pool key itself.
        Verifier::new(&key).map_err(CmdError::Auth)?;
        let ha = if self.etcd_endpoints.is_empty() {
            None
        } else {
            let secs = self.election_ttl.as_secs();
            if !(1..=60).contains(&secs) {
                return Err(CmdError::Config {
                    field: "election-ttl",
                    reason: "must be between 1s and 60s".into(),
                });
            }
            if !self.etcd_prefix.starts_with('/') || self.etcd_prefix.ends_with('/') {
                return Err(CmdError::Config {
                    field: "etcd-prefix",
                    reason: "must start with '/' and not end with '/'".into(),
                });
            }
            if self.advertise_addr.is_none() && self.listen.ip().is_unspecified() {
                return Err(CmdError::Config {
                    field: "advertise-addr",
                    reason: format!(
                        "needed with --etcd-endpoints when --listen is a wildcard ({}): \
                         standbys send clients to this address",
                        self.listen
                    ),
                });
            }
            Some(HaConfig {
                endpoints: self.etcd_endpoints.clone(),
                prefix: self.etcd_prefix.clone(),
                advertise: self
                    .advertise_addr
                    .clone()
                    .unwrap_or_else(|| self.listen.to_string()),
                election_ttl_secs: i64::try_from(secs).unwrap_or(2),
            })
        };
        let events = match &self.kv_events_config {
            Some(json) => KvEventsConfig::parse(json)
                .map_err(|e| CmdError::Config {
                    field: "kv-events-config",
                    reason: e.to_string(),
                })?
                .map(|kv| PoolEventsConfig {
                    kv,
                    block_size: self.kv_events_block_size,
                }),
            None => None,
        };
        if self.kv_events_block_size == 0 {
            return Err(CmdError::Config {
                field: "kv-events-block-size",
                reason: "must be >= 1".into(),
            });
        }
        nonzero(self.handshake_timeout, "handshake-timeout")?;
        nonzero(self.idle_timeout, "idle-timeout")?;
        for (n, field) in [
            (self.max_connections, "max-connections"),
            (
                self.max_connections_per_source,
                "max-connections-per-source",
            ),
        ] {
            if n == 0 {
                return Err(CmdError::Config {
                    field,
                    reason: "must be >= 1".into(),
                });
            }
        }
        let (cert, key_pem) = (self.tls_cert_file.clone(), self.tls_key_file.clone());
        let (ca, every) = (self.tls_client_ca_file.clone(), self.tls_reload_interval);
        let tls = ServerTls::from_flags(cert, key_pem, ca, every).map_err(CmdError::Tls)?;
        Ok(ValidatedMasterArgs {
            listen: self.listen,
            admin_addr: self.admin.admin_addr,
            key,
            ha,
            core,
            tick_interval: self.tick_interval,
            events,
            conn_limits: ConnLimits {
                handshake_timeout: self.handshake_timeout,
                idle_timeout: self.idle_timeout,
                max_connections: self.max_connections,
                max_connections_per_source: self.max_connections_per_source,
            },
            tls,
            shared_agent_credentials: self.shared_agent_credentials,
        })
    }
}

/// A running master (in-process handle, used by `run` and by tests).
#[derive(Debug)]
pub struct RunningMaster {
    pub grpc_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub core: Arc<Core>,
    pub readiness: Readiness,
    task: JoinHandle<Result<(), CmdError>>,
}

impl RunningMaster {
    /// Wait for the master to stop (after `shutdown` was cancelled, or on a fatal error).
    pub async fn join(self) -> Result<(), CmdError> {
        self.task.await.map_err(CmdError::Join)?
    }

    /// Stop the master's tasks abruptly (tests simulating a crash: no resign, no drain).
    pub fn abort(&self) {
        self.task.abort();
    }
}

/// Bind the listeners and start every task of a master; returns once it is serving. Boxed
/// and out of line so that the master's futures are compiled here only, not again in each
/// crate that starts a master in-process (the benches, the tests): docs/adr/0003-crates-by-layer.md,
/// "Futures across crates".
#[inline(never)]
pub fn start(
    args: ValidatedMasterArgs,
    shutdown: CancellationToken,
) -> BoxFuture<'static, Result<RunningMaster, CmdError>> {
    Box::pin(start_serving(args, shutdown))
}

async fn start_serving(
    args: ValidatedMasterArgs,
    shutdown: CancellationToken,
) -> Result<RunningMaster, CmdError> {
    let registry = Registry::new();
    let metrics =
        MasterMetrics::new(&registry, args.core.policy.as_str()).map_err(CmdError::Metrics)?;
    let state = MasterState::new(args.core.clone(), Arc::new(SystemClock::new()));
    let core = if args.ha.is_some() {
        Core::new(state, metrics)
    } else {
        Core::standalone(state, metrics)
    };
    let readiness = Readiness::new();
    let admin_listener = admin::bind(args.admin_addr)
        .await
        .map_err(CmdError::Admin)?;
    let admin_addr = admin_listener
        .local_addr()
        .map_err(|source| CmdError::Bind {
            addr: args.admin_addr,
            source,
        })?;
    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|source| CmdError::Bind {
            addr: args.listen,
            source,
        })?;
    let grpc_addr = listener.local_addr().map_err(|source| CmdError::Bind {
        addr: args.listen,
        source,
    })?;
    tracing::info!(
        grpc = %grpc_addr,
        admin = %admin_addr,
        policy = args.core.policy.as_str(),
        heartbeat_timeout_ms = args.core.heartbeat_timeout_ms,
        lease_ttl_ms = args.core.lease_ttl_ms,
        put_timeout_ms = args.core.put_timeout_ms,
        watermarks = ?args.core.watermarks,
        replica_spread = ?args.core.spread,
        ha = args.ha.is_some(),
        tls = args.tls.is_some(),
        mutual_tls = args.tls.as_ref().is_some_and(|t| t.mutual),
        "master starting"
    );

    if let Some(tls) = args.tls.clone() {
        let reloads = ReloadCounters::register(&registry).map_err(MetricsError::Register);
        let reloads = reloads.map_err(CmdError::Metrics)?;
        tokio::spawn(service::watch_tls(tls, reloads, shutdown.clone()));
    }
    let admin_shutdown = CancellationToken::new();
    let admin_task = tokio::spawn(admin::serve(
        admin_listener,
        admin::router(registry, readiness.clone()),
        admin_shutdown.clone(),
    ));
    let ticker = {
        let core = core.clone();
        let stop = shutdown.clone();
        let every = args.tick_interval;
        tokio::spawn(async move {
            let mut interval = tokio::time::interval(every);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = interval.tick() => core.tick().await,
                }
            }
        })
    };
    if let Some(cfg) = args.events.clone() {
        events::start(core.clone(), cfg, POOL_EVENTS_CAP, shutdown.clone())
            .await
            .map_err(CmdError::KvEvents)?;
    }
    let ha_stop = CancellationToken::new();
    let ha_task = match args.ha.clone() {
        Some(cfg) => Some(tokio::spawn(ha::run(
            core.clone(),
            cfg,
            readiness.clone(),
            ha_stop.clone(),
        ))),
        None => {
            readiness.set_ready(true);
            None
        }
    };
    let grpc_stop = shutdown.clone();
    let verifier = Verifier::new(&args.key)
        .map_err(CmdError::Auth)?
        .allow_shared_agents(args.shared_agent_credentials);
    let conn_limits = args.conn_limits;
    let tls = args.tls.clone();
    let serve_core = core.clone();
    let ready = readiness.clone();
    let task = tokio::spawn(async move {
        // A leadership loss ends the process (it restarts as a standby with a fresh state).
        let served = match ha_task {
            Some(mut ha_task) => {
                tokio::select! {
                    r = service::serve(listener, serve_core, verifier, conn_limits, tls, grpc_stop.clone()) => {
                        ha_stop.cancel();
                        let ha_result = ha_task.await;
                        r.map_err(CmdError::Serve).and(
                            ha_result.map_err(CmdError::Join)?.map_err(CmdError::Ha),
                        )
                    }
                    r = &mut ha_task => {
                        grpc_stop.cancel();
                        r.map_err(CmdError::Join)?.map_err(CmdError::Ha)
                    }
                }
            }
            None => service::serve(listener, serve_core, verifier, conn_limits, tls, grpc_stop)
                .await
                .map_err(CmdError::Serve),
        };
        ready.set_ready(false);
        let _ = ticker.await;
        admin_shutdown.cancel();
        let admin = admin_task.await.map_err(CmdError::Join)?;
        served?;
        admin.map_err(CmdError::Admin)
    });
    Ok(RunningMaster {
        grpc_addr,
        admin_addr,
        core,
        readiness,
        task,
    })
}

/// Entry point of `kvpool master`.
/// [`run`] on `runtime`: what `kvpool master` calls (synchronous, so that the master's futures
/// are compiled in this crate only).
pub fn run_blocking(runtime: &tokio::runtime::Runtime, args: MasterArgs) -> Result<(), CmdError> {
    runtime.block_on(run(args))
}

pub async fn run(args: MasterArgs) -> Result<(), CmdError> {
    let validated = args.validate()?;
    let shutdown = CancellationToken::new();
    kvpool_runtime::shutdown::cancel_on_signal(shutdown.clone()).map_err(CmdError::Signals)?;
    let running = start(validated, shutdown).await?;
    let result = running.join().await;
    tracing::info!("master stopped");
    result
}

/// Flags of a master for tests on 127.0.0.1: ephemeral gRPC and admin ports, in-memory state (no
/// etcd), agents that never heartbeat stay alive (600 s), leases, puts and tasks last a minute,
/// ticks every 50 ms, LRU with watermarks 95% / 85%, at most 4 replicas. Change fields with
/// struct update syntax where a test needs other values.
pub fn loopback_args(auth_key_file: std::path::PathBuf) -> MasterArgs {
    MasterArgs {
        listen: ([127, 0, 0, 1], 0).into(),
        admin: AdminListenArgs::new(([127, 0, 0, 1], 0).into()),
        auth_key_file,
        etcd_endpoints: vec![],
        etcd_prefix: "/kvpool/test".into(),
        advertise_addr: None,
        election_ttl: Duration::from_secs(2),
        heartbeat_timeout: Duration::from_secs(600),
        lease_ttl: Duration::from_secs(60),
        put_timeout: Duration::from_secs(60),
        task_timeout: Duration::from_secs(60),
        reuse_delay: Duration::from_secs(10),
        tick_interval: Duration::from_millis(50),
        eviction_policy: PolicyKind::Lru,
        dram_high_watermark: 0.95,
        dram_low_watermark: 0.85,
        ssd_high_watermark: 0.95,
        ssd_low_watermark: 0.85,
        replica_spread: Spread::Node,
        max_replicas: 4,
        kv_events_config: None,
        kv_events_block_size: 16,
        handshake_timeout: ConnLimits::default().handshake_timeout,
        idle_timeout: ConnLimits::default().idle_timeout,
        max_connections: ConnLimits::default().max_connections,
        max_connections_per_source: ConnLimits::default().max_connections_per_source,
        tls_cert_file: None,
        tls_key_file: None,
        tls_client_ca_file: None,
        tls_reload_interval: Duration::from_secs(60),
        shared_agent_credentials: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Wrapper {
        #[command(flatten)]
        args: MasterArgs,
    }

    fn parse(extra: &[&str], key_file: &std::path::Path) -> MasterArgs {
        let mut argv = vec!["master", "--auth-key-file", key_file.to_str().unwrap_or("")];
        argv.extend_from_slice(extra);
        Wrapper::try_parse_from(argv).expect("parse").args
    }

    #[test]
    fn flags_are_validated_with_the_field_named() {
        let dir = tempfile::tempdir().expect("tmp");
        let key = dir.path().join("key");
        std::fs::write(&key, "0123456789abcdef0123").expect("key");
        let ok = parse(&[], &key).validate().expect("defaults are valid");
        assert!(ok.ha.is_none());
        assert_eq!(ok.core.heartbeat_timeout_ms, 10_000);
        let field = |extra: &[&str]| match parse(extra, &key).validate() {
            Err(CmdError::Config { field, .. }) => field,
            other => panic!("{extra:?}: {other:?}"),
        };
        assert_eq!(
            field(&["--dram-high-watermark", "0.5"]),
            "dram-low-watermark"
        );
        assert_eq!(field(&["--ssd-low-watermark", "0.96"]), "ssd-low-watermark");
        assert_eq!(
            field(&["--dram-high-watermark", "1.01"]),
            "dram-low-watermark"
        );
        // What a KVCachePool may say: low 0, high 100%, any policy, spread over domains.
        let pool = parse(
            &[
                "--dram-low-watermark",
                "0",
                "--dram-high-watermark",
                "1",
                "--eviction-policy",
                "lfu",
                "--replica-spread",
                "failure-domain",
            ],
            &key,
        )
        .validate()
        .expect("valid");
        assert_eq!(
            pool.core.watermarks[0],
            Watermarks {
                high: 1.0,
                low: 0.0
            }
        );
        assert_eq!(pool.core.policy, PolicyKind::Lfu);
        assert_eq!(pool.core.spread, Spread::FailureDomain);
        assert_eq!(ok.core.spread, Spread::Node);
        assert_eq!(field(&["--heartbeat-timeout", "0s"]), "heartbeat-timeout");
        assert_eq!(field(&["--max-replicas", "0"]), "max-replicas");
        assert!(ok.events.is_none(), "off by default");
        assert_eq!(
            field(&[
                "--kv-events-config",
                r#"{"enable_kv_cache_events": true, "publisher": "x"}"#
            ]),
            "kv-events-config"
        );
        assert_eq!(
            field(&["--kv-events-block-size", "0"]),
            "kv-events-block-size"
        );
        let on = parse(
            &[
                "--kv-events-config",
                r#"{"enable_kv_cache_events": true, "endpoint": "tcp://*:7001"}"#,
                "--kv-events-block-size",
                "32",
            ],
            &key,
        )
        .validate()
        .expect("valid")
        .events
        .expect("enabled");
        assert_eq!(
            (on.kv.endpoint.as_str(), on.block_size),
            ("tcp://*:7001", 32)
        );
        assert_eq!(
            field(&["--etcd-endpoints", "http://e:2379"]),
            "advertise-addr"
        );
        assert_eq!(
            field(&[
                "--etcd-endpoints",
                "http://e:2379",
                "--advertise-addr",
                "m:1",
                "--etcd-prefix",
                "x"
            ]),
            "etcd-prefix"
        );
        let ha = parse(
            &[
                "--etcd-endpoints",
                "http://e:2379",
                "--advertise-addr",
                "m:1",
            ],
            &key,
        )
        .validate()
        .expect("valid");
        assert_eq!(ha.ha.map(|h| h.advertise), Some("m:1".to_owned()));
        std::fs::write(&key, "short").expect("key");
        assert!(matches!(
            parse(&[], &key).validate(),
            Err(CmdError::Auth(_))
        ));
    }
}

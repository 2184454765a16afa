//! The controllers' shared state, the only dependency injection: the kube client, the Event
//! recorder, metrics, the operator settings, the root key pool keys are derived from, a clock, the readers of the masters' usage and the
//! conductors' load, each autoscaled pool's decision state, and per-object failure counts for
//! exponential backoff. [`Context::for_tests`] is its test twin (fixed clock, fresh registry).
//! I/O boundary: the client and recorder it carries; the type itself does no I/O.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::runtime::events::{Recorder, Reporter};

use kvpool_core::autoscale::Autoscaler;

use crate::conductor_load::{ConductorLoad, HttpConductorLoad, ScriptedLoad};
use crate::labels::FIELD_MANAGER;
use crate::metrics::Metrics;
use crate::pool_usage::{FixedStats, GrpcMasterStats, MasterStats};
use crate::root_key::RootKey;

/// Settings that apply to every pool: the field manager of every write, default images.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    pub field_manager: String,
    pub agent_image: String,
    pub master_image: String,
    pub conductor_image: String,
    /// The namespace the operator runs in (`POD_NAMESPACE`): the pools' NetworkPolicies admit
    /// the operator's pods from there only. None: from any namespace.
    pub operator_namespace: Option<String>,
    /// Where the agents get their node's credential (`--agent-issuer-url`). None: the agents
    /// share one credential file and the masters run with `--shared-agent-credentials`.
    pub agent_issuer: Option<crate::issuer::AgentIssuer>,
}

impl Settings {
    /// Images tagged `test`, for unit tests and fixtures.
    pub fn for_tests() -> Self {
        Self {
            field_manager: FIELD_MANAGER.to_owned(),
            agent_image: "ghcr.io/kvpool/kvpool-agent:test".to_owned(),
            master_image: "ghcr.io/kvpool/kvpool:test".to_owned(),
            conductor_image: "ghcr.io/kvpool/kvpool:test".to_owned(),
            operator_namespace: None,
            agent_issuer: None,
        }
    }
}

/// Smallest retry delay after a transient failure.
pub const BACKOFF_MIN: Duration = Duration::from_secs(5);
/// Largest retry delay after repeated transient failures.
pub const BACKOFF_MAX: Duration = Duration::from_secs(300);
/// Periodic resync of a healthy object (picks up child status and drift).
pub const RESYNC: Duration = Duration::from_secs(300);
/// Refresh of a healthy pool's usage figures (read from its master).
pub const USAGE_REFRESH: Duration = Duration::from_secs(60);
/// Period of an autoscaled engine pool's pass: how often the conductor's load is read.
pub const AUTOSCALE_PERIOD: Duration = Duration::from_secs(15);
/// Requeue while children roll out, so status follows without a watch on every pod.
pub const PROGRESS_REQUEUE: Duration = Duration::from_secs(30);

/// State shared by the reconcilers of all three kinds (its `Debug` shows the settings only).
#[derive(derive_more::Debug)]
pub struct Context {
    #[debug(skip)]
    pub client: Client,
    #[debug(skip)]
    pub recorder: Recorder,
    #[debug(skip)]
    pub metrics: Metrics,
    pub settings: Settings,
    /// The secret every pool's key is derived from (`--root-key-file`; a fixed test key in
    /// the test twin).
    #[debug(skip)]
    pub root_key: RootKey,
    /// Reads each pool's tier usage from its master (a fake in tests).
    #[debug(skip)]
    pub master_stats: Arc<dyn MasterStats>,
    /// Address used for every pool's master instead of its Service DNS name (tests point it at
    /// 127.0.0.1; `None` in a cluster).
    #[debug(skip)]
    pub master_addr_override: Option<String>,
    /// Reads each pool's load from its conductor (a script in tests).
    #[debug(skip)]
    pub conductor_load: Arc<dyn ConductorLoad>,
    /// Address used for every pool's conductor instead of its Service DNS name (tests).
    #[debug(skip)]
    pub conductor_addr_override: Option<String>,
    /// The autoscaling decision state of each autoscaled engine pool, by `kind/ns/name`.
    #[debug(skip)]
    pub autoscalers: Mutex<HashMap<String, Autoscaler>>,
    #[debug(skip)]
    clock: Clock,
    #[debug(skip)]
    failures: Mutex<HashMap<String, u32>>,
}

/// Where the context reads the time.
pub type Clock = Arc<dyn Fn() -> Timestamp + Send + Sync>;

impl Context {
    /// Context of the running operator. `instance` names this replica in Events.
    pub fn new(
        client: Client,
        metrics: Metrics,
        settings: Settings,
        root_key: RootKey,
        instance: Option<String>,
    ) -> Self {
        let reporter = Reporter {
            controller: settings.field_manager.clone(),
            instance,
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            metrics,
            settings,
            root_key,
            master_stats: Arc::new(GrpcMasterStats::default()),
            master_addr_override: None,
            conductor_load: Arc::new(HttpConductorLoad::default()),
            conductor_addr_override: None,
            autoscalers: Mutex::new(HashMap::new()),
            clock: Arc::new(Timestamp::now),
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Test twin: a fixed clock ([`Context::TEST_TIME`]), a fresh registry, test images, the
    /// root key [`crate::root_key::TEST_ROOT_KEY`], a
    /// master that never answers ([`FixedStats`] without figures) and a conductor that never
    /// answers (an empty [`ScriptedLoad`]) unless a test sets them.
    pub fn for_tests(client: Client) -> Self {
        let registry = prometheus::Registry::new();
        // A fresh registry cannot hold these names already.
        #[allow(clippy::expect_used)]
        let metrics = Metrics::register(&registry).expect("fresh registry");
        let mut ctx = Self::new(
            client,
            metrics,
            Settings::for_tests(),
            RootKey::for_tests(),
            Some("kvpool-operator-test".to_owned()),
        );
        ctx.clock = Arc::new(test_clock);
        ctx.master_stats = Arc::new(FixedStats(None));
        ctx.conductor_load = Arc::new(ScriptedLoad::default());
        ctx
    }

    /// Seconds since the epoch of the test clock: 2026-01-01T00:00:00Z.
    pub const TEST_TIME: i64 = 1_767_225_600;

    /// Replace the master usage reader (tests).
    pub fn with_master_stats(mut self, stats: Arc<dyn MasterStats>) -> Self {
        self.master_stats = stats;
        self
    }

    /// Replace the conductor load reader (tests).
    pub fn with_conductor_load(mut self, load: Arc<dyn ConductorLoad>) -> Self {
        self.conductor_load = load;
        self
    }

    /// Replace the clock (tests that let time pass).
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Where to reach the conductor of a pool whose Service address is `service_addr`.
    pub fn conductor_addr(&self, service_addr: String) -> String {
        self.conductor_addr_override.clone().unwrap_or(service_addr)
    }

    /// Where to reach the master of a pool whose Service address is `service_addr`.
    pub fn master_addr(&self, service_addr: String) -> String {
        self.master_addr_override.clone().unwrap_or(service_addr)
    }

    /// The current time (fixed in tests).
    pub fn now(&self) -> Timestamp {
        (self.clock)()
    }

    /// Record a transient failure of `key` and return how long to wait before the retry:
    /// 5 s doubling per consecutive failure, at most 5 min.
    pub fn backoff(&self, key: &str) -> Duration {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        let count = failures.entry(key.to_owned()).or_insert(0);
        let delay = backoff_delay(*count);
        *count = count.saturating_add(1);
        delay
    }

    /// Forget the failures of `key` after a successful reconcile.
    pub fn reset_backoff(&self, key: &str) {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        failures.remove(key);
    }
}

fn test_clock() -> Timestamp {
    Timestamp::from_second(Context::TEST_TIME).unwrap_or(Timestamp::UNIX_EPOCH)
}

/// Delay after `failures` consecutive earlier failures.
pub fn backoff_delay(failures: u32) -> Duration {
    let factor = 1u32.checked_shl(failures.min(16)).unwrap_or(u32::MAX);
    BACKOFF_MIN.saturating_mul(factor).min(BACKOFF_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        assert_eq!(backoff_delay(0), Duration::from_secs(5));
        assert_eq!(backoff_delay(1), Duration::from_secs(10));
        assert_eq!(backoff_delay(3), Duration::from_secs(40));
        assert_eq!(backoff_delay(6), BACKOFF_MAX);
        assert_eq!(backoff_delay(u32::MAX), BACKOFF_MAX);
    }
}

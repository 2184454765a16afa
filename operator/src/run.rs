//! `kvpool operator run`: wires the three controllers, the admin server, leader election and
//! shutdown together. I/O boundary: the kube client (watches), the Lease, the admin listener and
//! the signal handlers; the controllers' logic lives in [`crate::cachepool`] and
//! [`crate::enginepool`].
//!
//! Shutdown order on SIGTERM: stop the controllers (in-flight reconciles finish), release the
//! Lease, then stop the admin server last so probes answer until the end.

use kvpool_runtime::telemetry::chain;
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use kube::api::Api;
use kube::runtime::controller::{self, Controller};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, predicates, watcher};
use kube::{Client, Resource};
use kube_lease_manager::{LeaseManagerBuilder, LeaseManagerError};
use kvpool_crd::{DecodePool, KVCachePool, PrefillPool};
use kvpool_runtime::admin::{self, AdminError, Readiness};
use prometheus::Registry;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::cachepool;
use crate::cli::RunArgs;
use crate::context::{Context, Settings};
use crate::enginepool::{self, EnginePool};
use crate::issuer::{self, AgentIssuer, IssuerCa, IssuerState};
use crate::labels::managed_selector;
use crate::metrics::Metrics;
use crate::pool_usage::GrpcMasterStats;
use crate::root_key::RootKey;

/// Lease duration and renewal grace of leader election, seconds.
const LEASE_DURATION_S: u64 = 15;
const LEASE_GRACE_S: u64 = 5;
/// How long the controllers get to finish after a shutdown or a lost lease before they are
/// dropped (reconciles are idempotent server-side applies; the next leader redoes them). Keeps
/// the exit, and the lease release after it, inside a pod's default 30 s termination grace.
const CONTROLLERS_GRACE: Duration = Duration::from_secs(10);

/// Failures that stop the operator.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum RunError {
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
    #[error("cannot register metrics")]
    Metrics(#[source] prometheus::Error),
    #[error("admin server")]
    Admin(#[source] AdminError),
    #[error("operator root key")]
    RootKey(#[source] crate::root_key::RootKeyError),
    #[error("the operator's root key Secret")]
    RootKeySecret(#[source] crate::root_key_secret::RootKeySecretError),
    #[error("--root-key-secret needs the operator's namespace (POD_NAMESPACE)")]
    RootKeyNamespace,
    #[error("no root key: pass --root-key-file or --root-key-secret")]
    NoRootKey,
    #[error("cannot build a Kubernetes client (in-cluster config or KUBECONFIG)")]
    Client(#[source] kube::Error),
    #[error("the agent credential issuer")]
    Issuer(#[source] issuer::IssuerError),
    #[error("--agent-issuer-url: {0}")]
    IssuerUrl(String),
    #[error("leader election")]
    Leader(#[source] LeaseManagerError),
    #[error("lost the leader lease; exiting so that another replica takes over")]
    LeadershipLost,
}

kvpool_runtime::error_category!(RunError);

fn api<K>(client: &Client, namespace: &str) -> Api<K>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
{
    if namespace.is_empty() {
        Api::all(client.clone())
    } else {
        Api::namespaced(client.clone(), namespace)
    }
}

/// [`run`] on `runtime`: what `kvpool operator run` calls. Synchronous so that the
/// controllers' futures are compiled once, in this crate, rather than again in every crate
/// that would poll them (see docs/adr/0003-crates-by-layer.md).
pub fn run_blocking(runtime: &tokio::runtime::Runtime, args: RunArgs) -> Result<(), RunError> {
    runtime.block_on(run(args))
}

/// Run until SIGTERM/SIGINT (Ok) or a fatal error.
pub async fn run(args: RunArgs) -> Result<(), RunError> {
    // Before anything listens: without its root key the operator can reconcile no pool.
    let (root_key, client) = load_root_key(&args).await?;
    let shutdown = CancellationToken::new();
    kvpool_runtime::shutdown::cancel_on_signal(shutdown.clone()).map_err(RunError::Signals)?;

    let registry = Registry::new();
    let metrics = Metrics::register(&registry).map_err(RunError::Metrics)?;
    let readiness = Readiness::new();
    let listener = admin::bind(args.admin_addr)
        .await
        .map_err(RunError::Admin)?;
    if let Ok(bound) = listener.local_addr() {
        info!(addr = %bound, "admin server listening");
    }
    let admin_stop = CancellationToken::new();
    let admin_task = tokio::spawn(admin::serve(
        listener,
        admin::router(registry, readiness.clone()),
        admin_stop.clone(),
    ));
    info!(admin_addr = %args.admin_addr, namespace = %args.namespace, leader_elect = args.leader_elect,
        agent_image = %args.agent_image, master_image = %args.master_image,
        conductor_image = %args.conductor_image,
        root_key = %args.root_key_file.as_ref().map_or_else(
            || format!("secret {}", args.root_key_secret.as_deref().unwrap_or_default()),
            |f| f.display().to_string()),
        "kvpool-operator starting");

    // Whatever the API server does (unreachable, answering slowly, holding connections open),
    // the operator exits within --shutdown-timeout of the signal: what is still waiting on it
    // is dropped. Reconciles are idempotent and an unreleased lease expires by itself.
    let work = run_with_admin(
        &args,
        root_key,
        client,
        shutdown.clone(),
        metrics,
        readiness,
    );
    let deadline = async {
        shutdown.cancelled().await;
        tokio::time::sleep(args.shutdown_timeout).await;
    };
    let result = tokio::select! {
        r = work => r,
        () = deadline => {
            warn!(
                timeout = %humantime::format_duration(args.shutdown_timeout),
                "the operator did not stop within the shutdown timeout (API server unreachable?); exiting anyway"
            );
            Ok(())
        }
    };

    admin_stop.cancel();
    match admin_task.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => warn!(error = %chain(&e), "admin server stopped with an error"),
        Err(e) => warn!(error = %chain(&e), "admin server task failed"),
    }
    result
}

/// Start the agent credential issuer when `--agent-issuer-url` is set; what the pools' agents
/// need to reach it.
async fn start_issuer(
    args: &RunArgs,
    client: &Client,
    root_key: &RootKey,
    metrics: &Metrics,
    stop: CancellationToken,
) -> Result<Option<AgentIssuer>, RunError> {
    let Some(url) = args.agent_issuer_url.clone() else {
        return Ok(None);
    };
    let host = issuer::host_of(&url).map_err(RunError::IssuerUrl)?;
    let ca = IssuerCa::derive(root_key).map_err(|e| RunError::Issuer(e.into()))?;
    let tls = ca
        .server_config(&issuer::server_names(&host))
        .map_err(|e| RunError::Issuer(e.into()))?;
    let listener = issuer::serve::bind(args.agent_issuer_listen)
        .await
        .map_err(RunError::Issuer)?;
    let state = Arc::new(IssuerState {
        client: client.clone(),
        root: root_key.clone(),
        outcomes: metrics.agent_credentials.clone(),
    });
    info!(%url, listen = %args.agent_issuer_listen, "agent credential issuer listening");
    tokio::spawn(issuer::serve(
        listener,
        tls,
        issuer::serve::router(state),
        stop,
    ));
    Ok(Some(AgentIssuer {
        url,
        ca_pem: ca.ca_pem(),
    }))
}

/// The root key: from `--root-key-file`, or from (or into) the Secret `--root-key-secret` of
/// the operator's namespace; with the latter, the kube client made to read it, for the
/// controllers to use too.
async fn load_root_key(args: &RunArgs) -> Result<(RootKey, Option<Client>), RunError> {
    match (&args.root_key_file, &args.root_key_secret) {
        (Some(file), _) => Ok((RootKey::from_file(file).map_err(RunError::RootKey)?, None)),
        (None, Some(secret)) => {
            if args.operator_namespace.is_empty() {
                return Err(RunError::RootKeyNamespace);
            }
            let client = Client::try_default().await.map_err(RunError::Client)?;
            let key = crate::root_key_secret::load_or_create(
                client.clone(),
                &args.operator_namespace,
                secret,
            )
            .await
            .map_err(RunError::RootKeySecret)?;
            Ok((key, Some(client)))
        }
        (None, None) => Err(RunError::NoRootKey),
    }
}

async fn run_with_admin(
    args: &RunArgs,
    root_key: RootKey,
    client: Option<Client>,
    shutdown: CancellationToken,
    metrics: Metrics,
    readiness: Readiness,
) -> Result<(), RunError> {
    let client = match client {
        Some(c) => c,
        None => Client::try_default().await.map_err(RunError::Client)?,
    };
    // Every replica serves the issuer (leader or not): agents start at any time.
    let agent_issuer =
        start_issuer(args, &client, &root_key, &metrics, shutdown.child_token()).await?;
    let identity = args
        .identity
        .clone()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| format!("kvpool-operator-{}", std::process::id()));

    // Leader election: wait for the lease (standing by counts as ready), then reconcile until
    // shutdown or until the lease is lost.
    let controllers_stop = shutdown.child_token();
    let lost = CancellationToken::new();
    let mut lease = None;
    if args.leader_elect {
        let manager = LeaseManagerBuilder::new(client.clone(), &args.leader_election_lease)
            .with_namespace(&args.leader_election_namespace)
            .with_identity(&identity)
            .with_field_manager(&args.field_manager)
            .with_duration(LEASE_DURATION_S)
            .with_grace(LEASE_GRACE_S)
            .build()
            .await
            .map_err(RunError::Leader)?;
        let (mut rx, task) = manager.watch().await;
        readiness.set_ready(true);
        info!(%identity, lease = %args.leader_election_lease, "waiting for the leader lease");
        loop {
            if *rx.borrow_and_update() {
                break;
            }
            tokio::select! {
                () = shutdown.cancelled() => {
                    drop(rx);
                    let _ = task.await;
                    return Ok(());
                }
                changed = rx.changed() => if changed.is_err() {
                    return Err(RunError::LeadershipLost);
                }
            }
        }
        info!(%identity, "acquired the leader lease");
        readiness.set_ready(false);
        let stop = controllers_stop.clone();
        let lost_flag = lost.clone();
        let watch_loss = tokio::spawn(async move {
            while rx.changed().await.is_ok() {
                if !*rx.borrow_and_update() {
                    error!("lost the leader lease, stopping the controllers");
                    lost_flag.cancel();
                    stop.cancel();
                    break;
                }
            }
            // Dropping the receiver makes the lease manager release the lease.
        });
        lease = Some((watch_loss, task));
    }
    metrics.set_leader(true);

    let ctx = Arc::new(
        Context::new(
            client.clone(),
            metrics.clone(),
            Settings {
                field_manager: args.field_manager.clone(),
                agent_image: args.agent_image.clone(),
                master_image: args.master_image.clone(),
                conductor_image: args.conductor_image.clone(),
                operator_namespace: (!args.operator_namespace.is_empty())
                    .then(|| args.operator_namespace.clone()),
                agent_issuer,
            },
            root_key,
            Some(identity),
        )
        .with_master_stats(Arc::new(GrpcMasterStats {
            ca_file: args.master_ca_file.clone(),
            ..GrpcMasterStats::default()
        })),
    );
    let controllers = run_controllers(
        &client,
        args,
        ctx,
        controllers_stop.clone(),
        readiness.clone(),
    );
    let grace_over = async {
        controllers_stop.cancelled().await;
        tokio::time::sleep(CONTROLLERS_GRACE).await;
    };
    tokio::select! {
        () = controllers => {}
        () = grace_over => warn!(
            grace_s = CONTROLLERS_GRACE.as_secs(),
            "the controllers did not stop within the grace period after the shutdown; dropping them"
        ),
    }
    readiness.set_ready(false);
    metrics.set_leader(false);

    if let Some((watch_loss, task)) = lease {
        watch_loss.abort();
        let _ = watch_loss.await;
        // The lease manager releases the lease once its channel closes.
        match tokio::time::timeout(Duration::from_secs(5), task).await {
            Ok(Ok(Ok(_))) => info!("released the leader lease"),
            Ok(Ok(Err(e))) => warn!(error = %chain(&e), "releasing the leader lease failed"),
            Ok(Err(e)) => warn!(error = %chain(&e), "lease task failed"),
            Err(_) => warn!("timed out releasing the leader lease"),
        }
    }
    if lost.is_cancelled() && !shutdown.is_cancelled() {
        return Err(RunError::LeadershipLost);
    }
    info!("kvpool-operator stopped");
    Ok(())
}

/// A generation-filtered trigger stream for `K` and the store behind it. `synced` is cancelled
/// once the first full list has reached the store.
///
/// Readiness is signalled from the stream rather than with `Store::wait_until_ready`: that
/// future keeps only the most recently registered waker (kube-runtime 5's `DelayedInit` wraps a
/// oneshot channel), so a second waiter would silently steal the controller's own wake-up.
fn filtered<K>(
    api: Api<K>,
    synced: CancellationToken,
) -> (
    Store<K>,
    impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static,
)
where
    K: Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (reader, writer) = reflector::store();
    let stream = watcher(api, watcher::Config::default().any_semantic())
        .default_backoff()
        .inspect_ok(move |event| {
            if matches!(event, watcher::Event::InitDone) {
                synced.cancel();
            }
        })
        .reflect(writer)
        .applied_objects()
        .predicate_filter(predicates::generation, Default::default());
    (reader, stream)
}

/// The engine pools of `api` whose spec changed (a new generation) or that were deleted: what
/// changes the `ModelMismatch` check of their KVCachePool and of their sibling engine pools,
/// and the conductor's model facts. Status writes do not trigger it.
fn engine_pool_changes<K: EnginePool>(
    api: Api<K>,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static {
    let mut seen = Generations::default();
    watcher(api, watcher::Config::default().any_semantic())
        .default_backoff()
        .try_filter_map(move |event| futures::future::ready(Ok(spec_change(&mut seen, event))))
}

/// The last generation seen of each object.
type Generations<K> = std::collections::HashMap<reflector::ObjectRef<K>, Option<i64>>;

/// The object of `event` when it is new, has a new generation, or was deleted (kube's
/// `predicates::generation` drops deletions, which change what the engine pools serve).
fn spec_change<K: EnginePool>(seen: &mut Generations<K>, event: watcher::Event<K>) -> Option<K> {
    match event {
        watcher::Event::Apply(o) | watcher::Event::InitApply(o) => {
            let generation = o.meta().generation;
            (seen.insert(reflector::ObjectRef::from_obj(&o), generation) != Some(generation))
                .then_some(o)
        }
        watcher::Event::Delete(o) => {
            seen.remove(&reflector::ObjectRef::from_obj(&o));
            Some(o)
        }
        watcher::Event::Init | watcher::Event::InitDone => None,
    }
}

/// The KVCachePool an engine pool references.
fn referenced_pool<K: EnginePool>(engine: &K) -> Option<reflector::ObjectRef<KVCachePool>> {
    Some(reflector::ObjectRef::new(engine.pool_ref()).within(&engine.meta().namespace.clone()?))
}

fn controller_config(args: &RunArgs) -> controller::Config {
    controller::Config::default()
        .concurrency(args.concurrency)
        .debounce(Duration::from_millis(500))
}

async fn log_results<K, E>(
    kind: &'static str,
    result: Result<
        (kube::runtime::reflector::ObjectRef<K>, controller::Action),
        controller::Error<E, watcher::Error>,
    >,
) where
    K: Resource,
    E: std::error::Error,
{
    match result {
        Ok((obj, _)) => tracing::debug!(kind, object = %obj.name, "reconciled"),
        Err(controller::Error::ReconcilerFailed(err, obj)) => {
            warn!(kind, object = %obj.name, error = %chain(&err), "reconcile failed")
        }
        Err(err) => warn!(kind, error = %chain(&err), "controller error"),
    }
}

fn engine_controller<K>(
    client: &Client,
    args: &RunArgs,
    stop: CancellationToken,
    synced: CancellationToken,
) -> Controller<K>
where
    K: EnginePool,
{
    let (reader, stream) = filtered(api::<K>(client, &args.namespace), synced);
    let owned = watcher::Config::default()
        .labels(&managed_selector())
        .any_semantic();
    let store = reader.clone();
    let (_, pools) = filtered(
        api::<KVCachePool>(client, &args.namespace),
        CancellationToken::new(),
    );
    let (prefill_store, decode_store) = (reader.clone(), reader.clone());
    Controller::for_stream(stream, reader)
        .owns(api::<Deployment>(client, &args.namespace), owned.clone())
        .owns(api::<Service>(client, &args.namespace), owned)
        .watches_stream(pools, move |pool: KVCachePool| {
            enginepool::referencing(&store, &pool)
        })
        // A sibling engine pool that changes or goes may change this one's ModelMismatch.
        .watches_stream(
            engine_pool_changes(api::<PrefillPool>(client, &args.namespace)),
            move |p: PrefillPool| enginepool::siblings(&prefill_store, &p),
        )
        .watches_stream(
            engine_pool_changes(api::<DecodePool>(client, &args.namespace)),
            move |p: DecodePool| enginepool::siblings(&decode_store, &p),
        )
        .with_config(controller_config(args))
        .graceful_shutdown_on(stop.cancelled_owned())
}

async fn run_controllers(
    client: &Client,
    args: &RunArgs,
    ctx: Arc<Context>,
    stop: CancellationToken,
    readiness: Readiness,
) {
    let owned = watcher::Config::default()
        .labels(&managed_selector())
        .any_semantic();
    let pools_synced = CancellationToken::new();
    let prefill_synced = CancellationToken::new();
    let decode_synced = CancellationToken::new();
    let (pool_reader, pool_stream) = filtered(
        api::<KVCachePool>(client, &args.namespace),
        pools_synced.clone(),
    );
    let pools = Controller::for_stream(pool_stream, pool_reader)
        .owns(api::<DaemonSet>(client, &args.namespace), owned.clone())
        .owns(api::<Deployment>(client, &args.namespace), owned.clone())
        .owns(api::<Service>(client, &args.namespace), owned.clone())
        .owns(api::<ConfigMap>(client, &args.namespace), owned)
        // The engine pools give the conductor its model facts and decide ModelMismatch.
        .watches_stream(
            engine_pool_changes(api::<PrefillPool>(client, &args.namespace)),
            |p: PrefillPool| referenced_pool(&p),
        )
        .watches_stream(
            engine_pool_changes(api::<DecodePool>(client, &args.namespace)),
            |p: DecodePool| referenced_pool(&p),
        )
        .with_config(controller_config(args))
        .graceful_shutdown_on(stop.clone().cancelled_owned());
    let prefill =
        engine_controller::<PrefillPool>(client, args, stop.clone(), prefill_synced.clone());
    let decode = engine_controller::<DecodePool>(client, args, stop.clone(), decode_synced.clone());

    // Ready once every controller's store has its initial list.
    let ready_flag = readiness.clone();
    let sync = tokio::spawn(async move {
        tokio::join!(
            pools_synced.cancelled(),
            prefill_synced.cancelled(),
            decode_synced.cancelled()
        );
        info!("initial sync done, ready");
        ready_flag.set_ready(true);
    });

    let pools = pools
        .run(cachepool::reconcile, cachepool::error_policy, ctx.clone())
        .for_each(|r| log_results("KVCachePool", r));
    let prefill = prefill
        .run(
            enginepool::reconcile::<PrefillPool>,
            enginepool::error_policy::<PrefillPool>,
            ctx.clone(),
        )
        .for_each(|r| log_results("PrefillPool", r));
    let decode = decode
        .run(
            enginepool::reconcile::<DecodePool>,
            enginepool::error_policy::<DecodePool>,
            ctx,
        )
        .for_each(|r| log_results("DecodePool", r));
    tokio::join!(pools, prefill, decode);
    sync.abort();
}

#[cfg(test)]
mod tests {
    use kube::runtime::watcher::Event;
    use kvpool_crd::DecodePool;

    use super::*;

    /// A new pool and a new generation pass, a status-only change does not, a deletion does.
    #[test]
    fn engine_pool_spec_changes_and_deletions_pass_status_writes_do_not() {
        let mut seen = Generations::default();
        let mut pool: DecodePool = crate::test_fixtures::decode_sglang();
        let generation = |o: Option<DecodePool>| o.map(|o| o.metadata.generation);
        assert_eq!(
            generation(spec_change(&mut seen, Event::InitApply(pool.clone()))),
            Some(Some(1))
        );
        assert_eq!(generation(spec_change(&mut seen, Event::InitDone)), None);
        pool.status = Some(Default::default());
        assert_eq!(
            generation(spec_change(&mut seen, Event::Apply(pool.clone()))),
            None
        );
        pool.metadata.generation = Some(2);
        assert_eq!(
            generation(spec_change(&mut seen, Event::Apply(pool.clone()))),
            Some(Some(2))
        );
        assert_eq!(
            generation(spec_change(&mut seen, Event::Delete(pool.clone()))),
            Some(Some(2))
        );
        // Created again under the same name: a change.
        assert_eq!(
            generation(spec_change(&mut seen, Event::Apply(pool))),
            Some(Some(2))
        );
    }
}

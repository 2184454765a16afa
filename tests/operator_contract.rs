//! The operator <-> binaries contract: the containers the operator's real `build()` emits for
//! the example pools (deploy/examples and operator/tests/fixtures) are parsed with the real
//! clap parser of the `kvpool` binary, after the kubelet-style `$(VAR)` substitution,
//! and the master's and conductor's flag validation is run on them too.
//! The e2e suite's engine pools (tests/e2e/pool) are checked the same way: what the operator
//! starts for them must be a synthetic engine that runs without a GPU.
//! I/O boundary: example files in the repository and a key file in a temporary directory.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Container, PodSpec};
use kvpool_crd::KVCachePool;
use kvpool_operator::cachepool::build::{CachePoolChildren, build};
use kvpool_operator::cachepool::validate::validate;
use kvpool_operator::context::Settings;

const KEY_HEX: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// Every example KVCachePool, by file.
fn example_pools() -> Result<Vec<(String, KVCachePool)>> {
    let root = repo_root();
    let mut out = Vec::new();
    for rel in [
        "deploy/examples/tcp/kvcachepool.yaml",
        "deploy/examples/roce-sriov/kvcachepool.yaml",
        "operator/tests/fixtures/kvcachepool-tcp.yaml",
        "operator/tests/fixtures/kvcachepool-roce.yaml",
        "tests/e2e/pool/kvcachepool.yaml",
    ] {
        let text = std::fs::read_to_string(root.join(rel)).with_context(|| rel.to_owned())?;
        let mut pool: KVCachePool =
            serde_saphyr::from_str(&text).with_context(|| format!("{rel} parses"))?;
        // Examples have no namespace/uid; the API server would add them.
        pool.metadata
            .namespace
            .get_or_insert_with(|| "default".into());
        pool.metadata
            .uid
            .get_or_insert_with(|| "6f1d2c3b-0000-4000-8000-0000000000aa".into());
        out.push((rel.to_owned(), pool));
    }
    Ok(out)
}

fn children(pool: &KVCachePool) -> Result<CachePoolChildren> {
    let valid = validate(pool, &Settings::for_tests()).context("example is valid")?;
    build(&valid, KEY_HEX).context("build")
}

/// The argv of the first container of `pod` after the `$(VAR)` substitution, with the files the
/// pool's children mount written under a temporary directory (kept while the guard lives).
fn container_argv(
    children: &CachePoolChildren,
    pod: Option<&PodSpec>,
) -> Result<(tempfile::TempDir, Vec<String>)> {
    let dir = tempfile::tempdir()?;
    let files = write_files(dir.path(), children)?;
    let argv = argv(pod_of(pod)?, &files)?;
    Ok((dir, argv))
}

/// The master container of `pool`'s children as the kvpool CLI parses it (`what` names the
/// case in errors): the guard of its files (see [`container_argv`]), its argv and its flags.
fn master_cli(
    pool: &KVCachePool,
    what: &str,
) -> Result<(
    tempfile::TempDir,
    Vec<String>,
    Box<kvpool_master::cmd::MasterArgs>,
)> {
    let children = children(pool)?;
    let (files, argv) = container_argv(&children, template(&children.master))?;
    let cli = kvpool::cli::Cli::try_parse_from(&argv)
        .with_context(|| format!("{what}: master args {argv:?}"))?;
    let kvpool::cli::Command::Master(args) = cli.command else {
        bail!("{what}: the master container must run `master`, got {argv:?}");
    };
    Ok((files, argv, args))
}

/// The agent's configuration as it starts from the pool's DaemonSet: its container's args
/// parsed by the agent's CLI, the mounted ConfigMap loaded by the agent's own loader, the
/// flags overlaid and the whole validated. `label` names the example in errors.
fn agent_config(
    label: &str,
    children: &CachePoolChildren,
) -> Result<kvpool_agent::config::AgentConfig> {
    let pod = children
        .agent
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref());
    let (_files, argv) = container_argv(children, pod)?;
    let cli = kvpool::cli::Cli::try_parse_from(&argv)
        .with_context(|| format!("{label}: agent args {argv:?}"))?;
    let kvpool::cli::Command::Agent(agent) = cli.command else {
        bail!("{label}: the agent container must run `agent`, got {argv:?}");
    };
    let kvpool_agent::cli::Command::Run(args) = agent else {
        bail!("{label}: the agent container must run `agent run`, got {argv:?}");
    };
    let path = args
        .pool_config
        .as_deref()
        .with_context(|| format!("{label}: the agent must be given --pool-config"))?;
    let file = kvpool_agent::config::load_pool_document(path, Path::new("/proc"))
        .map_err(|e| anyhow::anyhow!("{label}: agent loads config.yaml: {e}"))?;
    kvpool_agent::config::validate(&args.overlay(file))
        .map_err(|e| anyhow::anyhow!("{label}: agent config validates: {e}"))
}

/// The pod template of a Deployment.
fn template(d: &Deployment) -> Option<&PodSpec> {
    d.spec.as_ref().and_then(|s| s.template.spec.as_ref())
}

fn pod_of(spec: Option<&PodSpec>) -> Result<&Container> {
    spec.and_then(|p| p.containers.first())
        .context("pod template has a container")
}

/// command + args with `$(VAR)` replaced as the kubelet does, from the container's env (sample
/// values for downward-API fields) and with paths under /etc/kvpool redirected to `files`.
fn argv(c: &Container, files: &BTreeMap<String, PathBuf>) -> Result<Vec<String>> {
    let mut env = BTreeMap::new();
    for e in c.env.iter().flatten() {
        let value = match (&e.value, &e.value_from) {
            (Some(v), _) => v.clone(),
            (None, Some(_)) => "10.1.2.3".to_owned(),
            (None, None) => String::new(),
        };
        env.insert(e.name.clone(), value);
    }
    let mut out = Vec::new();
    for a in c.command.iter().flatten().chain(c.args.iter().flatten()) {
        let mut s = a.clone();
        for (k, v) in &env {
            s = s.replace(&format!("$({k})"), v);
        }
        ensure!(
            !s.contains("$("),
            "container {}: `{a}` refers to a variable the container does not define",
            c.name
        );
        if let Some(p) = files.get(&s) {
            s = p.display().to_string();
        }
        out.push(s);
    }
    Ok(out)
}

/// The ConfigMap's files and the auth key, written to a temp dir, keyed by in-container path.
fn write_files(dir: &Path, children: &CachePoolChildren) -> Result<BTreeMap<String, PathBuf>> {
    let mut files = BTreeMap::new();
    for (key, text) in children.config.data.iter().flatten() {
        let path = dir.join(key);
        std::fs::write(&path, text)?;
        files.insert(format!("/etc/kvpool/{key}"), path);
    }
    let key = dir.join("key");
    std::fs::write(&key, KEY_HEX)?;
    files.insert("/etc/kvpool/auth/key".to_owned(), key);
    Ok(files)
}

/// The agents' effective config the operator renders into the pool's ConfigMap.
fn config_yaml(children: &CachePoolChildren) -> Result<&String> {
    children
        .config
        .data
        .as_ref()
        .and_then(|d| d.get("config.yaml"))
        .context("config.yaml")
}

fn ssd_bytes(children: &CachePoolChildren) -> Result<Option<u64>> {
    let text = config_yaml(children)?;
    let eff: kvpool_crd::ValidatedKVCachePool = serde_saphyr::from_str(text)?;
    Ok(eff.ssd.map(|s| s.capacity_bytes))
}

#[test]
fn agent_container_parses_with_the_agent_cli() -> Result<()> {
    for (rel, pool) in example_pools()? {
        let children = children(&pool)?;
        // The ConfigMap loads in the agent's own loader and validates, as at pod start.
        let cfg = agent_config(&rel, &children)?;
        let pool_cfg = cfg
            .pool
            .as_ref()
            .with_context(|| format!("{rel}: the agent must run in pool mode"))?;
        let ns = pool.metadata.namespace.as_deref().unwrap_or_default();
        let name = pool.metadata.name.as_deref().unwrap_or_default();
        ensure!(
            pool_cfg.masters == [format!("{name}-master.{ns}.svc:50051")],
            "{rel}: master address {:?}",
            pool_cfg.masters
        );
        ensure!(pool_cfg.auth_key_file == Path::new("/etc/kvpool/auth/key"));
        ensure!(
            pool_cfg.want_rdma == (pool.spec.transport.protocol != kvpool_crd::Protocol::Tcp),
            "{rel}: transport.protocol reaches the agent's transfer engine"
        );
        ensure!(cfg.api.socket_dir == Path::new("/run/kvpool"));
        ensure!(
            cfg.ssd.as_ref().map(|s| s.tier.capacity) == ssd_bytes(&children)?,
            "{rel}: SSD tier carried over"
        );
        // Golden copy for the agent crate's child-process `check-config` test.
        let golden = repo_root()
            .join("agent/tests/fixtures/operator")
            .join(rel.replace('/', "_"));
        let text = config_yaml(&children)?;
        if std::env::var_os("KVPOOL_UPDATE_GOLDEN").is_some() {
            std::fs::create_dir_all(golden.parent().context("parent")?)?;
            std::fs::write(&golden, text)?;
        }
        let want = std::fs::read_to_string(&golden).with_context(|| {
            format!(
                "{}: missing; regenerate with KVPOOL_UPDATE_GOLDEN=1 cargo nextest run -p kvpool --test operator_contract",
                golden.display()
            )
        })?;
        ensure!(
            &want == text,
            "{} is stale; regenerate with KVPOOL_UPDATE_GOLDEN=1 cargo nextest run -p kvpool --test operator_contract",
            golden.display()
        );
    }
    Ok(())
}

#[test]
fn master_container_parses_and_validates_with_the_kvpool_cli() -> Result<()> {
    let mut saw_ha = false;
    let mut saw_plain = false;
    for (rel, pool) in example_pools()? {
        let (_files, argv, args) = master_cli(&pool, &rel)?;
        if args.etcd_endpoints.is_empty() {
            saw_plain = true;
        } else {
            saw_ha = true;
        }
        args.validate()
            .map_err(|e| anyhow::anyhow!("{rel}: master flags {argv:?}: {e}"))?;
    }
    ensure!(saw_ha && saw_plain, "examples cover HA and single masters");
    Ok(())
}

/// `spec.eviction` (every policy of the enum, watermarks at their extremes) and the spread reach
/// the master: the generated args parse and validate into the master's core configuration with
/// the same policy, the watermarks as fractions of both tiers, and replicas spread over failure
/// domains. A value the master could not honour would fail here, not in a crash-looping pod.
#[test]
fn eviction_and_spread_reach_the_master() -> Result<()> {
    use kvpool_core::master::types::Spread;
    let base =
        std::fs::read_to_string(repo_root().join("operator/tests/fixtures/kvcachepool-tcp.yaml"))?;
    for policy in kvpool_crd::EvictionPolicy::ALL {
        for (high, low) in [(100, 0), (90, 80), (1, 0), (100, 99)] {
            let mut pool: KVCachePool = serde_saphyr::from_str(&base)?;
            pool.metadata.namespace = Some("default".into());
            pool.metadata.uid = Some("6f1d2c3b-0000-4000-8000-0000000000aa".into());
            pool.spec.eviction.policy = policy;
            pool.spec.eviction.high_watermark_percent = high;
            pool.spec.eviction.low_watermark_percent = low;
            let (_files, argv, args) = master_cli(&pool, &format!("{policy:?} {high}/{low}"))?;
            let core = args
                .validate()
                .map_err(|e| anyhow::anyhow!("{policy:?} {high}/{low}: {argv:?}: {e}"))?
                .core;
            ensure!(
                core.policy.as_str() == policy.as_str(),
                "{policy:?} became {:?}",
                core.policy
            );
            for w in core.watermarks {
                ensure!(
                    (w.high, w.low) == (f64::from(high) / 100.0, f64::from(low) / 100.0),
                    "{high}/{low} became {w:?}"
                );
            }
            ensure!(
                core.spread == Spread::FailureDomain,
                "spread {:?}",
                core.spread
            );
        }
    }
    Ok(())
}

#[test]
fn conductor_container_parses_and_validates_with_the_kvpool_cli() -> Result<()> {
    let mut seen = 0;
    for (rel, pool) in example_pools()? {
        let children = children(&pool)?;
        let Some((deployment, _)) = &children.conductor else {
            continue;
        };
        seen += 1;
        let (_files, argv) = container_argv(&children, template(deployment))?;
        let cli = kvpool::cli::Cli::try_parse_from(&argv)
            .with_context(|| format!("{rel}: conductor args {argv:?}"))?;
        let kvpool::cli::Command::Conductor(args) = cli.command else {
            bail!("{rel}: the conductor container must run `conductor`, got {argv:?}");
        };
        kvpool_conductor::cli::conductor_config(&args)
            .map_err(|e| anyhow::anyhow!("{rel}: conductor flags {argv:?}: {e}"))?;
        // Engine discovery is on, in the pool's namespace, on the engines' port.
        let discovery = kvpool_conductor::cli::discovery_config(&args)
            .map_err(|e| anyhow::anyhow!("{rel}: discovery flags {argv:?}: {e}"))?
            .with_context(|| format!("{rel}: the conductor must discover its engines"))?;
        ensure!(Some(discovery.namespace.as_str()) == pool.metadata.namespace.as_deref());
        ensure!(discovery.engine_port == kvpool_operator::contract::ENGINE_PORT);
        // It runs as the ServiceAccount whose Role allows the list and watch discovery makes.
        let spec = template(deployment).context("pod spec")?;
        let rbac = children.conductor_rbac.as_ref().context("conductor RBAC")?;
        ensure!(spec.service_account_name == rbac.service_account.metadata.name);
        ensure!(spec.automount_service_account_token == Some(true));
        discovery_selects_the_engine_pods(&rel, &pool, &discovery)?;
    }
    ensure!(seen > 0, "at least one example enables the conductor");
    Ok(())
}

/// `k=v,k=v` selector matches `labels` (equality terms only, which is all the operator writes).
fn selects(selector: &str, labels: &BTreeMap<String, String>) -> Result<bool> {
    for term in selector.split(',') {
        let (k, v) = term
            .split_once('=')
            .with_context(|| format!("selector term {term:?} is not k=v"))?;
        if labels.get(k).map(String::as_str) != Some(v) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The conductor's selectors pick the pod templates the operator builds for a PrefillPool and a
/// DecodePool of this KVCachePool (each its own role only), and those pods serve on the port
/// the conductor dials; pods of another pool are not selected.
fn discovery_selects_the_engine_pods(
    rel: &str,
    pool: &KVCachePool,
    discovery: &kvpool_conductor::discovery::DiscoveryConfig,
) -> Result<()> {
    use kvpool_crd::{DecodePool, PrefillPool};
    use kvpool_operator::enginepool::{build as engine_build, validate as engine_validate};
    let valid_pool = validate(pool, &Settings::for_tests())?;
    let engine_labels = |obj: &dyn Fn() -> Result<engine_validate::ValidEnginePool>| -> Result<(BTreeMap<String, String>, Vec<i32>)> {
        let valid = obj()?;
        let children = engine_build::build(&valid, "hash");
        let template = &children.deployment.spec.as_ref().context("spec")?.template;
        let labels = template
            .metadata
            .as_ref()
            .and_then(|m| m.labels.clone())
            .unwrap_or_default();
        let ports = template
            .spec
            .as_ref()
            .and_then(|s| s.containers.first())
            .and_then(|c| c.ports.as_ref())
            .map(|ps| ps.iter().map(|p| p.container_port).collect())
            .unwrap_or_default();
        Ok((labels, ports))
    };
    let name = pool.metadata.name.clone().unwrap_or_default();
    let namespace = pool.metadata.namespace.clone().unwrap_or_default();
    let meta = |n: &str| kube::api::ObjectMeta {
        name: Some(n.to_owned()),
        namespace: Some(namespace.clone()),
        uid: Some("6f1d2c3b-0000-4000-8000-0000000000bb".to_owned()),
        generation: Some(1),
        ..Default::default()
    };
    let engine_yaml = |kind: &str| {
        format!(
            "apiVersion: kvpool.dev/v1alpha1\nkind: {kind}\nmetadata: {{name: e}}\nspec:\n  kvCachePoolRef: {{name: {name}}}\n  engine: {{kind: custom, image: example/engine:1, model: m}}\n"
        )
    };
    let mut prefill: PrefillPool = serde_saphyr::from_str(&engine_yaml("PrefillPool"))?;
    prefill.metadata = meta("p");
    let mut decode: DecodePool = serde_saphyr::from_str(&engine_yaml("DecodePool"))?;
    decode.metadata = meta("d");
    let (p_labels, p_ports) =
        engine_labels(&|| Ok(engine_validate::validate(&prefill, valid_pool.clone())?))?;
    let (d_labels, d_ports) =
        engine_labels(&|| Ok(engine_validate::validate(&decode, valid_pool.clone())?))?;
    let port = i32::from(discovery.engine_port);
    ensure!(
        p_ports.contains(&port) && d_ports.contains(&port),
        "{rel}: engines serve on {port}"
    );
    for (role, selector, own, other) in [
        ("prefill", &discovery.prefill_selector, &p_labels, &d_labels),
        ("decode", &discovery.decode_selector, &d_labels, &p_labels),
    ] {
        ensure!(
            selects(selector, own)?,
            "{rel}: {role} selector {selector} misses {own:?}"
        );
        ensure!(
            !selects(selector, other)?,
            "{rel}: {role} selector picks the other role's pods"
        );
    }
    let mut other_pool = p_labels.clone();
    other_pool.insert(kvpool_crd::labels::POOL.to_owned(), format!("{name}-other"));
    ensure!(
        !selects(&discovery.prefill_selector, &other_pool)?,
        "{rel}: selector ignores the pool"
    );
    Ok(())
}

/// The DRAM NUMA policy of the CRD reaches the agent as the placement the agent implements:
/// `local` places on the NICs' (or GPUs') nodes, `interleave` spreads evenly over all nodes,
/// and `none` maps the tier without any binding (see docs/crds.md). Loaded with the agent's own
/// loader, as at pod start.
#[test]
fn numa_policy_maps_to_the_agents_placement() -> Result<()> {
    use kvpool_agent::placement::NumaPolicy as AgentNuma;
    let base =
        std::fs::read_to_string(repo_root().join("operator/tests/fixtures/kvcachepool-tcp.yaml"))?;
    for (crd, want) in [
        (kvpool_crd::NumaPolicy::Local, AgentNuma::NicLocal),
        (kvpool_crd::NumaPolicy::Interleave, AgentNuma::Interleave),
        (kvpool_crd::NumaPolicy::None, AgentNuma::None),
    ] {
        let mut pool: KVCachePool = serde_saphyr::from_str(&base)?;
        pool.spec.dram.numa_policy = crd;
        let children = children(&pool)?;
        let cfg = agent_config(&format!("{crd:?}"), &children)?;
        ensure!(
            cfg.dram.policy == want,
            "{crd:?} became {:?}",
            cfg.dram.policy
        );
    }
    Ok(())
}

/// The e2e suite's engine pools (kind `custom`, the kvpool CLI image) become containers that run
/// `kvpool engine --synthetic` as the image's entrypoint sees it, request no GPU, and, with the
/// agent socket the operator passes in the environment, have what the engine needs to size its
/// KV blocks (a kind cluster has no GPU, so anything else would keep the pool from Ready).
#[test]
fn e2e_engine_pools_run_the_synthetic_engine_without_a_gpu() -> Result<()> {
    use kvpool_operator::enginepool::{build as engine_build, validate as engine_validate};
    let root = repo_root();
    let (_, pool) = example_pools()?
        .into_iter()
        .find(|(rel, _)| rel.starts_with("tests/e2e/"))
        .context("the e2e KVCachePool is among the examples")?;
    let valid_pool = validate(&pool, &Settings::for_tests()).context("e2e pool is valid")?;
    let read = |rel: &str| -> Result<String> {
        let text = std::fs::read_to_string(root.join(rel)).with_context(|| rel.to_owned())?;
        ensure!(
            text.contains("@VERSION@"),
            "{rel}: run.sh fills in @VERSION@"
        );
        Ok(text.replace("@VERSION@", "0.0.0-e2e"))
    };
    let uid = |meta: &mut kube::api::ObjectMeta| {
        meta.uid = Some("6f1d2c3b-0000-4000-8000-0000000000bb".to_owned());
    };
    let mut prefill: kvpool_crd::PrefillPool =
        serde_saphyr::from_str(&read("tests/e2e/pool/prefillpool.yaml")?)?;
    uid(&mut prefill.metadata);
    let mut decode: kvpool_crd::DecodePool =
        serde_saphyr::from_str(&read("tests/e2e/pool/decodepool.yaml")?)?;
    uid(&mut decode.metadata);
    let valid = [
        engine_validate::validate(&prefill, valid_pool.clone()).context("e2e prefill pool")?,
        engine_validate::validate(&decode, valid_pool).context("e2e decode pool")?,
    ];
    for p in &valid {
        let children = engine_build::build(p, "hash");
        let c = pod_of(template(&children.deployment))?;
        ensure!(
            c.image.as_deref() == Some("ghcr.io/kvpool/kvpool:0.0.0-e2e"),
            "{}: image {:?}",
            p.name,
            c.image
        );
        ensure!(
            c.command.is_none(),
            "{}: the image's entrypoint (kvpool) runs the args",
            p.name
        );
        let requests = c
            .resources
            .iter()
            .flat_map(|r| {
                r.requests
                    .iter()
                    .chain(r.limits.iter())
                    .flat_map(|m| m.keys())
            })
            .collect::<Vec<_>>();
        ensure!(
            !requests.iter().any(|k| k.contains("gpu")),
            "{}: requests a GPU: {requests:?}",
            p.name
        );
        let mut argv = vec!["kvpool".to_owned()];
        argv.extend(argv_of(c)?);
        let cli = kvpool::cli::Cli::try_parse_from(&argv)
            .with_context(|| format!("{}: engine args {argv:?}", p.name))?;
        let kvpool::cli::Command::Engine(mut args) = cli.command else {
            bail!(
                "{}: the engine container must run `engine`, got {argv:?}",
                p.name
            );
        };
        ensure!(args.synthetic, "{}: --synthetic", p.name);
        ensure!(
            args.addrs.listen.port() == 8000 && args.addrs.listen.ip().is_unspecified(),
            "{}: the engine must listen on 0.0.0.0:8000 (the Service's port), not {}",
            p.name,
            args.addrs.listen
        );
        // The operator's environment: clap reads it from the process at pod start.
        let env: BTreeMap<&str, &str> = c
            .env
            .iter()
            .flatten()
            .filter_map(|e| Some((e.name.as_str(), e.value.as_deref()?)))
            .collect();
        let socket = env
            .get("KVPOOL_AGENT_SOCKET")
            .context("the operator passes the agent socket")?;
        args.agent_socket = Some(PathBuf::from(socket));
        kvpool_synthetic::cli::engine_config(&args)
            .map_err(|e| anyhow::anyhow!("{}: engine flags: {e}", p.name))?;
        let geometry = kvpool_synthetic::cli::kv_geometry(&args)
            .map_err(|e| anyhow::anyhow!("{}: KV block size: {e}", p.name))?;
        ensure!(
            geometry.is_some(),
            "{}: KV blocks go through the agent",
            p.name
        );
    }
    Ok(())
}

/// command + args of a container that refers to no variables and no files.
fn argv_of(c: &Container) -> Result<Vec<String>> {
    argv(c, &BTreeMap::new())
}

/// With the agent credential issuer (the chart's default), the agent's pool document sends it
/// to the issuer instead of a key file, and the master binds agents to their nodes.
#[test]
fn with_the_issuer_the_agent_asks_for_its_credential_and_the_master_binds_nodes() -> Result<()> {
    let (rel, pool) = example_pools()?
        .into_iter()
        .next()
        .context("the tcp example")?;
    let root = kvpool_operator::root_key::RootKey::for_tests();
    let ca = kvpool_operator::issuer::IssuerCa::derive(&root)?;
    let settings = Settings {
        agent_issuer: Some(kvpool_operator::issuer::AgentIssuer {
            url: "https://kvpool-operator-agent-issuer.kvpool-system.svc:8443".to_owned(),
            ca_pem: ca.ca_pem(),
        }),
        ..Settings::for_tests()
    };
    let valid = validate(&pool, &settings).context("example is valid")?;
    let children = build(&valid, KEY_HEX).context("build")?;
    let cfg = agent_config(&rel, &children)?;
    let pool_cfg = cfg.pool.as_ref().context("pool mode")?;
    let issuer = pool_cfg
        .credential_issuer
        .as_ref()
        .context("the agent asks the issuer")?;
    ensure!(issuer.url == "https://kvpool-operator-agent-issuer.kvpool-system.svc:8443");
    ensure!(issuer.ca_pem == ca.ca_pem());
    ensure!(
        issuer.namespace == pool.metadata.namespace.clone().unwrap_or_default()
            && issuer.pool == pool.metadata.name.clone().unwrap_or_default()
    );
    ensure!(
        issuer.token_file == Path::new("/var/run/secrets/kvpool.dev/agent-token/token"),
        "the token file is where the DaemonSet mounts it: {:?}",
        issuer.token_file
    );
    // Golden copy for the check-config child-process test.
    let golden = repo_root().join("agent/tests/fixtures/operator/issuer_tcp_kvcachepool.yaml");
    let text = config_yaml(&children)?;
    if std::env::var_os("KVPOOL_UPDATE_GOLDEN").is_some() {
        std::fs::write(&golden, text)?;
    }
    ensure!(
        std::fs::read_to_string(&golden)? == *text,
        "{} is stale; regenerate with KVPOOL_UPDATE_GOLDEN=1 cargo nextest run -p kvpool --test operator_contract",
        golden.display()
    );
    let master = children
        .master
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .context("master pod")?;
    let args = master.containers[0].args.clone().unwrap_or_default();
    ensure!(!args.iter().any(|a| a == "--shared-agent-credentials"));
    Ok(())
}

/// The conductor of a pool that names its API key Secrets (deploy/examples/vllm-pvc) starts with
/// the key files where the operator mounts them: the flags parse with the kvpool CLI and the
/// conductor reads the client keys and the engines' one key from those paths.
#[test]
fn conductor_api_key_secrets_become_the_key_files_it_reads() -> Result<()> {
    let rel = "deploy/examples/vllm-pvc/kvcachepool.yaml";
    let text = std::fs::read_to_string(repo_root().join(rel)).context(rel)?;
    let mut pool: KVCachePool = serde_saphyr::from_str(&text).context(rel)?;
    pool.metadata
        .uid
        .get_or_insert_with(|| "6f1d2c3b-0000-4000-8000-0000000000ab".into());
    ensure!(
        pool.spec.conductor.api_key_secret.is_some()
            && pool.spec.conductor.engine_api_key_secret.is_some()
    );
    let children = children(&pool)?;
    let (deployment, _) = children.conductor.as_ref().context("a conductor")?;
    let pod = template(deployment).context("pod spec")?;
    let c = pod_of(Some(pod))?;
    // Each flag's file lies in a Secret volume the container mounts.
    let dir = tempfile::tempdir()?;
    let mut files = write_files(dir.path(), &children)?;
    for (flag, content) in [
        ("--api-key-file", "# clients\nsk-client-1\nsk-client-2\n"),
        ("--engine-api-key-file", "sk-engine\n"),
    ] {
        let args = c.args.as_deref().unwrap_or_default();
        let path = args
            .windows(2)
            .find(|w| w[0] == flag)
            .map(|w| w[1].clone())
            .with_context(|| format!("{flag} in {args:?}"))?;
        // The deepest mount above the file is the one that holds it.
        let mount = c
            .volume_mounts
            .iter()
            .flatten()
            .filter(|m| path.starts_with(&format!("{}/", m.mount_path)))
            .max_by_key(|m| m.mount_path.len())
            .with_context(|| format!("{path} is not below a mount"))?;
        let volume = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == mount.name)
            .context("the mounted volume")?;
        ensure!(volume.secret.is_some(), "{flag}: a Secret volume");
        let local = dir.path().join(flag.trim_start_matches('-'));
        std::fs::write(&local, content)?;
        files.insert(path, local);
    }
    let argv = argv(c, &files)?;
    let cli = kvpool::cli::Cli::try_parse_from(&argv)
        .with_context(|| format!("{rel}: conductor args {argv:?}"))?;
    let kvpool::cli::Command::Conductor(args) = cli.command else {
        bail!("{rel}: the conductor container must run `conductor`, got {argv:?}");
    };
    let config = kvpool_conductor::cli::conductor_config(&args)
        .map_err(|e| anyhow::anyhow!("{rel}: conductor flags {argv:?}: {e}"))?;
    ensure!(config.access.api_keys.is_some(), "client keys read");
    ensure!(
        config.access.engine_api_key.as_deref() == Some("sk-engine"),
        "the engines' key read"
    );
    Ok(())
}

/// Issue 35: what the engine pools tell the conductor (their tensor parallel size, and the
/// directory of the one model they load from a claim) parses with the conductor's own flags,
/// and the conductor sizes the KV of one rank from that directory's `config.json` as the
/// engines split it.
#[test]
fn the_engine_pools_model_facts_reach_the_conductor() -> Result<()> {
    let pool: KVCachePool = serde_saphyr::from_str(&std::fs::read_to_string(
        repo_root().join("operator/tests/fixtures/kvcachepool-roce.yaml"),
    )?)?;
    let valid = validate(&pool, &Settings::for_tests()).context("fixture is valid")?;
    let facts = kvpool_operator::serving::ConductorFacts {
        tensor_parallel_size: Some(2),
        model_files: Some(kvpool_operator::serving::ModelFiles {
            claim: "weights".into(),
            path: "qwen".into(),
        }),
    };
    let children =
        kvpool_operator::cachepool::build::build_for(&valid, KEY_HEX, &facts).context("build")?;
    let (deployment, _) = children.conductor.as_ref().context("conductor")?;
    let dir = tempfile::tempdir()?;
    let mut files = write_files(dir.path(), &children)?;
    // The claim's model directory: 4 layers x 4 KV heads x 32 (256 / 8 heads) x 2 (K and V)
    // x 2 bytes (bfloat16) = 2048 bytes a token, 1024 on each of 2 ranks.
    let model = dir.path().join("qwen");
    std::fs::create_dir(&model)?;
    std::fs::write(
        model.join("config.json"),
        r#"{"num_hidden_layers":4,"num_attention_heads":8,"num_key_value_heads":4,
            "hidden_size":256,"torch_dtype":"bfloat16"}"#,
    )?;
    files.insert("/etc/kvpool/model/qwen".into(), model.clone());
    let argv = argv(pod_of(template(deployment))?, &files)?;
    let cli = kvpool::cli::Cli::try_parse_from(&argv).with_context(|| format!("{argv:?}"))?;
    let kvpool::cli::Command::Conductor(args) = cli.command else {
        bail!("not the conductor: {argv:?}");
    };
    ensure!(args.keys.engine_tensor_parallel_size == 2, "{argv:?}");
    ensure!(
        args.model_files.model_dir.as_deref() == Some(model.as_path()),
        "{argv:?}"
    );
    let (bytes, source) =
        kvpool_conductor::model_flags::kv_bytes_per_token(&args.model_files, &args.keys)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    ensure!(bytes == 1024, "KV bytes per token {bytes} from {source:?}");
    Ok(())
}

/// Every example set of engine pools (deploy/examples/*, and the e2e suite's pool) serves its
/// model with prefill and decode pools that agree: none would be reported `ModelMismatch`.
#[test]
fn the_example_engine_pools_serve_their_models_together() -> Result<()> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(repo_root().join("deploy/examples"))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    dirs.push(repo_root().join("tests/e2e/pool"));
    let mut seen = 0;
    for dir in dirs.iter().filter(|d| d.join("prefillpool.yaml").is_file()) {
        let read = |file: &str| std::fs::read_to_string(dir.join(file));
        let prefill: kvpool_crd::PrefillPool = serde_saphyr::from_str(&read("prefillpool.yaml")?)?;
        let decode: kvpool_crd::DecodePool = serde_saphyr::from_str(&read("decodepool.yaml")?)?;
        let pools: Vec<_> = [
            kvpool_operator::serving::serving(&prefill),
            kvpool_operator::serving::serving(&decode),
        ]
        .into_iter()
        .collect::<Option<_>>()
        .with_context(|| format!("{}: the engine pools are valid", dir.display()))?;
        let mismatches = kvpool_operator::serving::check(&pools);
        ensure!(mismatches.is_empty(), "{}: {mismatches:?}", dir.display());
        seen += 1;
    }
    ensure!(seen >= 4, "the examples were found ({seen})");
    Ok(())
}

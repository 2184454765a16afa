//! The contract between the operator and the processes it starts: every binary name, flag, port,
//! path and environment variable that appears in a generated container spec lives here, so that
//! the CLI (`kvpool agent run`, `kvpool master`, `kvpool conductor`, `kvpool operator
//! install-python`) and the engines can be checked against one list. The engine command lines
//! (vLLM, SGLang) and the names of the Python adapters they load are in [`engines`]. Documented
//! in docs/engine-contract.md. I/O boundary: none (pure data).

mod engines;

pub use engines::*;

use kvpool_crd::{EvictionConfig, Role};

/// Directory the pool ConfigMap is mounted at in every container.
pub const CONFIG_DIR: &str = "/etc/kvpool";
/// Key of the effective pool configuration in the ConfigMap (and file name under [`CONFIG_DIR`]).
pub const CONFIG_FILE_KEY: &str = "config.yaml";
/// Key of the engine-facing configuration (JSON) in the ConfigMap.
pub const ENGINE_CONFIG_KEY: &str = "engine.json";
/// Directory the pool's peer-authentication Secret is mounted at.
pub const AUTH_DIR: &str = "/etc/kvpool/auth";
/// Key of the shared peer-authentication key in the Secret (and file name under [`AUTH_DIR`]).
pub const AUTH_KEY_KEY: &str = "key";
/// Length in bytes of a generated peer-authentication key (before hex encoding).
pub const AUTH_KEY_BYTES: usize = 32;
/// Host directory (hostPath) where the agent puts its Unix socket for the engines on the node.
pub const HOST_SOCKET_DIR: &str = "/run/kvpool";
/// Where that directory is mounted inside the agent and engine containers.
pub const SOCKET_DIR: &str = "/run/kvpool";
/// File name of the agent's Unix socket inside [`SOCKET_DIR`].
pub const AGENT_SOCKET_FILE: &str = "agent.sock";
/// Directory of the agent's projected ServiceAccount token (audience
/// `kvpool_proto::issuer::AUDIENCE`), presented to the agent credential issuer.
pub const AGENT_TOKEN_DIR: &str = "/var/run/secrets/kvpool.dev/agent-token";
/// File name of that token.
pub const AGENT_TOKEN_FILE: &str = "token";
/// Lifetime the agent's projected token is asked for (the kubelet renews it at 80%); the
/// agent presents it once, at start.
pub const AGENT_TOKEN_SECONDS: i64 = 600;
/// Where the `kvpool` image carries the installed `kvpool` Python package (docker/kvpool.Dockerfile,
/// `pip install --target`), and where engine containers mount their copy of it (read-only).
pub const PYTHON_PACKAGE_DIR: &str = "/opt/kvpool/python";
/// Where the init container of an engine pod mounts the volume it copies the package into.
pub const PYTHON_STAGING_DIR: &str = "/mnt/kvpool-python";

/// Port of the admin server (/livez, /readyz, /metrics) in every kvpool container.
pub const ADMIN_PORT: u16 = 9090;
/// gRPC port of the master.
pub const MASTER_PORT: u16 = 50051;
/// HTTP port of the conductor (OpenAI-compatible front door).
pub const CONDUCTOR_PORT: u16 = 8000;
/// Default transfer-engine port of the agent (`spec.transport.port` when absent); the
/// DaemonSet's `transfer` container port is the pool's actual `spec.transport.port`.
pub const AGENT_TRANSFER_PORT: u16 = 15500;
/// HTTP port the engines serve on (OpenAI-compatible).
pub const ENGINE_PORT: u16 = 8000;
/// Port prefill engines publish their KV events on (vLLM's default); replays on the next one.
pub const KV_EVENTS_PORT: u16 = 5557;
/// `PYTHONHASHSEED` of the engines, which seeds vLLM's block hashes; the conductor gets the same.
pub const HASH_SEED: &str = "0";

/// The one kvpool executable: every container runs it with its role as the first argument
/// (`kvpool agent run`, `kvpool master`, `kvpool conductor`, `kvpool operator run`).
pub const KVPOOL_BINARY: &str = "kvpool";

/// Environment variables set on every engine container.
pub mod env {
    /// `host:port` of the pool's master Service.
    pub const MASTER: &str = "KVPOOL_MASTER";
    /// Path of the node agent's Unix socket.
    pub const AGENT_SOCKET: &str = "KVPOOL_AGENT_SOCKET";
    /// Per-frame integrity of the engine's transfer lanes (`transport.integrity`).
    pub const TRANSFER_INTEGRITY: &str = "KVPOOL_TRANSFER_INTEGRITY";
    /// `prefill` or `decode`.
    pub const ROLE: &str = "KVPOOL_ROLE";
    /// Tokens per KV cache block.
    pub const BLOCK_SIZE_TOKENS: &str = "KVPOOL_BLOCK_SIZE_TOKENS";
    /// Path of the peer-authentication key file.
    pub const AUTH_KEY_FILE: &str = "KVPOOL_AUTH_KEY_FILE";
    /// Path of the engine-facing JSON config, as the Python package's adapters read it.
    pub const ENGINE_CONFIG: &str = "KVPOOL_ENGINE_CONFIG";
    /// Name of the KVCachePool.
    pub const POOL: &str = "KVPOOL_POOL";
    /// Name of the Prefill/DecodePool the pod belongs to.
    pub const ENGINE_POOL: &str = "KVPOOL_ENGINE_POOL";
    /// Name of the node the pod runs on (downward API), for locality reporting.
    pub const NODE_NAME: &str = "KVPOOL_NODE_NAME";
    /// Pod IP (downward API): the address peers use to reach the engine.
    pub const POD_IP: &str = "KVPOOL_POD_IP";
    /// The pool's latency objective in milliseconds: TTFT for prefill, TPOT for decode.
    pub const SLO_MILLIS: &str = "KVPOOL_SLO_MILLIS";
    /// Tensor-parallel size of one engine instance.
    pub const TENSOR_PARALLEL_SIZE: &str = "KVPOOL_TENSOR_PARALLEL_SIZE";
    /// The same engine config path, under the name Mooncake-style code reads it
    /// (`MooncakeDistributedStore` setups, Mooncake's own store connectors).
    pub const MOONCAKE_CONFIG_PATH: &str = "MOONCAKE_CONFIG_PATH";
    /// Python's module search path: [`super::PYTHON_PACKAGE_DIR`] first.
    pub const PYTHONPATH: &str = "PYTHONPATH";
    /// vLLM seeds its block hashes with it (and so must the conductor, `--hash-seed`).
    pub const PYTHONHASHSEED: &str = "PYTHONHASHSEED";
}

/// Path of the agent socket inside containers.
pub fn agent_socket_path() -> String {
    format!("{SOCKET_DIR}/{AGENT_SOCKET_FILE}")
}

/// Path of the pool config file inside containers.
pub fn config_path() -> String {
    format!("{CONFIG_DIR}/{CONFIG_FILE_KEY}")
}

/// Path of the engine config file inside containers.
pub fn engine_config_path() -> String {
    format!("{CONFIG_DIR}/{ENGINE_CONFIG_KEY}")
}

/// Path of the peer-authentication key inside containers.
pub fn auth_key_path() -> String {
    format!("{AUTH_DIR}/{AUTH_KEY_KEY}")
}

fn any_addr(port: u16) -> String {
    format!("0.0.0.0:{port}")
}

/// Command (`command`) of the agent container.
pub fn agent_command() -> Vec<String> {
    vec![KVPOOL_BINARY.to_owned()]
}

/// Arguments (`args`) of the agent container: `agent run` reading the pool ConfigMap's document.
pub fn agent_args() -> Vec<String> {
    vec![
        "agent".to_owned(),
        "run".to_owned(),
        "--pool-config".to_owned(),
        config_path(),
        "--admin-listen".to_owned(),
        any_addr(ADMIN_PORT),
        "--socket-dir".to_owned(),
        SOCKET_DIR.to_owned(),
        "--node-name".to_owned(),
        format!("$({})", env::NODE_NAME),
        "--advertise-host".to_owned(),
        format!("$({})", env::POD_IP),
    ]
}

/// Arguments of the init container of every engine pod: copy the `kvpool` Python package the
/// image carries into the volume the engine container mounts at [`PYTHON_PACKAGE_DIR`].
pub fn install_python_args() -> Vec<String> {
    vec![
        "operator".to_owned(),
        "install-python".to_owned(),
        "--from".to_owned(),
        PYTHON_PACKAGE_DIR.to_owned(),
        "--to".to_owned(),
        PYTHON_STAGING_DIR.to_owned(),
    ]
}

/// Command of the master and conductor containers.
pub fn kvpool_command() -> Vec<String> {
    vec![KVPOOL_BINARY.to_owned()]
}

/// Arguments of the master container: the pool's eviction (`spec.eviction`: policy, and the
/// watermarks as fractions for both tiers) and `--replica-spread failure-domain` (agents
/// announce their node's value of `spec.replication.spreadLabelKey`); `--etcd-endpoints`
/// (comma-separated) only for HA, and then `--advertise-addr $(KVPOOL_POD_IP):50051` (the
/// kubelet substitutes the pod IP from the container's downward-API env var [`env::POD_IP`])
/// since standbys redirect clients to it. `--shared-agent-credentials` (`shared_agents`): the
/// agents share one credential, when the operator runs no agent credential issuer.
pub fn master_args(
    etcd_endpoints: &[String],
    eviction: &EvictionConfig,
    shared_agents: bool,
) -> Vec<String> {
    let high = percent_as_fraction(eviction.high_watermark_percent);
    let low = percent_as_fraction(eviction.low_watermark_percent);
    let mut args = vec![
        "master".to_owned(),
        "--listen".to_owned(),
        any_addr(MASTER_PORT),
        "--admin-listen".to_owned(),
        any_addr(ADMIN_PORT),
        "--auth-key-file".to_owned(),
        auth_key_path(),
        // The pool's own block events, in vLLM's KV event format, for any consumer that
        // indexes vLLM events (llm-d, Dynamo); replays on the next port.
        "--kv-events-config".to_owned(),
        pool_events_config(),
        "--eviction-policy".to_owned(),
        eviction.policy.as_str().to_owned(),
        "--dram-high-watermark".to_owned(),
        high.clone(),
        "--dram-low-watermark".to_owned(),
        low.clone(),
        "--ssd-high-watermark".to_owned(),
        high,
        "--ssd-low-watermark".to_owned(),
        low,
        "--replica-spread".to_owned(),
        "failure-domain".to_owned(),
    ];
    if shared_agents {
        // Without the issuer the DaemonSet's agents share one agent credential (a pod
        // template cannot carry a per-node Secret), so the master lets node-less agent
        // credentials act for any node.
        args.push("--shared-agent-credentials".to_owned());
    }
    if !etcd_endpoints.is_empty() {
        args.push("--etcd-endpoints".to_owned());
        args.push(etcd_endpoints.join(","));
        args.push("--advertise-addr".to_owned());
        args.push(format!("$({}):{MASTER_PORT}", env::POD_IP));
    }
    args
}

/// Topic of the master's pool block events.
pub const POOL_EVENTS_TOPIC: &str = "kvpool";

/// The master's `--kv-events-config`: publish on [`KV_EVENTS_PORT`], replay on the next port.
pub fn pool_events_config() -> String {
    serde_json::json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": format!("tcp://*:{KV_EVENTS_PORT}"),
        "replay_endpoint": format!("tcp://*:{}", KV_EVENTS_PORT + 1),
        "topic": POOL_EVENTS_TOPIC,
    })
    .to_string()
}

/// Label selector of the engine pods of `role` that belong to KVCachePool `pool` (the labels
/// the operator puts on PrefillPool and DecodePool pods; see `kvpool_crd::labels`).
pub fn engine_selector(pool: &str, role: Role) -> String {
    use kvpool_crd::labels::{APP_NAME, APP_NAME_VALUE, COMPONENT, POOL};
    let component = match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    };
    format!("{APP_NAME}={APP_NAME_VALUE},{POOL}={pool},{COMPONENT}={component}")
}

/// Arguments of the conductor container: listeners, SLOs (milliseconds in the spec, seconds on
/// the command line), and discovery of pool `pool`'s engine pods in `namespace` on
/// [`ENGINE_PORT`].
pub fn conductor_args(
    pool: &str,
    namespace: &str,
    master_addr: &str,
    ttft_slo_ms: u64,
    tpot_slo_ms: u64,
    model: &ConductorModel,
) -> Vec<String> {
    let mut args = vec![
        "conductor".to_owned(),
        "--listen".to_owned(),
        any_addr(CONDUCTOR_PORT),
        "--admin-listen".to_owned(),
        any_addr(ADMIN_PORT),
        "--ttft-slo".to_owned(),
        format!("{ttft_slo_ms}ms"),
        "--tpot-slo".to_owned(),
        format!("{tpot_slo_ms}ms"),
        "--discover-namespace".to_owned(),
        namespace.to_owned(),
        "--prefill-selector".to_owned(),
        engine_selector(pool, Role::Prefill),
        "--decode-selector".to_owned(),
        engine_selector(pool, Role::Decode),
        "--engine-port".to_owned(),
        ENGINE_PORT.to_string(),
        // Every prefill engine publishes its KV events there (`engines::kv_events_config`);
        // the index follows them.
        "--kv-events-port".to_owned(),
        KV_EVENTS_PORT.to_string(),
        "--hash-seed".to_owned(),
        HASH_SEED.to_owned(),
        // The pool's contents feed the prefix index: one longest-prefix lookup per request.
        "--master".to_owned(),
        master_addr.to_owned(),
        "--auth-key-file".to_owned(),
        auth_key_path(),
        // The engines' block size: the unit of the block hashes it recomputes.
        "--block-size".to_owned(),
        model.engine_block_size.to_string(),
    ];
    // The model's directory, when the engine pools load it from a claim the conductor mounts:
    // its config.json sizes the KV per token, its tokenizer.json cuts the prompts.
    if let Some(dir) = &model.model_dir {
        args.extend(["--model-dir".to_owned(), dir.clone()]);
    }
    // The model's tokenizer: the files the pool names, else the model directory's, else the
    // engines' own, asked through their /tokenize.
    match (&model.tokenizer_dir, &model.model_dir) {
        (Some(dir), _) => args.extend(["--tokenizer".to_owned(), dir.clone()]),
        (None, Some(_)) => {}
        (None, None) => args.extend(["--tokenizer".to_owned(), "engine".to_owned()]),
    }
    // The engines' parallel layout: the KV of one rank, and the pool keys' layout part.
    if let Some(tp) = model.tensor_parallel_size {
        args.extend(["--engine-tensor-parallel-size".to_owned(), tp.to_string()]);
    }
    args
}

/// What the conductor needs of the model to recompute the engines' block hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConductorModel {
    /// Tokens per KV block of the engines.
    pub engine_block_size: u32,
    /// The mounted directory of the model's tokenizer files, when the pool names them.
    pub tokenizer_dir: Option<String>,
    /// The mounted directory of the served model (config.json, tokenizer.json), when the
    /// engine pools load one model from a PersistentVolumeClaim.
    pub model_dir: Option<String>,
    /// The tensor parallel size all the engine pools agree on.
    pub tensor_parallel_size: Option<u32>,
}

/// Where the conductor's tokenizer volume is mounted.
pub const TOKENIZER_MOUNT: &str = "/etc/kvpool/tokenizer";
/// Where the conductor mounts the engine pools' model claim (read-only).
pub const MODEL_MOUNT: &str = "/etc/kvpool/model";

/// `90` -> `"0.9"`, `100` -> `"1"`, `0` -> `"0"`: exact for whole percentages.
fn percent_as_fraction(percent: u8) -> String {
    let (whole, frac) = (percent / 100, percent % 100);
    if frac == 0 {
        whole.to_string()
    } else {
        format!("{whole}.{frac:02}")
            .trim_end_matches('0')
            .to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::has_arg;

    #[test]
    fn default_transfer_port_is_the_crd_default() {
        assert_eq!(
            i32::from(AGENT_TRANSFER_PORT),
            kvpool_crd::defaults::TRANSPORT_PORT
        );
    }

    fn eviction(policy: kvpool_crd::EvictionPolicy, high: u8, low: u8) -> EvictionConfig {
        EvictionConfig {
            high_watermark_percent: high,
            low_watermark_percent: low,
            policy,
        }
    }

    fn lru() -> EvictionConfig {
        eviction(kvpool_crd::EvictionPolicy::Lru, 90, 80)
    }

    #[test]
    fn master_args_carry_the_pools_eviction_and_spread() {
        let args = master_args(
            &[],
            &eviction(kvpool_crd::EvictionPolicy::S3fifo, 95, 5),
            true,
        );
        for pair in [
            ["--eviction-policy", "s3fifo"],
            ["--dram-high-watermark", "0.95"],
            ["--dram-low-watermark", "0.05"],
            ["--ssd-high-watermark", "0.95"],
            ["--ssd-low-watermark", "0.05"],
            ["--replica-spread", "failure-domain"],
        ] {
            assert!(has_arg(&args, pair[0], pair[1]), "{pair:?} in {args:?}");
        }
        assert_eq!(percent_as_fraction(100), "1");
        assert_eq!(percent_as_fraction(0), "0");
        assert_eq!(percent_as_fraction(90), "0.9");
        assert_eq!(percent_as_fraction(7), "0.07");
    }

    #[test]
    fn the_master_publishes_pool_events_on_the_kv_events_port() {
        let args = master_args(&[], &lru(), true);
        let i = args
            .iter()
            .position(|a| a == "--kv-events-config")
            .expect("flag");
        let config: serde_json::Value = serde_json::from_str(&args[i + 1]).expect("json");
        assert_eq!(config["endpoint"], format!("tcp://*:{KV_EVENTS_PORT}"));
        assert_eq!(
            config["replay_endpoint"],
            format!("tcp://*:{}", KV_EVENTS_PORT + 1)
        );
        assert_eq!(config["topic"], POOL_EVENTS_TOPIC);
    }

    #[test]
    fn master_args_add_etcd_only_for_ha() {
        let plain = master_args(&[], &lru(), true);
        assert!(!plain.iter().any(|a| a == "--etcd-endpoints"));
        assert_eq!(plain[0], "master");
        assert!(has_arg(&plain, "--auth-key-file", "/etc/kvpool/auth/key"));
        let ha = master_args(
            &["http://a:2379".to_owned(), "http://b:2379".to_owned()],
            &lru(),
            false,
        );
        assert!(plain.iter().any(|a| a == "--shared-agent-credentials"));
        assert!(!ha.iter().any(|a| a == "--shared-agent-credentials"));
        assert!(has_arg(
            &ha,
            "--etcd-endpoints",
            "http://a:2379,http://b:2379"
        ));
        assert!(has_arg(&ha, "--advertise-addr", "$(KVPOOL_POD_IP):50051"));
        assert!(!plain.iter().any(|a| a == "--advertise-addr"));
    }

    #[test]
    fn conductor_args_carry_slos_in_seconds() {
        let model = ConductorModel {
            engine_block_size: 16,
            tokenizer_dir: None,
            model_dir: None,
            tensor_parallel_size: None,
        };
        let args = conductor_args(
            "cache",
            "llm",
            "cache-master.llm.svc:50051",
            2000,
            50,
            &model,
        );
        assert_eq!(args[0], "conductor");
        assert!(has_arg(&args, "--block-size", "16"));
        // Without tokenizer files the conductor asks the engines' /tokenize.
        assert!(has_arg(&args, "--tokenizer", "engine"));
        assert!(!args.iter().any(|a| a == "--model-dir"));
        assert!(!args.iter().any(|a| a == "--engine-tensor-parallel-size"));
        let with = ConductorModel {
            engine_block_size: 32,
            tokenizer_dir: Some("/etc/kvpool/tokenizer/m".into()),
            model_dir: None,
            tensor_parallel_size: Some(4),
        };
        let custom = conductor_args("cache", "llm", "m:1", 2000, 50, &with);
        assert!(has_arg(&custom, "--block-size", "32"));
        assert!(has_arg(&custom, "--tokenizer", "/etc/kvpool/tokenizer/m"));
        assert!(has_arg(&custom, "--engine-tensor-parallel-size", "4"));
        // The engine pools' model directory: its tokenizer, unless the pool names one.
        let from_claim = ConductorModel {
            model_dir: Some("/etc/kvpool/model/qwen".into()),
            tokenizer_dir: None,
            ..with.clone()
        };
        let claimed = conductor_args("cache", "llm", "m:1", 2000, 50, &from_claim);
        assert!(has_arg(&claimed, "--model-dir", "/etc/kvpool/model/qwen"));
        assert!(!claimed.iter().any(|a| a == "--tokenizer"));
        let both = ConductorModel {
            model_dir: Some("/etc/kvpool/model/qwen".into()),
            ..with
        };
        let both = conductor_args("cache", "llm", "m:1", 2000, 50, &both);
        assert!(has_arg(&both, "--tokenizer", "/etc/kvpool/tokenizer/m"));
        assert!(has_arg(&both, "--model-dir", "/etc/kvpool/model/qwen"));
        assert!(has_arg(&args, "--discover-namespace", "llm"));
        assert!(has_arg(
            &args,
            "--prefill-selector",
            "app.kubernetes.io/name=kvpool,kvpool.dev/pool=cache,kvpool.dev/component=prefill"
        ));
        assert!(has_arg(&args, "--engine-port", "8000"));
        assert!(has_arg(&args, "--master", "cache-master.llm.svc:50051"));
        assert!(has_arg(&args, "--auth-key-file", "/etc/kvpool/auth/key"));
        assert!(has_arg(&args, "--ttft-slo", "2000ms"));
        assert!(has_arg(&args, "--tpot-slo", "50ms"));
    }
}

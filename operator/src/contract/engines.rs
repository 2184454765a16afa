//! How the operator starts vLLM and SGLang engines: their command lines, with kvpool's Python
//! adapters (the `kvpool` package every engine pod gets at [`super::PYTHON_PACKAGE_DIR`]) as the
//! engine's KV connector or HiCache storage backend, and the SGLang bootstrap port the conductor
//! routes by. The flag and key names follow the engines' sources, named in
//! docs/engine-contract.md. I/O boundary: none (pure data).

use kvpool_crd::Role;

use super::ENGINE_PORT;

/// Class name of kvpool's vLLM KV connector (vLLM's `kv_connector`).
pub const VLLM_CONNECTOR: &str = "KvpoolStoreConnector";
/// Module vLLM imports the connector class from (vLLM's `kv_connector_module_path`).
pub const VLLM_CONNECTOR_MODULE: &str = "kvpool.adapters.vllm";
/// Name kvpool's backend goes by in SGLang's logs (`backend_name` of the dynamic backend).
pub const SGLANG_BACKEND_NAME: &str = "kvpool";
/// Module SGLang imports the HiCache storage class from (`module_path`).
pub const SGLANG_STORAGE_MODULE: &str = "kvpool.adapters.sglang";
/// Class name of kvpool's SGLang HiCache storage backend (`class_name`).
pub const SGLANG_STORAGE_CLASS: &str = "KvpoolHiCacheStorage";
/// SGLang's transfer backend for the prefill-to-decode hand-off. SGLang has no pluggable
/// transfer backend, and its HiCache storage only shares prefixes, so PD disaggregation keeps
/// Mooncake's peer-to-peer transfer engine (which needs no Mooncake master).
pub const SGLANG_TRANSFER_BACKEND: &str = "mooncake";

/// What the engine needs to know to be started with sensible disaggregation defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineLaunch<'a> {
    pub role: Role,
    pub model: &'a str,
    pub tensor_parallel_size: u32,
    /// Tokens per KV block (the pool's `conductor.engineBlockSize`): the conductor recomputes
    /// the engine's block hashes at this size.
    pub block_size: u32,
    pub user_args: &'a [String],
}

/// vLLM's `--kv-transfer-config`: kvpool's connector, loaded from its module. A prefill
/// engine both loads and saves (`kv_both`): it starts from the prefixes any engine left in the
/// pool, the reuse the pool exists for, and saves what it computes for decode and for the next
/// request. A decode engine only loads (`kv_consumer`): what it generates is not shared.
pub fn vllm_kv_transfer_config(role: Role) -> String {
    let kv_role = match role {
        Role::Prefill => "kv_both",
        Role::Decode => "kv_consumer",
    };
    serde_json::json!({
        "kv_connector": VLLM_CONNECTOR,
        "kv_connector_module_path": VLLM_CONNECTOR_MODULE,
        "kv_role": kv_role,
    })
    .to_string()
}

/// SGLang's `--hicache-storage-backend-extra-config` for `--hicache-storage-backend dynamic`:
/// the three keys SGLang's `StorageBackendFactory` requires to import kvpool's backend, and
/// `interface_v1`, which has SGLang's cache controller hand the backend host-pool pages in
/// place (without it SGLang copies page tensors, a path the adapter does not take; see
/// docs/engines.md).
pub fn sglang_storage_config() -> String {
    serde_json::json!({
        "backend_name": SGLANG_BACKEND_NAME,
        "module_path": SGLANG_STORAGE_MODULE,
        "class_name": SGLANG_STORAGE_CLASS,
        "interface_v1": 1,
    })
    .to_string()
}

/// `--kv-events-config` of a prefill engine (vLLM's and SGLang's flag of that name): publish
/// the prefix cache's stored and removed blocks on ZMQ at [`super::KV_EVENTS_PORT`], replays on
/// the next port; the conductor subscribes (`--kv-events-port`).
pub fn kv_events_config() -> String {
    serde_json::json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": format!("tcp://*:{}", super::KV_EVENTS_PORT),
        "replay_endpoint": format!("tcp://*:{}", super::KV_EVENTS_PORT + 1),
        "topic": "kv-events",
    })
    .to_string()
}

/// `command` and `args` of a vLLM engine: `vllm serve` with kvpool's connector
/// ([`vllm_kv_transfer_config`]), which reads the pool from the environment the operator sets.
/// User args come last so they override the defaults.
pub fn vllm_command_args(launch: &EngineLaunch<'_>) -> (Vec<String>, Vec<String>) {
    let mut args = vec![
        "serve".to_owned(),
        launch.model.to_owned(),
        "--host".to_owned(),
        "0.0.0.0".to_owned(),
        "--port".to_owned(),
        ENGINE_PORT.to_string(),
        "--tensor-parallel-size".to_owned(),
        launch.tensor_parallel_size.to_string(),
        "--block-size".to_owned(),
        launch.block_size.to_string(),
        "--kv-transfer-config".to_owned(),
        vllm_kv_transfer_config(launch.role),
    ];
    // Block hashes the conductor can recompute (with the pod's PYTHONHASHSEED): the pool keys
    // of every engine (docs/engine-contract.md, "Pool keys"), and a prefill engine's KV events.
    args.extend([
        "--prefix-caching-hash-algo".to_owned(),
        "sha256_cbor".to_owned(),
    ]);
    if launch.role == Role::Prefill {
        args.extend(["--kv-events-config".to_owned(), kv_events_config()]);
    }
    args.extend(launch.user_args.iter().cloned());
    (vec!["vllm".to_owned()], args)
}

/// `command` and `args` of an SGLang engine: `sglang.launch_server` in PD-disaggregation mode
/// with Mooncake's transfer engine for the prefill-to-decode hand-off, and kvpool as the HiCache
/// storage tier: a prefill engine runs HiCache over it (prefixes shared by every prefill
/// engine), a decode engine offloads the KV cache it generates into it (so the next turn's
/// prefill finds it). User args come last.
pub fn sglang_command_args(launch: &EngineLaunch<'_>) -> (Vec<String>, Vec<String>) {
    let mut args = vec![
        "-m".to_owned(),
        "sglang.launch_server".to_owned(),
        "--model-path".to_owned(),
        launch.model.to_owned(),
        "--host".to_owned(),
        "0.0.0.0".to_owned(),
        "--port".to_owned(),
        ENGINE_PORT.to_string(),
        "--tp-size".to_owned(),
        launch.tensor_parallel_size.to_string(),
        "--page-size".to_owned(),
        launch.block_size.to_string(),
        "--disaggregation-mode".to_owned(),
        launch.role.as_str().to_owned(),
        "--disaggregation-transfer-backend".to_owned(),
        SGLANG_TRANSFER_BACKEND.to_owned(),
    ];
    args.push(
        match launch.role {
            Role::Prefill => "--enable-hierarchical-cache",
            Role::Decode => "--disaggregation-decode-enable-offload-kvcache",
        }
        .to_owned(),
    );
    args.extend([
        // The host-pool layout kvpool's backend (like SGLang's Mooncake one) reads in place.
        "--hicache-mem-layout".to_owned(),
        "page_first".to_owned(),
        "--hicache-storage-backend".to_owned(),
        "dynamic".to_owned(),
        "--hicache-storage-backend-extra-config".to_owned(),
        sglang_storage_config(),
    ]);
    if launch.role == Role::Prefill {
        args.extend(["--kv-events-config".to_owned(), kv_events_config()]);
    }
    args.extend(launch.user_args.iter().cloned());
    (vec!["python3".to_owned()], args)
}

/// The bootstrap port an SGLang engine started with `user_args` serves: the value of its
/// `--disaggregation-bootstrap-port` (as `--flag N` or `--flag=N`; the last one wins, as with
/// argparse), else SGLang's default. A value that is not a port is left to SGLang to refuse;
/// the default is reported then.
pub fn sglang_bootstrap_port(user_args: &[String]) -> u16 {
    const FLAG: &str = "--disaggregation-bootstrap-port";
    let mut port = kvpool_crd::labels::SGLANG_DEFAULT_BOOTSTRAP_PORT;
    let mut args = user_args.iter();
    while let Some(a) = args.next() {
        let value = if a == FLAG {
            args.next().map(String::as_str)
        } else {
            a.strip_prefix(FLAG).and_then(|rest| rest.strip_prefix('='))
        };
        if let Some(p) = value
            .and_then(|v| v.parse::<u16>().ok())
            .filter(|p| *p != 0)
        {
            port = p;
        }
    }
    port
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::after;

    #[test]
    fn sglang_bootstrap_port_follows_the_user_args() {
        let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(sglang_bootstrap_port(&[]), 8998);
        assert_eq!(
            sglang_bootstrap_port(&args(&["--disaggregation-bootstrap-port", "9100"])),
            9100
        );
        assert_eq!(
            sglang_bootstrap_port(&args(&["--x", "--disaggregation-bootstrap-port=9200"])),
            9200
        );
        assert_eq!(
            sglang_bootstrap_port(&args(&[
                "--disaggregation-bootstrap-port=9200",
                "--disaggregation-bootstrap-port",
                "9300"
            ])),
            9300
        );
        assert_eq!(
            sglang_bootstrap_port(&args(&["--disaggregation-bootstrap-port", "many"])),
            8998
        );
        assert_eq!(
            sglang_bootstrap_port(&args(&["--disaggregation-bootstrap-port"])),
            8998
        );
    }

    /// Qwen3-8B in `role` with tensor parallelism 2, `block_size` and the user's `user_args`.
    fn qwen3_8b_on_two_gpus(role: Role, block_size: u32, user_args: &[String]) -> EngineLaunch<'_> {
        EngineLaunch {
            role,
            model: "Qwen/Qwen3-8B",
            tensor_parallel_size: 2,
            block_size,
            user_args,
        }
    }

    #[test]
    fn vllm_loads_the_kvpool_connector_in_the_role_of_the_pool() {
        let user = vec!["--max-model-len".to_owned(), "8192".to_owned()];
        let launch = qwen3_8b_on_two_gpus(Role::Decode, 32, &user);
        let (cmd, args) = vllm_command_args(&launch);
        assert_eq!(cmd, ["vllm"]);
        // The block size the conductor hashes with.
        assert_eq!(after(&args, "--block-size"), Some("32"));
        assert_eq!(&args[..2], ["serve", "Qwen/Qwen3-8B"]);
        let config: serde_json::Value =
            serde_json::from_str(after(&args, "--kv-transfer-config").expect("flag"))
                .expect("JSON");
        assert_eq!(
            config,
            serde_json::json!({
                "kv_connector": "KvpoolStoreConnector",
                "kv_connector_module_path": "kvpool.adapters.vllm",
                "kv_role": "kv_consumer",
            })
        );
        assert_eq!(&args[args.len() - 2..], user.as_slice());
        let (_, args) = vllm_command_args(&EngineLaunch {
            role: Role::Prefill,
            ..launch
        });
        assert!(
            after(&args, "--kv-transfer-config")
                .is_some_and(|c| c.contains(r#""kv_role":"kv_both""#))
        );
    }

    #[test]
    fn sglang_keeps_mooncake_for_the_hand_off_and_stores_in_kvpool() {
        let user = vec!["--page-size".to_owned(), "64".to_owned()];
        let launch = qwen3_8b_on_two_gpus(Role::Prefill, 16, &user);
        let (cmd, args) = sglang_command_args(&launch);
        assert_eq!(cmd, ["python3"]);
        assert_eq!(after(&args, "--page-size"), Some("16"));
        assert_eq!(after(&args, "--disaggregation-mode"), Some("prefill"));
        assert_eq!(
            after(&args, "--disaggregation-transfer-backend"),
            Some("mooncake")
        );
        assert_eq!(after(&args, "--tp-size"), Some("2"));
        assert!(args.iter().any(|a| a == "--enable-hierarchical-cache"));
        assert!(
            !args
                .iter()
                .any(|a| a == "--disaggregation-decode-enable-offload-kvcache")
        );
        assert_eq!(after(&args, "--hicache-storage-backend"), Some("dynamic"));
        let extra: serde_json::Value = serde_json::from_str(
            after(&args, "--hicache-storage-backend-extra-config").expect("flag"),
        )
        .expect("JSON");
        assert_eq!(
            extra,
            serde_json::json!({
                "backend_name": "kvpool",
                "module_path": "kvpool.adapters.sglang",
                "class_name": "KvpoolHiCacheStorage",
                "interface_v1": 1,
            })
        );
        assert_eq!(after(&args, "--hicache-mem-layout"), Some("page_first"));
        assert_eq!(&args[args.len() - 2..], user.as_slice());

        let (_, args) = sglang_command_args(&EngineLaunch {
            role: Role::Decode,
            ..launch
        });
        assert_eq!(after(&args, "--disaggregation-mode"), Some("decode"));
        assert!(
            args.iter()
                .any(|a| a == "--disaggregation-decode-enable-offload-kvcache")
        );
        assert!(!args.iter().any(|a| a == "--enable-hierarchical-cache"));
        assert_eq!(after(&args, "--hicache-storage-backend"), Some("dynamic"));
    }
}

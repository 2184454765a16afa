//! The engine container: the command and arguments for the engine kind (vLLM and SGLang get
//! disaggregation defaults with kvpool's adapters, custom engines run what the user wrote), the
//! contract's environment followed by the user's, GPUs and RDMA devices as extended resources,
//! and the mounts of the pool's config, key, agent socket, shared memory and the `kvpool`
//! Python package, run without privilege escalation and with every capability dropped but
//! [`ENGINE_CAPABILITIES`]. I/O boundary: none.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, EnvVar, HTTPGetAction, Probe, ResourceRequirements, SecurityContext,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kvpool_crd::EngineKind;

use super::ENGINE_PORTS;
use super::python;
use crate::contract::{self, EngineLaunch, env};
use crate::enginepool::validate::ValidEnginePool;
use crate::pod::{self, field_env, mount, plain_env};

/// The capabilities an engine keeps; every other one is dropped. `IPC_LOCK`: the transfer
/// engines that engines load (kvpool's client in direct mode, Mooncake's for SGLang's
/// prefill-to-decode hand-off, NCCL with GPUDirect RDMA) lock and register host buffers with
/// the NIC, beyond the default `RLIMIT_MEMLOCK`.
pub const ENGINE_CAPABILITIES: [&str; 1] = ["IPC_LOCK"];

/// Security context of the engine container. The root filesystem stays writable: engine images
/// write model and compilation caches (Hugging Face, torch, Triton) under their home and `/tmp`,
/// and the image is the user's.
pub fn engine_security() -> SecurityContext {
    pod::unprivileged(false, &ENGINE_CAPABILITIES)
}

/// `command` and `args` of the engine container.
pub fn command_args(p: &ValidEnginePool) -> (Option<Vec<String>>, Option<Vec<String>>) {
    let engine = &p.effective;
    let launch = EngineLaunch {
        role: engine.role,
        model: engine.model.as_deref().unwrap_or_default(),
        tensor_parallel_size: engine.tensor_parallel_size,
        block_size: p
            .pool
            .spec
            .conductor
            .engine_block_size
            .unsigned_abs()
            .max(1),
        user_args: &engine.args,
    };
    let (default_command, args) = match engine.kind {
        EngineKind::Custom => {
            let non_empty = |v: &Vec<String>| (!v.is_empty()).then(|| v.clone());
            return (non_empty(&engine.command), non_empty(&engine.args));
        }
        EngineKind::Vllm => contract::vllm_command_args(&launch),
        EngineKind::Sglang => contract::sglang_command_args(&launch),
    };
    let command = if engine.command.is_empty() {
        default_command
    } else {
        engine.command.clone()
    };
    (Some(command), Some(args))
}

/// The contract's environment, then the user's; a user variable of the same name replaces
/// the operator's (no duplicates: server-side apply treats `env` as a map keyed by name),
/// except a plain `PYTHONPATH`, which goes after the package's directory.
pub fn engine_env(p: &ValidEnginePool) -> Vec<EnvVar> {
    let mut vars = vec![
        plain_env(env::MASTER, p.pool.master_addr()),
        plain_env(env::AGENT_SOCKET, contract::agent_socket_path()),
        plain_env(env::ROLE, p.effective.role.as_str()),
        plain_env(
            env::BLOCK_SIZE_TOKENS,
            p.pool.effective.block_size_tokens.to_string(),
        ),
        plain_env(env::AUTH_KEY_FILE, contract::auth_key_path()),
        plain_env(env::ENGINE_CONFIG, contract::engine_config_path()),
        plain_env(env::MOONCAKE_CONFIG_PATH, contract::engine_config_path()),
        plain_env(env::PYTHONPATH, python::python_path(None)),
        plain_env(env::PYTHONHASHSEED, contract::HASH_SEED),
        plain_env(env::SLO_MILLIS, p.effective.slo_millis.to_string()),
        plain_env(
            env::TENSOR_PARALLEL_SIZE,
            p.effective.tensor_parallel_size.to_string(),
        ),
        plain_env(env::POOL, p.pool.name.clone()),
        plain_env(
            env::TRANSFER_INTEGRITY,
            p.pool.effective.transport.integrity.as_str(),
        ),
        plain_env(env::ENGINE_POOL, p.name.clone()),
        field_env(env::NODE_NAME, "spec.nodeName"),
        field_env(env::POD_IP, "status.podIP"),
    ];
    for user in &p.effective.env {
        match vars.iter_mut().find(|v| v.name == user.name) {
            Some(existing) if user.name == env::PYTHONPATH => {
                python::merge_python_path(existing, user);
            }
            Some(existing) => *existing = user.clone(),
            None => vars.push(user.clone()),
        }
    }
    vars
}

/// Container resources: the user's, plus GPUs and RDMA resources (requests equal limits, as
/// extended resources require).
pub fn engine_resources(p: &ValidEnginePool) -> Option<ResourceRequirements> {
    let r = &p.effective;
    let mut res = r.container.clone().unwrap_or_default();
    let mut extended: BTreeMap<String, Quantity> = r.rdma.clone();
    if r.gpus > 0 {
        extended.insert(r.gpu_resource_name.clone(), Quantity(r.gpus.to_string()));
    }
    pod::add_extended_resources(&mut res, extended);
    (res != ResourceRequirements::default()).then_some(res)
}

/// The engine container, with a readiness probe on `/health` for `vllm` and `sglang`.
pub fn engine_container(p: &ValidEnginePool) -> Container {
    let (command, args) = command_args(p);
    let probe = (p.effective.kind != EngineKind::Custom).then(|| Probe {
        http_get: Some(HTTPGetAction {
            path: Some("/health".to_owned()),
            port: IntOrString::String("http".to_owned()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(10),
        failure_threshold: Some(3),
        ..Probe::default()
    });
    Container {
        name: kvpool_crd::ENGINE_CONTAINER.to_owned(),
        image: Some(p.effective.image.clone()),
        command,
        args,
        env: Some(engine_env(p)),
        ports: Some(pod::ports(&ENGINE_PORTS)),
        resources: engine_resources(p),
        readiness_probe: probe,
        security_context: Some(engine_security()),
        volume_mounts: Some(vec![
            mount("config", contract::CONFIG_DIR, true),
            mount("auth", contract::AUTH_DIR, true),
            mount("socket", contract::SOCKET_DIR, false),
            mount("shm", "/dev/shm", false),
            python::python_mount(),
        ]),
        ..Container::default()
    }
}

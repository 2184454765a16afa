//! What `kvpool up` starts: the command line, admin address and role of every child process
//! (master, agents, prefill and decode engines, conductor) and the agents' config files (the
//! harness's `AgentConfig`), from validated settings and already chosen ports and directories.
//! Pure: nothing is started here.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use kvpool_harness::{AgentConfig, PoolConfig, master_args};
use kvpool_proto::openai::EngineProtocol;

/// Role of a child process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Master,
    Agent,
    Prefill,
    Decode,
    Conductor,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Master => "master",
            Role::Agent => "agent",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Conductor => "conductor",
        }
    }
}

/// One child process to start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChildSpec {
    /// Unique name (`agent-0`, `prefill-1`, ...): log file and messages.
    pub name: String,
    pub role: Role,
    pub program: PathBuf,
    pub args: Vec<String>,
    /// Where `/readyz` is served.
    pub admin: SocketAddr,
    /// The service address printed for users (HTTP API or gRPC), when there is one.
    pub endpoint: Option<String>,
    /// A file to write before starting (path, contents): the agent's config.
    pub config_file: Option<(PathBuf, String)>,
    /// Variables set in the child's environment (a real engine's pool address and key).
    pub env: Vec<(String, String)>,
    /// The path of `admin` that answers 200 once the child is ready (`/readyz`; vLLM's
    /// `/health`).
    pub ready_path: &'static str,
}

/// Settings of one `kvpool up` run, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct UpSettings {
    pub agents: usize,
    pub prefill: usize,
    pub decode: usize,
    pub kvpool_bin: PathBuf,
    pub dir: PathBuf,
    pub model: String,
    pub block_size: u32,
    pub chunk_bytes: usize,
    pub kv_bytes_per_token: u64,
    pub agent_dram: String,
    pub time_scale: f64,
    pub protocol: kvpool_proto::openai::EngineProtocol,
    pub sysfs_root: Option<PathBuf>,
    pub procfs_root: Option<PathBuf>,
    /// Replicas of every block the engines put (the agents' `pool.replicas`).
    pub replicas: u8,
    /// Failure domains of the agents in turn; empty: none announced.
    pub failure_domains: Vec<String>,
    /// The master's eviction and spread flags.
    pub master_flags: Vec<String>,
    /// Flags every agent gets (transfer TLS with `--tls`).
    pub agent_flags: Vec<String>,
    /// Directory of the agents' persistent DRAM tiers (agent `i` in `agent-<i>`); `None`: the
    /// tiers live in anonymous memory.
    pub dram_tiers: Option<PathBuf>,
    /// Real vLLM engines instead of the synthetic ones (`--engine vllm`).
    pub vllm: Option<super::vllm::VllmEngine>,
    /// The conductor's prefill placement policy.
    pub policy: kvpool_core::sched::Policy,
}

/// Ports handed to the children, in the order `plan` takes them.
pub fn ports_needed(s: &UpSettings) -> usize {
    // master: grpc + admin; agents: admin; engines: api + admin (prefill engines also KV
    // events + replay); conductor: api + admin; last, the master's pool events + replay.
    2 + s.agents + 2 * (s.prefill + s.decode) + 2 * s.prefill + 2 + 2
}

/// The master's `--kv-events-config`: the pool's block events (vLLM's KV event format) on
/// `events`, replays on `replay`, topic `kvpool`.
fn pool_events_config(events: SocketAddr, replay: SocketAddr) -> String {
    serde_json::json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": format!("tcp://{events}"),
        "replay_endpoint": format!("tcp://{replay}"),
        "topic": POOL_EVENTS_TOPIC,
    })
    .to_string()
}

/// Topic of the pool's block events in `kvpool up`.
pub const POOL_EVENTS_TOPIC: &str = "kvpool";

/// Where the master of `specs` publishes the pool's block events: (endpoint, replay endpoint),
/// read back from its `--kv-events-config`.
pub fn pool_events(specs: &[ChildSpec]) -> Option<(String, Option<String>)> {
    kv_events(specs.iter().find(|s| s.role == Role::Master)?)
}

/// Where `child` publishes KV events: (endpoint, replay endpoint) of its `--kv-events-config`,
/// a wildcard host (what vLLM binds) read as 127.0.0.1.
pub fn kv_events(child: &ChildSpec) -> Option<(String, Option<String>)> {
    let i = child.args.iter().position(|a| a == "--kv-events-config")?;
    let config: serde_json::Value = serde_json::from_str(child.args.get(i + 1)?).ok()?;
    let local = |v: &serde_json::Value| {
        v.as_str()
            .map(|e| e.replace("tcp://*:", "tcp://127.0.0.1:"))
    };
    Some((
        local(&config["endpoint"])?,
        local(&config["replay_endpoint"]),
    ))
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// The socket of agent `i`.
pub fn agent_socket(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("agent-{i}"))
        .join("run")
        .join(kvpool_harness::agent::SOCKET_NAME)
}

/// The pool key file (the master's, and `up`'s own for its summary).
pub fn key_file(dir: &Path) -> PathBuf {
    dir.join("auth.key")
}

/// The credential file of `role` (derived from the pool key; see
/// `kvpool_client::credentials`): agents get the agent's, the conductor the conductor's.
pub fn role_key_file(dir: &Path, role: kvpool_proto::auth::Role) -> PathBuf {
    dir.join(format!("auth-{role}.json"))
}

/// The node name of agent `i`.
pub fn agent_node(i: usize) -> String {
    format!("up-agent-{i}")
}

/// The credential file of agent `i`: the agent role bound to its node ([`agent_node`]), so it
/// can mount and heartbeat for its own node only.
pub fn agent_key_file(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("auth-agent-{i}.json"))
}

fn agent_config(s: &UpSettings, i: usize, admin: SocketAddr, master: SocketAddr) -> String {
    AgentConfig {
        node_name: agent_node(i),
        dram: s.agent_dram.clone(),
        socket_dir: s.dir.join(format!("agent-{i}")).join("run"),
        admin_listen: admin.to_string(),
        sysfs_root: s.sysfs_root.clone(),
        procfs_root: s.procfs_root.clone(),
        pool: Some(PoolConfig {
            master: vec![master.to_string()],
            auth_key_file: agent_key_file(&s.dir, i),
            heartbeat_interval: "500ms".into(),
            transport_listen: "127.0.0.1:0".into(),
            settings: std::iter::once(format!("replicas: {}", s.replicas))
                .chain((!s.failure_domains.is_empty()).then(|| {
                    format!(
                        "failure_domain: \"{}\"",
                        s.failure_domains[i % s.failure_domains.len()]
                    )
                }))
                .collect(),
        }),
        sections: String::new(),
    }
    .to_yaml()
}

/// The flags an engine and the conductor share: their two listeners, and the model and block
/// shape they must agree on.
fn http_service_args(s: &UpSettings, api: SocketAddr, admin: SocketAddr) -> Vec<String> {
    vec![
        "--listen".into(),
        api.to_string(),
        "--admin-listen".into(),
        admin.to_string(),
        "--model".into(),
        s.model.clone(),
        "--block-size".into(),
        s.block_size.to_string(),
        "--chunk-bytes".into(),
        s.chunk_bytes.to_string(),
    ]
}

/// Every child in start order (master, agents, engines, conductor), using `ports` in order
/// (at least `ports_needed`; missing ones are reported as `None`).
pub fn plan(s: &UpSettings, ports: &[u16]) -> Option<Vec<ChildSpec>> {
    let needed = ports_needed(s);
    let (events, replay) = match ports.get(needed - 2..needed)? {
        &[e, r] => (addr(e), addr(r)),
        _ => return None,
    };
    let mut ports = ports.iter().copied();
    let mut next = || ports.next().map(addr);
    let mut out = Vec::new();
    let (grpc, master_admin) = (next()?, next()?);
    out.push(ChildSpec {
        name: "master".into(),
        role: Role::Master,
        program: s.kvpool_bin.clone(),
        args: std::iter::once("master".to_owned())
            .chain(master_args(grpc, master_admin, &key_file(&s.dir)))
            .chain(s.master_flags.iter().cloned())
            .chain([
                "--kv-events-config".to_owned(),
                pool_events_config(events, replay),
            ])
            .collect(),
        admin: master_admin,
        endpoint: Some(grpc.to_string()),
        config_file: None,
        env: Vec::new(),
        ready_path: "/readyz",
    });
    for i in 0..s.agents {
        let admin = next()?;
        let path = s.dir.join(format!("agent-{i}")).join("agent.yaml");
        out.push(ChildSpec {
            name: format!("agent-{i}"),
            role: Role::Agent,
            program: s.kvpool_bin.clone(),
            args: [
                "agent".into(),
                "run".into(),
                "--config".into(),
                path.display().to_string(),
            ]
            .into_iter()
            .chain(s.dram_tiers.iter().flat_map(|d| {
                [
                    "--dram-persistence-path".to_owned(),
                    d.join(format!("agent-{i}")).display().to_string(),
                ]
            }))
            .chain(s.agent_flags.iter().cloned())
            .collect(),
            admin,
            endpoint: Some(agent_socket(&s.dir, i).display().to_string()),
            config_file: Some((path, agent_config(s, i, admin, grpc))),
            env: Vec::new(),
            ready_path: "/readyz",
        });
    }
    let mut prefill_urls = Vec::new();
    let mut decode_urls = Vec::new();
    let mut kv_events = Vec::new();
    let engines = (0..s.prefill)
        .map(|i| (Role::Prefill, i))
        .chain((0..s.decode).map(|i| (Role::Decode, i)));
    for (n, (role, i)) in engines.enumerate() {
        let (api, admin) = (next()?, next()?);
        let url = format!("http://{api}");
        match role {
            Role::Prefill => prefill_urls.push(url.clone()),
            _ => decode_urls.push(url.clone()),
        }
        // Engines are spread over the agents in turn.
        let socket = agent_socket(&s.dir, n % s.agents.max(1));
        if let Some(v) = &s.vllm {
            let events = if role == Role::Prefill {
                let (events, replay) = (next()?, next()?);
                kv_events.push(format!("{url}=tcp://{events},tcp://{replay}"));
                Some((events, replay))
            } else {
                None
            };
            let engine_key = role_key_file(&s.dir, kvpool_proto::auth::Role::Engine);
            let site = super::vllm::EngineSite {
                prefill: role == Role::Prefill,
                block_size: s.block_size,
                api,
                kv_events: events,
                master: grpc,
                agent_socket: &socket,
                engine_key: &engine_key,
            };
            let cmd = super::vllm::engine_command(v, &site);
            // vLLM serves its metrics and its health on its API port; `admin` stays unused.
            out.push(ChildSpec {
                name: format!("{}-{i}", role.as_str()),
                role,
                program: cmd.program,
                args: cmd.args,
                admin: api,
                endpoint: Some(url),
                config_file: None,
                env: cmd.env,
                ready_path: "/health",
            });
            continue;
        }
        let mut args = vec!["engine".into(), "--synthetic".into()];
        args.extend(http_service_args(s, api, admin));
        args.extend([
            "--time-scale".into(),
            s.time_scale.to_string(),
            "--agent-socket".into(),
            socket.display().to_string(),
            "--kv-bytes-per-token".into(),
            s.kv_bytes_per_token.to_string(),
        ]);
        if role == Role::Prefill {
            // Prefill engines publish their prefix cache's changes (vLLM's KV events), which
            // the conductor's index follows.
            let (events, replay) = (next()?, next()?);
            args.extend([
                "--kv-events-config".into(),
                serde_json::json!({
                    "enable_kv_cache_events": true,
                    "publisher": "zmq",
                    "endpoint": format!("tcp://{events}"),
                    "replay_endpoint": format!("tcp://{replay}"),
                })
                .to_string(),
            ]);
            kv_events.push(format!("{url}=tcp://{events},tcp://{replay}"));
        }
        if s.protocol == EngineProtocol::Sglang {
            args.extend([
                "--protocol".into(),
                "sglang".into(),
                "--disaggregation-mode".into(),
                role.as_str().into(),
            ]);
        }
        out.push(ChildSpec {
            name: format!("{}-{i}", role.as_str()),
            role,
            program: s.kvpool_bin.clone(),
            args,
            admin,
            endpoint: Some(url),
            config_file: None,
            env: Vec::new(),
            ready_path: "/readyz",
        });
    }
    let (api, admin) = (next()?, next()?);
    let mut args = vec!["conductor".into()];
    args.extend(http_service_args(s, api, admin));
    args.extend([
        // The conductor asks the master which prompt blocks the engines left in the pool.
        "--master".into(),
        grpc.to_string(),
        "--auth-key-file".into(),
        role_key_file(&s.dir, kvpool_proto::auth::Role::Conductor)
            .display()
            .to_string(),
    ]);
    match &s.vllm {
        Some(v) => args.extend(super::vllm::conductor_args(v)),
        // The synthetic engines name their blocks kvpool/synthetic/<model>/<key>.
        None => args.extend([
            "--pool-keys".into(),
            "synthetic".into(),
            "--kv-bytes-per-token".into(),
            s.kv_bytes_per_token.to_string(),
        ]),
    }
    // The conductor's clock and the engines' measured fetch times in cost-model seconds.
    if s.time_scale > 0.0 && s.vllm.is_none() {
        args.extend(["--time-scale".into(), s.time_scale.to_string()]);
    }
    if s.protocol == EngineProtocol::Sglang {
        args.extend(["--engine-protocol".into(), "sglang".into()]);
    }
    args.extend(["--policy".into(), s.policy.name().into()]);
    for url in &prefill_urls {
        args.extend(["--prefill".into(), url.clone()]);
    }
    for url in &decode_urls {
        args.extend(["--decode".into(), url.clone()]);
    }
    for source in kv_events {
        args.extend(["--kv-events".into(), source]);
    }
    out.push(ChildSpec {
        name: "conductor".into(),
        role: Role::Conductor,
        program: s.kvpool_bin.clone(),
        args,
        admin,
        endpoint: Some(format!("http://{api}")),
        config_file: None,
        env: Vec::new(),
        ready_path: "/readyz",
    });
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn settings() -> UpSettings {
        UpSettings {
            agents: 2,
            prefill: 2,
            decode: 1,
            kvpool_bin: "/bin/kvpool".into(),
            dir: "/run/up".into(),
            model: "m".into(),
            block_size: 512,
            chunk_bytes: 4,
            kv_bytes_per_token: 64,
            agent_dram: "64MiB".into(),
            time_scale: 0.1,
            protocol: EngineProtocol::Vllm,
            sysfs_root: None,
            procfs_root: None,
            replicas: 2,
            failure_domains: vec!["rack-a".into()],
            master_flags: vec!["--eviction-policy".into(), "s3fifo".into()],
            agent_flags: Vec::new(),
            dram_tiers: Some("/dev/shm/up".into()),
            vllm: None,
            policy: kvpool_core::sched::Policy::Conductor,
        }
    }

    #[test]
    fn the_policy_reaches_the_conductor_only() {
        let mut s = settings();
        let ports: Vec<u16> = (1..=ports_needed(&s) as u16).collect();
        for policy in kvpool_core::sched::Policy::ALL {
            s.policy = policy;
            let p = plan(&s, &ports).unwrap();
            let conductor = p.last().unwrap();
            let at = conductor.args.iter().position(|a| a == "--policy");
            assert_eq!(
                at.and_then(|i| conductor.args.get(i + 1))
                    .map(String::as_str),
                Some(policy.name()),
                "{:?}",
                conductor.args
            );
            assert!(
                p[..p.len() - 1]
                    .iter()
                    .all(|c| !c.args.iter().any(|a| a == "--policy"))
            );
        }
    }

    #[test]
    fn plan_wires_engines_to_agents_and_conductor_to_engines() {
        let s = settings();
        let n = ports_needed(&s);
        assert_eq!(n, 2 + 2 + 6 + 4 + 2 + 2);
        assert!(plan(&s, &[1; 5]).is_none());
        assert!(plan(&s, &vec![1; n - 1]).is_none());
        let ports: Vec<u16> = (1000..1000 + n as u16).collect();
        let p = plan(&s, &ports).unwrap();
        let names: Vec<&str> = p.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "master",
                "agent-0",
                "agent-1",
                "prefill-0",
                "prefill-1",
                "decode-0",
                "conductor"
            ]
        );
        // Every admin address is distinct.
        let mut admins: Vec<_> = p.iter().map(|c| c.admin).collect();
        admins.dedup();
        assert_eq!(admins.len(), p.len());
        let agent = &p[1];
        // Every child is this executable with its role first; no sibling binary is looked up.
        assert!(p.iter().all(|c| c.program == Path::new("/bin/kvpool")));
        assert_eq!(
            agent.args,
            [
                "agent",
                "run",
                "--config",
                "/run/up/agent-0/agent.yaml",
                "--dram-persistence-path",
                "/dev/shm/up/agent-0"
            ]
        );
        let (path, cfg) = agent.config_file.as_ref().unwrap();
        assert_eq!(path, Path::new("/run/up/agent-0/agent.yaml"));
        assert!(cfg.contains("master: [\"127.0.0.1:1000\"]"), "{cfg}");
        assert!(
            cfg.contains("auth_key_file: /run/up/auth-agent-0.json"),
            "{cfg}"
        );
        assert!(cfg.contains("listen: 127.0.0.1:1002"), "{cfg}");
        assert!(!cfg.contains("discovery"));
        // The pool's replication and the agent's failure domain reach its config, the
        // eviction flags the master's command line.
        assert!(cfg.contains("  replicas: 2\n"), "{cfg}");
        assert!(cfg.contains("  failure_domain: \"rack-a\"\n"), "{cfg}");
        assert!(
            p[0].args
                .windows(2)
                .any(|w| w == ["--eviction-policy", "s3fifo"]),
            "{:?}",
            p[0].args
        );
        // prefill-1 is the second engine: agent-1; decode-0 the third: agent-0 again.
        let socket_of = |c: &ChildSpec| {
            let i = c.args.iter().position(|a| a == "--agent-socket").unwrap();
            c.args[i + 1].clone()
        };
        assert_eq!(socket_of(&p[4]), "/run/up/agent-1/run/agent.sock");
        assert_eq!(socket_of(&p[5]), "/run/up/agent-0/run/agent.sock");
        let conductor = p.last().unwrap();
        let joined = conductor.args.join(" ");
        assert!(
            joined.contains("--prefill http://127.0.0.1:1004 --prefill http://127.0.0.1:1008 --decode http://127.0.0.1:1012"),
            "{joined}"
        );
        // The conductor follows each prefill engine's KV events on the ports it publishes on.
        assert!(
            joined.contains(
                "--kv-events http://127.0.0.1:1004=tcp://127.0.0.1:1006,tcp://127.0.0.1:1007"
            ),
            "{joined}"
        );
        let events = p[3].args.join(" ");
        assert!(
            events.contains(r#""endpoint":"tcp://127.0.0.1:1006""#)
                && events.contains(r#""replay_endpoint":"tcp://127.0.0.1:1007""#),
            "{events}"
        );
        assert!(
            !p[5].args.join(" ").contains("--kv-events-config"),
            "decode engines publish none"
        );
        assert!(
            joined.contains("--master 127.0.0.1:1000 --auth-key-file /run/up/auth-conductor.json"),
            "the conductor reads the pool through the master, with its own credential: {joined}"
        );
        assert_eq!(conductor.endpoint.as_deref(), Some("http://127.0.0.1:1014"));
    }

    #[test]
    fn discovery_roots_reach_the_agent_config() {
        let mut s = settings();
        s.sysfs_root = Some("/fx/sys".into());
        let ports: Vec<u16> = (1..=ports_needed(&s) as u16).collect();
        let p = plan(&s, &ports).unwrap();
        let (_, cfg) = p[1].config_file.as_ref().unwrap();
        assert!(cfg.contains("discovery:\n  sysfs_root: /fx/sys\n"), "{cfg}");
        assert!(!cfg.contains("procfs_root"));
    }

    #[test]
    fn sglang_protocol_reaches_engines_and_conductor_and_the_time_scale_the_conductor() {
        let mut s = settings();
        let ports: Vec<u16> = (1..=ports_needed(&s) as u16).collect();
        let p = plan(&s, &ports).unwrap();
        let conductor = p.last().unwrap().args.join(" ");
        assert!(conductor.contains("--time-scale 0.1"), "{conductor}");
        assert!(!conductor.contains("--engine-protocol"), "{conductor}");
        assert!(!p[3].args.iter().any(|a| a == "--protocol"));

        s.protocol = EngineProtocol::Sglang;
        let p = plan(&s, &ports).unwrap();
        let args = |name: &str| {
            p.iter()
                .find(|c| c.name == name)
                .map(|c| c.args.join(" "))
                .unwrap()
        };
        assert!(
            args("prefill-1").ends_with("--protocol sglang --disaggregation-mode prefill"),
            "{}",
            args("prefill-1")
        );
        assert!(
            args("decode-0").ends_with("--protocol sglang --disaggregation-mode decode"),
            "{}",
            args("decode-0")
        );
        assert!(
            args("conductor").contains("--engine-protocol sglang"),
            "{}",
            args("conductor")
        );
        // A time scale of 0 (as fast as possible) is not passed on: the conductor keeps 1.
        s.time_scale = 0.0;
        let p = plan(&s, &ports).unwrap();
        assert!(!p.last().unwrap().args.iter().any(|a| a == "--time-scale"));
    }

    #[test]
    fn the_master_publishes_the_pools_block_events_on_the_last_two_ports() {
        let s = settings();
        let n = ports_needed(&s);
        let ports: Vec<u16> = (1000..1000 + n as u16).collect();
        let p = plan(&s, &ports).unwrap();
        let (events, replay) = pool_events(&p).expect("the master publishes");
        assert_eq!(events, format!("tcp://127.0.0.1:{}", ports[n - 2]));
        assert_eq!(replay, Some(format!("tcp://127.0.0.1:{}", ports[n - 1])));
        // No other child got those ports.
        for c in &p[1..] {
            let args = c.args.join(" ");
            assert!(
                !args.contains(&format!(":{}", ports[n - 2])),
                "{}: {args}",
                c.name
            );
        }
    }
}

#[cfg(test)]
mod vllm_tests {
    use super::*;

    #[test]
    fn vllm_engines_get_the_connector_the_pool_and_a_health_check() {
        let mut s = super::tests::settings();
        (s.model, s.replicas, s.failure_domains, s.dram_tiers) = ("tiny".into(), 1, vec![], None);
        s.vllm = Some(super::super::vllm::VllmEngine {
            python: "/venv/bin/python".into(),
            model_dir: "/models/tiny".into(),
            extra_args: vec!["--enforce-eager".into()],
        });
        s.block_size = 32;
        let ports: Vec<u16> = (1000..1000 + ports_needed(&s) as u16).collect();
        let p = plan(&s, &ports).expect("enough ports");
        let get = |name: &str| p.iter().find(|c| c.name == name).expect(name);
        let prefill = get("prefill-0");
        assert_eq!(prefill.program, PathBuf::from("/venv/bin/python"));
        assert_eq!(prefill.ready_path, "/health");
        assert_eq!(
            prefill.admin.to_string(),
            prefill.endpoint.as_ref().unwrap()[7..]
        );
        let args = prefill.args.join(" ");
        assert!(args.starts_with("-m kvpool.vllm_serve /models/tiny --served-model-name tiny"));
        assert!(args.contains(r#""kv_role":"kv_both""#), "{args}");
        assert!(
            args.contains("--prefix-caching-hash-algo sha256_cbor"),
            "{args}"
        );
        assert!(args.contains("--kv-events-config"), "{args}");
        assert!(args.ends_with("--enforce-eager"), "{args}");
        let env: std::collections::HashMap<_, _> = prefill.env.iter().cloned().collect();
        assert_eq!(env["KVPOOL_MASTER"], "127.0.0.1:1000");
        assert_eq!(env["KVPOOL_AUTH_KEY_FILE"], "/run/up/auth-engine.json");
        assert_eq!(env["PYTHONHASHSEED"], "0");
        assert!(env["KVPOOL_AGENT_SOCKET"].ends_with("agent-0/run/agent.sock"));
        let decode = get("decode-0").args.join(" ");
        assert!(decode.contains(r#""kv_role":"kv_consumer""#), "{decode}");
        assert!(!decode.contains("--kv-events-config"), "{decode}");
        let conductor = get("conductor").args.join(" ");
        for want in [
            // The model directory: tokenizer, chat template and KV bytes per token.
            "--model-dir /models/tiny --engine-tensor-parallel-size 1",
            "--pool-keys vllm",
            "--hash-seed 0",
            "--block-size 32",
            "--model tiny",
        ] {
            assert!(conductor.contains(want), "{want}: {conductor}");
        }
        assert!(!conductor.contains("--time-scale 0.1"), "{conductor}");
        assert!(!conductor.contains("--kv-bytes-per-token"), "{conductor}");
    }
}

//! The configuration and command lines the harness gives kvpool children, without starting
//! any: the agent's YAML (what `kvpool agent run` parses), the master's flags, the cleared
//! environment.

use std::path::Path;

use kvpool_harness::{AgentSpec, MasterSpec, kvpool_command};

/// The arguments of a command, as strings.
fn args_of(cmd: &std::process::Command) -> Vec<String> {
    cmd.get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

#[test]
fn agent_config_has_every_section_asked_for() {
    let master = "127.0.0.1:7000".parse().expect("addr");
    let spec = AgentSpec::new("/bin/kvpool", "/d/agent-a", "agent-a", "8MiB")
        .fixture(Path::new("/fx"))
        .pool(master, Path::new("/d/key"), "200ms")
        .pool_setting("replicas: 2")
        .section("ssd:\n  path: /d/ssd\n  capacity: 8MiB\n");
    assert_eq!(
        spec.config.to_yaml(),
        "node_name: agent-a\n\
         discovery:\n  sysfs_root: /fx/sys\n  procfs_root: /fx/proc\n\
         dram:\n  capacity: 8MiB\n  lock: false\n\
         engine_api:\n  socket_dir: /d/agent-a/run\n\
         admin:\n  listen: 127.0.0.1:0\n\
         pool:\n  master: [\"127.0.0.1:7000\"]\n  auth_key_file: /d/key\n  transport_listen: 127.0.0.1:0\n  heartbeat_interval: 200ms\n  replicas: 2\n\
         ssd:\n  path: /d/ssd\n  capacity: 8MiB\n"
    );
    assert_eq!(spec.socket(), Path::new("/d/agent-a/run/agent.sock"));
    let cmd = spec.args(["--log-format", "json"]).command();
    let args = args_of(&cmd);
    assert_eq!(
        args,
        [
            "agent",
            "run",
            "--config",
            "/d/agent-a/agent.yaml",
            "--log-format",
            "json"
        ]
    );
    // A local agent has no pool section, and no discovery unless asked.
    let local = AgentSpec::new("/bin/kvpool", "/d/l", "l", "16MiB")
        .config
        .to_yaml();
    assert!(
        !local.contains("pool:") && !local.contains("discovery"),
        "{local}"
    );
}

#[test]
fn master_flags_name_its_ports_and_key_and_the_environment_is_cleared() {
    let spec = MasterSpec::new("/bin/kvpool", "/d/key")
        .expect("ports")
        .args(["--tick-interval", "100ms"]);
    let cmd = spec.command();
    let args = args_of(&cmd);
    assert_eq!(
        args,
        [
            "master".to_owned(),
            "--listen".into(),
            spec.grpc.to_string(),
            "--admin-listen".into(),
            spec.admin.to_string(),
            "--auth-key-file".into(),
            "/d/key".into(),
            "--tick-interval".into(),
            "100ms".into(),
        ]
    );
    assert_ne!(spec.grpc, spec.admin);
    let removed: Vec<_> = kvpool_command(Path::new("/bin/kvpool"))
        .get_envs()
        .filter(|(_, v)| v.is_none())
        .map(|(k, _)| k.to_string_lossy().into_owned())
        .collect();
    assert!(
        removed.iter().any(|k| k == "KVPOOL_AUTH_KEY_FILE"),
        "{removed:?}"
    );
    assert!(removed.iter().any(|k| k == "POD_IP"), "{removed:?}");
}

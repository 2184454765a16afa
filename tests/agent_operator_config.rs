//! The operator's pool documents (the KVCachePool ConfigMap's config.yaml, golden copies written
//! by operator/tests/contract.rs from the operator's real build() output) pass
//! `kvpool agent check-config --pool-config`, run as a child process like the DaemonSet runs it.
//! I/O boundary: the fixture files and the `kvpool` binary.

use std::path::Path;
use std::process::Command;

#[test]
fn check_config_accepts_every_operator_pool_document() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("agent/tests/fixtures/operator");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("fixture dir")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    assert!(
        files.len() >= 4,
        "expected the operator's examples in {dir:?}"
    );
    for file in files {
        let out = Command::new(env!("CARGO_BIN_EXE_kvpool"))
            .arg("agent")
            .arg("check-config")
            .arg("--pool-config")
            .arg(&file)
            .env("KVPOOL_NODE_NAME", "node-a")
            .env("NODE_NAME", "node-a")
            .env("POD_IP", "10.1.2.3")
            .env_remove("KVPOOL_AGENT_CONFIG")
            .env_remove("KVPOOL_MASTER")
            .output()
            .expect("run kvpool agent");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}: check-config failed: {}{stdout}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        // Pool mode against the pool's master Service.
        assert!(stdout.contains("-master."), "{}: {stdout}", file.display());
    }
}

#[test]
fn check_config_rejects_a_broken_pool_document_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("config.yaml");
    std::fs::write(&file, "pool: x\nnamespace: y\n").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_kvpool"))
        .arg("agent")
        .arg("check-config")
        .arg("--pool-config")
        .arg(&file)
        .env("POD_IP", "10.1.2.3")
        .output()
        .expect("run kvpool agent");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("config.yaml"), "{stderr}");
}

//! vLLM's block hashes as `kvpool blocks` computes them, against the same hashes computed
//! independently in Python (tests/python/vllm_events.py: hashlib and cbor2 from vLLM's
//! documented algorithm, no kvpool code): three prompts, two block sizes, a LoRA adapter and
//! a non-default PYTHONHASHSEED. I/O boundary: child processes (the kvpool binary, Python from
//! .tools/py, which scripts/python-env.sh --tools installs).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{Value, json};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn python() -> PathBuf {
    let p = root().join(".tools/py/bin/python");
    assert!(
        p.exists(),
        "{} is missing: run scripts/python-env.sh --tools (scripts/test.sh does)",
        p.display()
    );
    p
}

/// The Python side's answer to one `hashes` command.
fn python_hashes(tokens: &[u32], block_size: u32, seed: &str, lora: Option<&str>) -> Value {
    let mut child = Command::new(python())
        .arg(root().join("tests/python/vllm_events.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start python");
    let cmd = json!({"op": "hashes", "tokens": tokens, "block_size": block_size,
                     "seed": seed, "lora_name": lora});
    let mut stdin = child.stdin.take().expect("stdin");
    writeln!(stdin, "{cmd}").expect("write command");
    drop(stdin);
    let out = child.wait_with_output().expect("python output");
    assert!(out.status.success(), "python failed: {out:?}");
    let text = String::from_utf8(out.stdout).expect("utf-8");
    // First line: the publisher's ports; second: the answer.
    let answer = text.lines().nth(1).expect("an answer line");
    serde_json::from_str(answer).expect("json answer")
}

fn kvpool_blocks(tokens: &[u32], block_size: u32, seed: &str, lora: Option<&str>) -> Value {
    let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvpool"));
    cmd.args(["blocks", "--json", "--token-ids", &ids.join(",")])
        .args(["--block-size", &block_size.to_string(), "--hash-seed", seed])
        .env_remove("PYTHONHASHSEED");
    if let Some(l) = lora {
        cmd.args(["--lora-name", l]);
    }
    let out = cmd.output().expect("run kvpool blocks");
    assert!(out.status.success(), "kvpool blocks failed: {out:?}");
    serde_json::from_slice(&out.stdout).expect("json report")
}

fn check(tokens: &[u32], block_size: u32, seed: &str, lora: Option<&str>) {
    let want = python_hashes(tokens, block_size, seed, lora);
    let got = kvpool_blocks(tokens, block_size, seed, lora);
    let want = want["blocks"].as_array().expect("python blocks");
    let got = got["blocks"].as_array().expect("kvpool blocks");
    assert_eq!(
        got.len(),
        tokens.len() / block_size as usize,
        "one hash per full block"
    );
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let case = format!(
            "block {i} of {} tokens, size {block_size}, seed {seed:?}, lora {lora:?}",
            tokens.len()
        );
        assert_eq!(g["hash_hex"], w["hash_hex"], "{case}");
        assert_eq!(g["hash_u64"], w["hash_u64"], "{case}");
    }
}

#[test]
fn kvpool_blocks_matches_vllm_hashes_computed_in_python() {
    // A short prompt, one with large token ids (multi-byte CBOR integers), one long.
    let short: Vec<u32> = (1..=40).collect();
    let large: Vec<u32> = (0..70).map(|i| 100_000 + i * 7919).collect();
    let long: Vec<u32> = (0..600).map(|i| (i * 31 + 7) % 151_000).collect();
    for tokens in [&short, &large, &long] {
        for block_size in [16, 32] {
            check(tokens, block_size, "0", None);
        }
    }
    check(&short, 16, "12345", None);
    check(&large, 16, "0", Some("sql-adapter"));
}

//! vLLM's block hashes as `kvpool blocks` computes them, against the same hashes computed
//! independently in Python (tests/python/vllm_events.py: hashlib and cbor2 from vLLM's
//! documented algorithm, no kvpool code): three prompts, two block sizes, a LoRA adapter and
//! a non-default PYTHONHASHSEED; and chat requests rendered with a chat template (Jinja2 in
//! tests/python/chat_render.py, minijinja in kvpool) and tokenised by a word-level vocabulary
//! before hashing. I/O boundary: child processes (the kvpool binary, Python from
//! .tools/py, which scripts/python-env.sh --tools installs).

mod py_support;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use py_support::python;
use serde_json::{Value, json};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// What the Python script `script` of tests/python prints, given `input` on its standard input.
fn run_python(script: &str, input: &str) -> String {
    let mut child = Command::new(python())
        .arg(root().join("tests/python").join(script))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start python");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(input.as_bytes()).expect("write input");
    drop(stdin);
    let out = child.wait_with_output().expect("python output");
    assert!(out.status.success(), "{script} failed: {out:?}");
    String::from_utf8(out.stdout).expect("utf-8")
}

/// The Python side's answer to one `hashes` command.
fn python_hashes(tokens: &[u32], block_size: u32, seed: &str, lora: Option<&str>) -> Value {
    let cmd = json!({"op": "hashes", "tokens": tokens, "block_size": block_size,
                     "seed": seed, "lora_name": lora});
    let text = run_python("vllm_events.py", &format!("{cmd}\n"));
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

/// A chat template in the shape real ones have: BOS, a default system prompt, slices, `trim`,
/// a role check with `raise_exception`, whitespace control and the generation prompt.
const CHAT_TEMPLATE: &str = "{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set rest = messages[1:] %}
{%- else %}
    {%- set system = 'you answer in short sentences .' %}
    {%- set rest = messages %}
{%- endif %}
<|start|> system <|sep|> {{ system }} <|end|>
{% for m in rest %}
    {% if m['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('roles must be user or assistant') }}
    {% endif %}
<|start|> {{ m['role'] }} <|sep|> {{ m['content'] | trim }} <|end|>
{% endfor %}
{% if add_generation_prompt %}
<|start|> assistant <|sep|>
{% endif %}";

const SPECIAL: [&str; 4] = ["<|bos|>", "<|start|>", "<|sep|>", "<|end|>"];

/// A word-level tokenizer (special tokens, [UNK], the words below) and the chat template, as
/// a model directory: tokenizer.json and tokenizer_config.json.
fn chat_model_dir(words: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let vocab = chat_vocab(words);
    let added: Vec<Value> = SPECIAL
        .iter()
        .map(|s| {
            json!({"id": vocab[*s], "content": s, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).expect("write");
    let config = json!({"bos_token": "<|bos|>", "eos_token": "<|end|>",
                        "chat_template": CHAT_TEMPLATE});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).expect("write");
    dir
}

fn chat_vocab(words: &[&str]) -> serde_json::Map<String, Value> {
    let mut all: Vec<&str> = SPECIAL.to_vec();
    all.push("[UNK]");
    all.extend(words);
    all.dedup();
    let mut vocab = serde_json::Map::new();
    for w in all {
        let next = vocab.len();
        vocab.entry(w.to_owned()).or_insert(json!(next));
    }
    vocab
}

/// The Python side: tests/python/chat_render.py renders and tokenises, then
/// tests/python/vllm_events.py hashes.
fn python_chat(messages: &Value, words: &[&str]) -> (Vec<u32>, Value) {
    let req = json!({"template": CHAT_TEMPLATE, "messages": messages,
                     "add_generation_prompt": true, "bos_token": "<|bos|>",
                     "eos_token": "<|end|>", "vocab": chat_vocab(words), "unk": "[UNK]",
                     "special": SPECIAL});
    let text = run_python("chat_render.py", &req.to_string());
    let answer: Value = serde_json::from_str(&text).expect("json answer");
    let tokens: Vec<u32> = answer["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("id") as u32)
        .collect();
    let hashes = python_hashes(&tokens, 16, "0", None);
    (tokens, hashes)
}

#[test]
fn chat_requests_hash_as_the_engine_renders_them() {
    let words = [
        "system",
        "user",
        "assistant",
        "you",
        "answer",
        "in",
        "short",
        "sentences",
        ".",
        "what",
        "is",
        "a",
        "kv",
        "cache",
        "?",
        "it",
        "keeps",
        "the",
        "keys",
        "and",
        "values",
        "of",
        "attention",
        "for",
        "tokens",
        "already",
        "seen",
        "so",
        "model",
        "need",
        "not",
        "compute",
        "them",
        "again",
        "why",
        "share",
        "across",
        "engines",
        "because",
        "many",
        "requests",
        "start",
        "with",
        "same",
        "prefix",
        ",",
    ];
    let dir = chat_model_dir(&words);
    let conversations = [
        // No system message: the template's default one.
        json!([
            {"role": "user", "content": "what is a kv cache ?"},
            {"role": "assistant", "content": " it keeps the keys and values of attention for tokens already seen , so the model need not compute them again . "},
            {"role": "user", "content": "why share it across engines ?"}
        ]),
        // A system message of its own, and words the vocabulary lacks ([UNK]).
        json!([
            {"role": "system", "content": "  you answer in zebra sentences .  "},
            {"role": "user", "content": "why share the kv cache across many engines ? because many requests start with the same prefix ."}
        ]),
    ];
    for messages in &conversations {
        let (tokens, want) = python_chat(messages, &words);
        assert!(
            tokens.len() >= 32,
            "at least two full blocks: {}",
            tokens.len()
        );
        let out = Command::new(env!("CARGO_BIN_EXE_kvpool"))
            .args(["blocks", "--json", "--block-size", "16", "--hash-seed", "0"])
            .arg("--tokenizer")
            .arg(dir.path())
            .args(["--messages", &messages.to_string()])
            .env_remove("PYTHONHASHSEED")
            .output()
            .expect("run kvpool blocks");
        assert!(out.status.success(), "kvpool blocks failed: {out:?}");
        let got: Value = serde_json::from_slice(&out.stdout).expect("json report");
        assert_eq!(
            got["tokens"].as_u64(),
            Some(tokens.len() as u64),
            "{messages}"
        );
        let (got, want) = (
            got["blocks"].as_array().expect("kvpool blocks"),
            want["blocks"].as_array().expect("python blocks"),
        );
        assert_eq!(got.len(), tokens.len() / 16);
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(g["hash_hex"], w["hash_hex"], "block {i} of {messages}");
        }
    }
    // A conversation the template refuses is an error naming the template's reason.
    let refused = Command::new(env!("CARGO_BIN_EXE_kvpool"))
        .args(["blocks", "--json", "--tokenizer"])
        .arg(dir.path())
        .args(["--messages", r#"[{"role": "tool", "content": "x"}]"#])
        .output()
        .expect("run kvpool blocks");
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("roles must be user or assistant"), "{err}");
}

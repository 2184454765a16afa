//! KV blocks of the synthetic engine: their size (bytes per token from a flag or a Hugging Face
//! model config, times a scale factor), their key in the pool, and their contents, which are
//! derived from the block key alone so that any reader (another engine, another node) can check
//! every byte it gets back. Pure: the config file's bytes are read by `cli`.

use serde_json::Value;

use kvpool_core::sched::BlockKey;

/// Errors of KV sizing.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum KvError {
    #[error("model config is not valid JSON")]
    Json(#[source] serde_json::Error),
    #[error("model config: field `{field}` {problem}")]
    Field {
        field: &'static str,
        problem: String,
    },
    #[error("KV size: {0}")]
    Size(String),
}

kvpool_runtime::error_category!(KvError);

/// Shape of one KV block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    /// KV bytes of one token, all layers (after scaling).
    pub bytes_per_token: u64,
    /// Tokens per block.
    pub block_tokens: u32,
}

impl KvGeometry {
    /// Bytes of one full block.
    pub fn block_bytes(&self) -> u64 {
        self.bytes_per_token
            .saturating_mul(u64::from(self.block_tokens))
    }
}

fn positive_u64(obj: &serde_json::Map<String, Value>, field: &'static str) -> Option<u64> {
    obj.get(field).and_then(Value::as_u64).filter(|&v| v > 0)
}

/// KV bytes per token of the model a Hugging Face `config.json` describes:
/// 2 (K and V) x layers x KV heads x head dim x bytes per element. KV heads default to the
/// attention heads (no grouped-query attention), head dim to hidden size / attention heads, the
/// element size to 2 bytes (`torch_dtype` float16/bfloat16; float32 is 4, 8-bit types 1).
/// Multimodal configs that keep the language model under `text_config` are read from there.
pub fn bytes_per_token_from_config(json: &[u8]) -> Result<u64, KvError> {
    let value: Value = serde_json::from_slice(json).map_err(KvError::Json)?;
    let top = value.as_object().ok_or_else(|| KvError::Field {
        field: "(root)",
        problem: "must be a JSON object".into(),
    })?;
    let obj = match top.get("text_config").and_then(Value::as_object) {
        Some(text) if !top.contains_key("num_hidden_layers") => text,
        _ => top,
    };
    let missing = |field: &'static str| KvError::Field {
        field,
        problem: "is missing or not a positive integer".into(),
    };
    let layers = positive_u64(obj, "num_hidden_layers")
        .or_else(|| positive_u64(obj, "n_layer"))
        .ok_or_else(|| missing("num_hidden_layers"))?;
    let heads = positive_u64(obj, "num_attention_heads")
        .or_else(|| positive_u64(obj, "n_head"))
        .ok_or_else(|| missing("num_attention_heads"))?;
    let kv_heads = match obj.get("num_key_value_heads") {
        None | Some(Value::Null) => heads,
        Some(_) => positive_u64(obj, "num_key_value_heads")
            .ok_or_else(|| missing("num_key_value_heads"))?,
    };
    let head_dim = match positive_u64(obj, "head_dim") {
        Some(d) => d,
        None => {
            let hidden = positive_u64(obj, "hidden_size")
                .or_else(|| positive_u64(obj, "n_embd"))
                .ok_or_else(|| missing("hidden_size"))?;
            if hidden % heads != 0 {
                return Err(KvError::Field {
                    field: "hidden_size",
                    problem: format!("{hidden} is not a multiple of {heads} attention heads"),
                });
            }
            hidden / heads
        }
    };
    let dtype_bytes = match obj
        .get("torch_dtype")
        .or_else(|| obj.get("dtype"))
        .or_else(|| top.get("torch_dtype"))
    {
        None | Some(Value::Null) => 2,
        Some(Value::String(s)) => match s.as_str() {
            "float16" | "bfloat16" | "half" => 2,
            "float32" | "float" => 4,
            "float8_e4m3fn" | "float8_e5m2" | "int8" | "uint8" => 1,
            other => {
                return Err(KvError::Field {
                    field: "torch_dtype",
                    problem: format!("`{other}` is not a known element type"),
                });
            }
        },
        Some(_) => {
            return Err(KvError::Field {
                field: "torch_dtype",
                problem: "must be a string".into(),
            });
        }
    };
    [layers, kv_heads, head_dim, dtype_bytes]
        .iter()
        .try_fold(2u64, |acc, &v| acc.checked_mul(v))
        .ok_or_else(|| KvError::Size("bytes per token overflow".into()))
}

/// `bytes` x `scale`, rounded, at least 1.
pub fn scale_bytes(bytes: u64, scale: f64) -> Result<u64, KvError> {
    if !(scale.is_finite() && scale > 0.0) {
        return Err(KvError::Size(format!(
            "scale must be a finite number > 0, got {scale}"
        )));
    }
    let scaled = (bytes as f64 * scale).round();
    if scaled >= u64::MAX as f64 {
        return Err(KvError::Size(format!("{bytes} x {scale} is too large")));
    }
    Ok((scaled as u64).max(1))
}

/// The block's key in the pool: readable, and distinct per served model (the shared contract,
/// defined once in `sched` so that the conductor's pool lookups use the same names).
pub use kvpool_core::sched::pool_key;

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The key of the hand-off marker of SGLang bootstrap room `room`: a prefill engine writes it
/// (with key-derived contents, like a block) once the prompt's blocks are in the pool, and the
/// decode engine of the same room waits for it. Distinct from prompt block keys by construction
/// only in probability (64-bit hashes), like the block keys themselves.
pub fn room_key(room: u64) -> BlockKey {
    let mut state = room ^ 0x5347_4c61_6e67_526d; // "SGLangRm"
    splitmix64(&mut state)
}

/// Fills `out` with the contents of block `key` (a pseudo-random stream seeded by the key).
pub fn fill_block(key: BlockKey, out: &mut [u8]) {
    let mut state = key;
    let mut chunks = out.chunks_exact_mut(8);
    for chunk in &mut chunks {
        chunk.copy_from_slice(&splitmix64(&mut state).to_le_bytes());
    }
    let rest = chunks.into_remainder();
    let last = splitmix64(&mut state).to_le_bytes();
    let n = rest.len();
    rest.copy_from_slice(&last[..n]);
}

/// Whether `data` is exactly the `len`-byte contents of block `key`.
pub fn verify_block(key: BlockKey, data: &[u8], len: u64) -> bool {
    if data.len() as u64 != len {
        return false;
    }
    let mut expected = vec![0u8; data.len()];
    fill_block(key, &mut expected);
    expected == data
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_70b_config_gives_320_kib_per_token() {
        // Llama-2-70B: 80 layers, 64 heads, 8 KV heads, hidden 8192 (head dim 128), bf16.
        let cfg = br#"{"num_hidden_layers": 80, "num_attention_heads": 64,
            "num_key_value_heads": 8, "hidden_size": 8192, "torch_dtype": "bfloat16"}"#;
        assert_eq!(
            bytes_per_token_from_config(cfg).unwrap(),
            2 * 80 * 8 * 128 * 2
        );
        // No GQA, float32, explicit head_dim, nested text config.
        let cfg = br#"{"text_config": {"num_hidden_layers": 2, "num_attention_heads": 4,
            "head_dim": 16, "hidden_size": 10, "torch_dtype": "float32"}}"#;
        assert_eq!(
            bytes_per_token_from_config(cfg).unwrap(),
            2 * 2 * 4 * 16 * 4
        );
    }

    #[test]
    fn bad_configs_name_the_field() {
        let field = |cfg: &[u8]| match bytes_per_token_from_config(cfg) {
            Err(KvError::Field { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            field(br#"{"num_attention_heads": 4, "hidden_size": 8}"#),
            "num_hidden_layers"
        );
        assert_eq!(
            field(br#"{"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 8}"#),
            "hidden_size"
        );
        assert_eq!(
            field(br#"{"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8, "torch_dtype": "int3"}"#),
            "torch_dtype"
        );
        assert_eq!(
            field(br#"{"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 0, "hidden_size": 8}"#),
            "num_key_value_heads"
        );
        assert_eq!(
            bytes_per_token_from_config(b"[").unwrap_err().category(),
            "json"
        );
    }

    #[test]
    fn scaling_rounds_and_keeps_one_byte() {
        assert_eq!(scale_bytes(327_680, 0.001).unwrap(), 328);
        assert_eq!(scale_bytes(10, 1e-9).unwrap(), 1);
        assert!(scale_bytes(10, 0.0).is_err());
        assert!(scale_bytes(10, f64::NAN).is_err());
        assert!(scale_bytes(u64::MAX, 2.0).is_err());
    }

    #[test]
    fn block_contents_depend_on_the_key_and_verify() {
        let mut a = vec![0u8; 1001];
        let mut b = vec![0u8; 1001];
        fill_block(7, &mut a);
        fill_block(8, &mut b);
        assert_ne!(a, b);
        assert!(verify_block(7, &a, 1001));
        assert!(!verify_block(8, &a, 1001));
        assert!(!verify_block(7, &a[..1000], 1001));
        a[500] ^= 1;
        assert!(!verify_block(7, &a, 1001));
        assert_ne!(pool_key("m", 1), pool_key("n", 1));
        assert_ne!(room_key(1), room_key(2));
        assert_eq!(room_key(1), room_key(1));
        let g = KvGeometry {
            bytes_per_token: 3,
            block_tokens: 4,
        };
        assert_eq!(g.block_bytes(), 12);
    }
}

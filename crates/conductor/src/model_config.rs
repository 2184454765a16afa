//! What the conductor reads from the served model's directory (the engine pool's model):
//! the KV cache's element type, as vLLM resolves `--dtype auto`, and the KV bytes one token
//! takes in one engine rank's cache ([`kv_layout`]). I/O boundary: reading the directory's
//! `config.json`; the resolution and the arithmetic are pure.

use std::path::Path;

/// The dtype vLLM's `--dtype auto` gives a model whose config names `config_dtype`: half
/// precision types as they are; float32 (and an absent dtype, which Hugging Face reads as
/// float32) downcast to bfloat16, the first dtype vLLM's CUDA and CPU platforms support.
pub fn resolve_dtype(config_dtype: Option<&str>) -> Result<String, String> {
    let name = config_dtype.unwrap_or("float32");
    let name = name.strip_prefix("torch.").unwrap_or(name);
    match name {
        "bfloat16" | "bf16" => Ok("bfloat16".to_owned()),
        "float16" | "fp16" | "half" => Ok("float16".to_owned()),
        "float32" | "fp32" | "float" => Ok("bfloat16".to_owned()),
        other => Err(format!(
            "config.json names dtype {other:?}, which kvpool cannot map to vLLM's; set it"
        )),
    }
}

/// The model directory's `config.json`, parsed; an error names the file and the problem.
pub fn read_config(dir: &Path) -> Result<serde_json::Value, String> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", path.display()))
}

/// The KV dtype of the model in `dir` (its `config.json`'s `torch_dtype`, or `dtype` in
/// newer Transformers), resolved by [`resolve_dtype`]; an error names the file and the problem.
pub fn kv_dtype(dir: &Path) -> Result<String, String> {
    config_kv_dtype(&read_config(dir)?)
        .map_err(|e| format!("{}: {e}", dir.join("config.json").display()))
}

/// The KV dtype a parsed `config.json` implies (see [`kv_dtype`]).
pub fn config_kv_dtype(v: &serde_json::Value) -> Result<String, String> {
    let field = |k: &str| v.get(k).and_then(serde_json::Value::as_str);
    // Multimodal configs keep the language model's dtype in text_config.
    let dtype = field("torch_dtype").or_else(|| field("dtype")).or_else(|| {
        v.get("text_config")
            .and_then(|t| t.get("torch_dtype").or_else(|| t.get("dtype")))
            .and_then(serde_json::Value::as_str)
    });
    resolve_dtype(dtype)
}

/// Bytes per element of a KV cache of `dtype` (a resolved model dtype, or vLLM's
/// `--kv-cache-dtype` such as `fp8_e4m3`).
pub fn dtype_bytes(dtype: &str) -> Result<u64, String> {
    let d = dtype.strip_prefix("torch.").unwrap_or(dtype);
    match d {
        "float32" | "fp32" | "float" => Ok(4),
        "bfloat16" | "bf16" | "float16" | "fp16" | "half" => Ok(2),
        _ if d.starts_with("fp8") || d.starts_with("float8") || d == "int8" => Ok(1),
        other => Err(format!("KV dtype {other:?} has no known element size")),
    }
}

/// The KV cache shape of one token in one engine rank (docs/scheduling.md, "KV bytes per
/// token").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Bytes one token's K and V take in the cache of one tensor-parallel rank.
    pub bytes_per_token: u64,
    /// The cache's element type.
    pub dtype: String,
    pub layers: u64,
    /// KV heads one rank holds (MLA: 1, its latent vector).
    pub kv_heads_per_rank: u64,
    /// Elements per head and layer: the head size for K and for V alike, or MLA's latent
    /// plus rotary size (one vector, no separate V).
    pub head_elements: u64,
    /// Multi-head latent attention (DeepSeek-V2/V3): the latent is replicated, not sharded.
    pub mla: bool,
}

/// The KV layout a parsed `config.json` implies for engines running with
/// `tensor_parallel` ranks and a KV cache of `kv_dtype` (`None`: the config's dtype, as
/// vLLM's `--dtype auto` resolves it).
///
/// Standard attention: 2 (K and V) x `num_hidden_layers` x KV heads per rank x `head_dim`
/// x element size, where the KV heads are `num_key_value_heads` (default
/// `num_attention_heads`), split over the ranks and replicated when there are fewer heads
/// than ranks (at least one per rank, as vLLM does), and `head_dim` defaults to
/// `hidden_size / num_attention_heads`. MLA (`kv_lora_rank` in the config): one latent of
/// `kv_lora_rank + qk_rope_head_dim` elements per layer, the same on every rank.
/// Multimodal configs are read from their `text_config`. Layouts whose per-token state is
/// not a KV cache (Mamba and other recurrent layers) are refused.
pub fn kv_layout(
    config: &serde_json::Value,
    tensor_parallel: u32,
    kv_dtype: Option<&str>,
) -> Result<KvLayout, String> {
    if tensor_parallel == 0 {
        return Err("the tensor-parallel size must be at least 1".to_owned());
    }
    let dtype = match kv_dtype {
        Some(d) if d != "auto" => d.to_owned(),
        _ => config_kv_dtype(config)?,
    };
    let element = dtype_bytes(&dtype)?;
    let v = config.get("text_config").unwrap_or(config);
    let num = |k: &str| v.get(k).and_then(serde_json::Value::as_u64);
    let need = |k: &str| {
        num(k)
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("no positive integer {k}"))
    };
    // Per-layer kinds: attention of any window keeps a KV cache; Mamba and linear
    // attention keep a recurrent state instead. Hybrid patterns spell layers as letters
    // (M: Mamba, *: attention, -: MLP).
    for k in [
        "layers_block_type",
        "layer_types",
        "hybrid_override_pattern",
    ] {
        let kinds: Vec<&str> = match v.get(k) {
            Some(serde_json::Value::Array(a)) => a.iter().filter_map(|t| t.as_str()).collect(),
            Some(serde_json::Value::String(s)) => vec![s.as_str()],
            _ => continue,
        };
        let recurrent = |t: &&&str| match k {
            "hybrid_override_pattern" => t.contains('M'),
            _ => t.contains("linear") || !t.contains("attention"),
        };
        if let Some(t) = kinds.iter().find(recurrent) {
            return Err(format!(
                "{k} names a layer of kind {t:?}, which keeps no KV cache kvpool can size; set \
                 --kv-bytes-per-token"
            ));
        }
    }
    let layers = need("num_hidden_layers")?;
    if let Some(rank) = num("kv_lora_rank") {
        let rope = num("qk_rope_head_dim").unwrap_or(0);
        let head_elements = rank + rope;
        return Ok(KvLayout {
            bytes_per_token: layers * head_elements * element,
            dtype,
            layers,
            kv_heads_per_rank: 1,
            head_elements,
            mla: true,
        });
    }
    let heads = need("num_attention_heads")?;
    let kv_heads = num("num_key_value_heads")
        .filter(|n| *n > 0)
        .unwrap_or(heads);
    let head_dim = match num("head_dim").filter(|n| *n > 0) {
        Some(d) => d,
        None => need("hidden_size")? / heads,
    };
    if head_dim == 0 {
        return Err(format!(
            "hidden_size is below num_attention_heads ({heads})"
        ));
    }
    let kv_heads_per_rank = (kv_heads / u64::from(tensor_parallel)).max(1);
    Ok(KvLayout {
        bytes_per_token: 2 * layers * kv_heads_per_rank * head_dim * element,
        dtype,
        layers,
        kv_heads_per_rank,
        head_elements: head_dim,
        mla: false,
    })
}

/// [`kv_layout`] of the model in `dir`; an error names the file and the problem.
pub fn dir_kv_layout(
    dir: &Path,
    tensor_parallel: u32,
    kv_dtype: Option<&str>,
) -> Result<KvLayout, String> {
    kv_layout(&read_config(dir)?, tensor_parallel, kv_dtype)
        .map_err(|e| format!("{}: {e}", dir.join("config.json").display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtypes_resolve_as_vllm_auto() {
        assert_eq!(resolve_dtype(Some("bfloat16")).unwrap(), "bfloat16");
        assert_eq!(resolve_dtype(Some("torch.float16")).unwrap(), "float16");
        assert_eq!(resolve_dtype(Some("float32")).unwrap(), "bfloat16");
        assert_eq!(resolve_dtype(None).unwrap(), "bfloat16");
        assert!(resolve_dtype(Some("int8")).unwrap_err().contains("int8"));
    }

    #[test]
    fn reads_the_model_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"torch_dtype":"float16"}"#,
        )
        .unwrap();
        assert_eq!(kv_dtype(dir.path()).unwrap(), "float16");
        std::fs::write(dir.path().join("config.json"), r#"{"dtype":"bfloat16"}"#).unwrap();
        assert_eq!(kv_dtype(dir.path()).unwrap(), "bfloat16");
        std::fs::write(dir.path().join("config.json"), "not json").unwrap();
        assert!(kv_dtype(dir.path()).unwrap_err().contains("not JSON"));
        let missing = kv_dtype(&dir.path().join("nope")).unwrap_err();
        assert!(missing.contains("cannot read"), "{missing}");
    }

    fn layout(config: &str, tp: u32, dtype: Option<&str>) -> Result<KvLayout, String> {
        kv_layout(&serde_json::from_str(config).unwrap(), tp, dtype)
    }

    #[test]
    fn kv_bytes_per_token_from_hand_computed_configs() {
        // Llama-3.1-8B (GQA): 32 layers, 8 of 32 heads keep KV, head size 4096 / 32 = 128,
        // bfloat16: 2 x 32 x 8 x 128 x 2 = 131,072 bytes.
        let llama = r#"{"num_hidden_layers":32,"num_attention_heads":32,
            "num_key_value_heads":8,"hidden_size":4096,"torch_dtype":"bfloat16"}"#;
        let l = layout(llama, 1, None).unwrap();
        assert_eq!((l.bytes_per_token, l.kv_heads_per_rank), (131_072, 8));
        // Tensor parallel 2: each rank holds 4 of the 8 KV heads.
        assert_eq!(layout(llama, 2, None).unwrap().bytes_per_token, 65_536);
        // 16 ranks, 8 heads: vLLM replicates, one head per rank.
        assert_eq!(layout(llama, 16, None).unwrap().bytes_per_token, 16_384);
        // A KV cache in fp8 halves it.
        assert_eq!(
            layout(llama, 1, Some("fp8_e4m3")).unwrap().bytes_per_token,
            65_536
        );
        // No num_key_value_heads (multi-head attention, GPT-2 style): every head keeps KV;
        // 12 layers x 12 heads x 64 (768 / 12), float16: 2 x 12 x 12 x 64 x 2 = 36,864.
        let mha = r#"{"num_hidden_layers":12,"num_attention_heads":12,"hidden_size":768,
            "torch_dtype":"float16"}"#;
        assert_eq!(layout(mha, 1, None).unwrap().bytes_per_token, 36_864);
        // float32 weights run as bfloat16 (vLLM's --dtype auto), an explicit head_dim wins
        // over hidden_size / heads: 2 x 2 layers x 2 KV heads x 16 x 2 = 256.
        let f32 = r#"{"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
            "hidden_size":128,"head_dim":16,"torch_dtype":"float32"}"#;
        let l = layout(f32, 1, None).unwrap();
        assert_eq!((l.bytes_per_token, l.dtype.as_str()), (256, "bfloat16"));
        // Multimodal: the text model's numbers.
        let mm = r#"{"text_config":{"num_hidden_layers":2,"num_attention_heads":4,
            "hidden_size":128,"torch_dtype":"bfloat16"}}"#;
        assert_eq!(
            layout(mm, 1, None).unwrap().bytes_per_token,
            2 * 2 * 4 * 32 * 2
        );
    }

    #[test]
    fn mla_is_one_latent_per_layer_and_not_sharded() {
        // DeepSeek-V3: 61 layers x (512 + 64) x 2 bytes = 70,272, on every rank.
        let ds = r#"{"num_hidden_layers":61,"num_attention_heads":128,"kv_lora_rank":512,
            "qk_rope_head_dim":64,"hidden_size":7168,"torch_dtype":"bfloat16"}"#;
        for tp in [1, 8] {
            let l = layout(ds, tp, None).unwrap();
            assert!(l.mla);
            assert_eq!(l.bytes_per_token, 70_272);
        }
    }

    #[test]
    fn unknown_layouts_are_refused_by_name() {
        let hybrid = r#"{"num_hidden_layers":2,"num_attention_heads":4,"hidden_size":64,
            "layers_block_type":["mamba","attention"]}"#;
        let err = layout(hybrid, 1, None).unwrap_err();
        assert!(err.contains("layers_block_type"), "{err}");
        let sliding = r#"{"num_hidden_layers":2,"num_attention_heads":4,"hidden_size":64,
            "layer_types":["sliding_attention","full_attention"]}"#;
        assert!(layout(sliding, 1, None).is_ok());
        let err = layout(r#"{"num_hidden_layers":4}"#, 1, None).unwrap_err();
        assert!(err.contains("num_attention_heads"), "{err}");
        assert!(
            layout(
                r#"{"num_hidden_layers":4,"num_attention_heads":4,"hidden_size":64}"#,
                0,
                None
            )
            .unwrap_err()
            .contains("tensor-parallel")
        );
        let err = layout(
            r#"{"num_hidden_layers":1,"num_attention_heads":1,"hidden_size":8}"#,
            1,
            Some("int4"),
        )
        .unwrap_err();
        assert!(err.contains("int4"), "{err}");
    }
}

//! What the conductor reads from the served model's directory (the engine pool's model):
//! the KV cache's element type, as vLLM resolves `--dtype auto`. I/O boundary: reading the
//! directory's `config.json`; the resolution itself is pure ([`resolve_dtype`]).

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
}

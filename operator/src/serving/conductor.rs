//! The served model's facts the conductor takes from the engine pools, without a setting of
//! its own: the tensor parallel size they agree on (`--engine-tensor-parallel-size`) and, when
//! they all load one model from the same PersistentVolumeClaim, that claim and the model's path
//! in it, which the conductor mounts read-only to read the same `config.json` and tokenizer the
//! engines load (`--model-dir`). Several models, or a Hugging Face id, give no model files.
//! I/O boundary: none.

use kvpool_crd::{ENGINE_CONTAINER, EnginePodTemplate};

use super::EngineServing;

/// A model directory inside a PersistentVolumeClaim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelFiles {
    /// The claim's name.
    pub claim: String,
    /// The model's directory relative to the claim's root (`""`: the root itself).
    pub path: String,
}

/// The claim holding `model` and its path there, when `model` is an absolute path below a
/// mount of the engine container (in `template`) whose volume is a PersistentVolumeClaim. The
/// deepest such mount wins, as in the container; a mount with `subPathExpr` (resolved only on
/// the node) or a path with `..` gives `None`.
pub fn model_files(model: &str, template: Option<&EnginePodTemplate>) -> Option<ModelFiles> {
    let rest = model.strip_prefix('/')?;
    let parts: Vec<&str> = rest
        .split('/')
        .filter(|p| !p.is_empty() && *p != ".")
        .collect();
    if parts.contains(&"..") {
        return None;
    }
    let spec = template?.spec.as_ref()?;
    let engine = spec
        .containers
        .iter()
        .find(|c| c.name == ENGINE_CONTAINER)?;
    let (mount, depth) = engine
        .volume_mounts
        .iter()
        .flatten()
        .filter_map(|m| {
            let at: Vec<&str> = m.mount_path.split('/').filter(|p| !p.is_empty()).collect();
            parts.starts_with(&at).then_some((m, at.len()))
        })
        .max_by_key(|(_, depth)| *depth)?;
    if mount
        .sub_path_expr
        .as_deref()
        .is_some_and(|e| !e.is_empty())
    {
        return None;
    }
    let claim = spec
        .volumes
        .iter()
        .find(|v| v.name == mount.name)?
        .persistent_volume_claim
        .as_ref()?
        .claim_name
        .clone();
    let mut path: Vec<&str> = mount
        .sub_path
        .as_deref()
        .map(|s| s.split('/').filter(|p| !p.is_empty()).collect())
        .unwrap_or_default();
    path.extend(&parts[depth..]);
    Some(ModelFiles {
        claim,
        path: path.join("/"),
    })
}

/// What the conductor is told about the served model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConductorFacts {
    /// The tensor parallel size every engine pool of the KVCachePool has; `None` when there
    /// are none or they differ (the conductor's default, 1, applies).
    pub tensor_parallel_size: Option<u32>,
    /// The model's files, when every engine pool serves one model loaded from the same place
    /// in one PersistentVolumeClaim.
    pub model_files: Option<ModelFiles>,
}

/// The conductor's facts from the valid engine pools of a KVCachePool.
pub fn conductor_facts(pools: &[EngineServing]) -> ConductorFacts {
    let first = pools.first();
    let tensor_parallel_size = first
        .map(|p| p.tensor_parallel_size)
        .filter(|tp| pools.iter().all(|p| p.tensor_parallel_size == *tp));
    let one_model = first
        .and_then(|p| p.model.as_ref())
        .is_some_and(|m| pools.iter().all(|p| p.model.as_ref() == Some(m)));
    let model_files = first
        .and_then(|p| p.model_files.clone())
        .filter(|f| one_model && pools.iter().all(|p| p.model_files.as_ref() == Some(f)));
    ConductorFacts {
        tensor_parallel_size,
        model_files,
    }
}

//! What the engine pools sharing a KVCachePool serve, and whether they can serve it together.
//! Several PrefillPools and DecodePools may reference one KVCachePool and serve several models
//! (the conductor routes each request by model), but each model needs prefill and decode pools
//! that hand KV over the same way: the same disaggregation convention
//! (`kvpool.dev/engine-protocol`) and the same tensor parallel size (the KV layout per rank).
//! [`check`] finds what breaks that; [`pool_condition`] and [`engine_condition`] turn it into the
//! `ModelMismatch` condition of the KVCachePool and of each engine pool. A mismatch is reported,
//! never enforced: nothing is held back or deleted (docs/operator.md, "Engine pools sharing a
//! KVCachePool"). [`conductor`] derives the conductor's model facts from the same list.
//! I/O boundary: none here; [`api`] reads the engine pools and publishes the Events.

pub mod api;
pub mod conductor;

use std::collections::{BTreeMap, BTreeSet};

use kube::ResourceExt;
use kvpool_crd::conditions::{MODEL_MISMATCH, reasons};
use kvpool_crd::labels::ENGINE_PROTOCOL_ANNOTATION;
use kvpool_crd::{EngineKind, Role};

use crate::conditions::Desired;
use crate::engine_kind::EnginePool;
pub use conductor::{ConductorFacts, ModelFiles, conductor_facts};

/// The conductor's convention for engines that declare none (its `--engine-protocol` default,
/// which the operator leaves as it is).
pub const CONDUCTOR_DEFAULT_PROTOCOL: &str = "vllm";

/// What one engine pool serves, as far as pairing it with others matters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineServing {
    /// `PrefillPool` or `DecodePool`.
    pub kind: &'static str,
    pub name: String,
    pub role: Role,
    /// The model the engines serve under (what their `/v1/models` lists, which the conductor
    /// routes by): the first `--served-model-name` of `engine.args`, else `engine.model`.
    /// `None`: a custom engine without `engine.model`, whose model the operator cannot know.
    pub model: Option<String>,
    /// The disaggregation convention the conductor pairs its engines by.
    pub protocol: String,
    /// Where the protocol comes from, for messages (`engine.kind vllm`, ...).
    pub protocol_source: &'static str,
    pub tensor_parallel_size: u32,
    /// The model's files, when `engine.model` is a path inside a PersistentVolumeClaim the
    /// engine container mounts (`spec.template`).
    pub model_files: Option<ModelFiles>,
}

impl EngineServing {
    /// `PrefillPool qwen`.
    pub fn label(&self) -> String {
        format!("{} {}", self.kind, self.name)
    }
}

/// What `obj` serves; `None` for a pool whose spec is invalid or that is being deleted (an
/// invalid pool runs nothing and carries its own `InvalidSpec` condition).
pub fn serving<K: EnginePool>(obj: &K) -> Option<EngineServing> {
    if obj.meta().deletion_timestamp.is_some() {
        return None;
    }
    let v = obj.validated().ok()?;
    let template_protocol = v
        .template
        .as_ref()
        .and_then(|t| t.metadata.as_ref())
        .and_then(|m| m.annotations.get(ENGINE_PROTOCOL_ANNOTATION));
    let (protocol, protocol_source) = match (v.kind, template_protocol) {
        (EngineKind::Vllm, _) => ("vllm".to_owned(), "engine.kind vllm"),
        (EngineKind::Sglang, _) => ("sglang".to_owned(), "engine.kind sglang"),
        (EngineKind::Custom, Some(p)) => (
            p.clone(),
            "engine.kind custom, spec.template's kvpool.dev/engine-protocol",
        ),
        (EngineKind::Custom, None) => (
            CONDUCTOR_DEFAULT_PROTOCOL.to_owned(),
            "engine.kind custom, the conductor's default",
        ),
    };
    let model = served_model_name(&v.args).or_else(|| v.model.clone());
    let model_files = v
        .model
        .as_deref()
        .and_then(|m| conductor::model_files(m, v.template.as_ref()));
    Some(EngineServing {
        kind: K::KIND_NAME,
        name: obj.name_any(),
        role: v.role,
        model,
        protocol,
        protocol_source,
        tensor_parallel_size: v.tensor_parallel_size,
        model_files,
    })
}

/// The first `--served-model-name` of an engine's arguments (`--served-model-name a b` or
/// `--served-model-name=a`), the name vLLM and SGLang list in `/v1/models`.
pub fn served_model_name(args: &[String]) -> Option<String> {
    const FLAG: &str = "--served-model-name";
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == FLAG {
            return it.next().filter(|n| !n.starts_with("--")).cloned();
        }
        if let Some(name) = a.strip_prefix(FLAG).and_then(|r| r.strip_prefix('=')) {
            return (!name.is_empty()).then(|| name.to_owned());
        }
    }
    None
}

/// Why the engine pools of a KVCachePool cannot serve a model together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mismatch {
    /// Served by these prefill pools but by no decode pool.
    NoDecode { model: String, pools: Vec<String> },
    /// Served by these decode pools but by no prefill pool.
    NoPrefill { model: String, pools: Vec<String> },
    /// The pools serving the model, with the convention of each (and where it comes from).
    Protocol {
        model: String,
        pools: Vec<(String, String)>,
    },
    /// The pools serving the model, with the tensor parallel size of each.
    TensorParallel {
        model: String,
        pools: Vec<(String, u32)>,
    },
}

impl Mismatch {
    /// The condition's reason for this failure.
    pub fn reason(&self) -> &'static str {
        match self {
            Mismatch::NoDecode { .. } => reasons::NO_DECODE_POOL,
            Mismatch::NoPrefill { .. } => reasons::NO_PREFILL_POOL,
            Mismatch::Protocol { .. } => reasons::ENGINE_PROTOCOL_MISMATCH,
            Mismatch::TensorParallel { .. } => reasons::TENSOR_PARALLEL_MISMATCH,
        }
    }

    /// The pools the failure concerns (their [`EngineServing::label`]).
    pub fn concerns(&self, label: &str) -> bool {
        match self {
            Mismatch::NoDecode { pools, .. } | Mismatch::NoPrefill { pools, .. } => {
                pools.iter().any(|p| p == label)
            }
            Mismatch::Protocol { pools, .. } => pools.iter().any(|(p, _)| p == label),
            Mismatch::TensorParallel { pools, .. } => pools.iter().any(|(p, _)| p == label),
        }
    }

    /// What is wrong, naming the model, the pools and the KVCachePool `pool`.
    pub fn message(&self, pool: &str) -> String {
        match self {
            Mismatch::NoDecode { model, pools } => format!(
                "model {model:?} is served by {} but by no DecodePool of KVCachePool {pool}: \
                 its requests cannot be decoded",
                pools.join(", ")
            ),
            Mismatch::NoPrefill { model, pools } => format!(
                "model {model:?} is served by {} but by no PrefillPool of KVCachePool {pool}: \
                 its requests cannot be prefilled",
                pools.join(", ")
            ),
            Mismatch::Protocol { model, pools } => format!(
                "the pools of KVCachePool {pool} serving model {model:?} hand KV over by \
                 different conventions: {}",
                pools
                    .iter()
                    .map(|(p, how)| format!("{p} ({how})"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Mismatch::TensorParallel { model, pools } => format!(
                "the pools of KVCachePool {pool} serving model {model:?} split it over \
                 different tensor parallel sizes, so their KV layout per rank differs: {}",
                pools
                    .iter()
                    .map(|(p, tp)| format!("{p} (tensorParallelSize {tp})"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

/// The pools of each declared model, by model name.
fn by_model(pools: &[EngineServing]) -> BTreeMap<&str, Vec<&EngineServing>> {
    let mut models: BTreeMap<&str, Vec<&EngineServing>> = BTreeMap::new();
    for p in pools {
        if let Some(m) = &p.model {
            models.entry(m.as_str()).or_default().push(p);
        }
    }
    models
}

/// Everything that keeps `pools` (the valid engine pools of one KVCachePool, in any order)
/// from serving their models together, by model, then in the order of [`Mismatch`]'s variants.
///
/// Each model needs a prefill and a decode pool, and all its pools must agree on the
/// convention and the tensor parallel size. A pool whose model is unknown (`kind: custom`
/// without `engine.model`) is compared with nothing, but counts as a possible prefill (or
/// decode) pool of every model, so it never causes a `NoPrefill`/`NoDecode` on its own.
pub fn check(pools: &[EngineServing]) -> Vec<Mismatch> {
    let unknown = |role: Role| pools.iter().any(|p| p.model.is_none() && p.role == role);
    let mut out = Vec::new();
    for (model, group) in by_model(pools) {
        let labels = |role: Role| {
            let mut l: Vec<String> = group
                .iter()
                .filter(|p| p.role == role)
                .map(|p| p.label())
                .collect();
            l.sort();
            l
        };
        let (prefill, decode) = (labels(Role::Prefill), labels(Role::Decode));
        if decode.is_empty() && !unknown(Role::Decode) {
            out.push(Mismatch::NoDecode {
                model: model.to_owned(),
                pools: prefill.clone(),
            });
        }
        if prefill.is_empty() && !unknown(Role::Prefill) {
            out.push(Mismatch::NoPrefill {
                model: model.to_owned(),
                pools: decode.clone(),
            });
        }
        let mut sorted = group.clone();
        sorted.sort_by_key(|p| p.label());
        let protocols: BTreeSet<&str> = sorted.iter().map(|p| p.protocol.as_str()).collect();
        if protocols.len() > 1 {
            out.push(Mismatch::Protocol {
                model: model.to_owned(),
                pools: sorted
                    .iter()
                    .map(|p| (p.label(), format!("{}: {}", p.protocol, p.protocol_source)))
                    .collect(),
            });
        }
        let sizes: BTreeSet<u32> = sorted.iter().map(|p| p.tensor_parallel_size).collect();
        if sizes.len() > 1 {
            out.push(Mismatch::TensorParallel {
                model: model.to_owned(),
                pools: sorted
                    .iter()
                    .map(|p| (p.label(), p.tensor_parallel_size))
                    .collect(),
            });
        }
    }
    out
}

/// `ModelMismatch` from `mismatches`: True with the first one's reason and every message,
/// else False with `ok`.
fn mismatch_condition(mismatches: &[&Mismatch], pool: &str, ok: String) -> Desired {
    match mismatches.first() {
        None => Desired::new(MODEL_MISMATCH, false, reasons::ENGINE_POOLS_MATCH, ok),
        Some(first) => Desired::new(
            MODEL_MISMATCH,
            true,
            first.reason(),
            mismatches
                .iter()
                .map(|m| m.message(pool))
                .collect::<Vec<_>>()
                .join("; "),
        ),
    }
}

/// The pools whose model is unknown, for the passing messages.
fn unchecked(pools: &[EngineServing]) -> Option<String> {
    let mut names: Vec<String> = pools
        .iter()
        .filter(|p| p.model.is_none())
        .map(EngineServing::label)
        .collect();
    names.sort();
    (!names.is_empty()).then(|| {
        format!(
            "not checked (engine.kind custom without engine.model): {}",
            names.join(", ")
        )
    })
}

/// The KVCachePool `pool`'s `ModelMismatch` condition over its engine pools `pools`.
pub fn pool_condition(pool: &str, pools: &[EngineServing]) -> Desired {
    let mismatches = check(pools);
    let ok = if pools.is_empty() {
        "no valid PrefillPool or DecodePool references the pool".to_owned()
    } else {
        let mut parts: Vec<String> = by_model(pools)
            .iter()
            .map(|(model, group)| {
                let mut names: Vec<String> = group.iter().map(|p| p.label()).collect();
                names.sort();
                format!("{model:?} by {}", names.join(", "))
            })
            .collect();
        parts.extend(unchecked(pools));
        format!("the engine pools agree on each model: {}", parts.join("; "))
    };
    mismatch_condition(&mismatches.iter().collect::<Vec<_>>(), pool, ok)
}

/// The `ModelMismatch` condition of the engine pool `this` (one of `pools`, the engine pools of
/// KVCachePool `pool`): the mismatches that name it.
pub fn engine_condition(pool: &str, this: &EngineServing, pools: &[EngineServing]) -> Desired {
    let all = check(pools);
    let label = this.label();
    let mine: Vec<&Mismatch> = all.iter().filter(|m| m.concerns(&label)).collect();
    let ok = match &this.model {
        None => "engine.kind custom without engine.model: the model is unknown to the operator \
                 and not checked"
            .to_owned(),
        Some(model) => format!(
            "the pools of KVCachePool {pool} serving model {model:?} include prefill and decode \
             pools and agree on the convention ({}) and the tensor parallel size ({})",
            this.protocol, this.tensor_parallel_size
        ),
    };
    mismatch_condition(&mine, pool, ok)
}

#[cfg(test)]
mod tests;

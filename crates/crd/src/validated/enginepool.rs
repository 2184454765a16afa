//! [`ValidatedEnginePool`]: a `PrefillPool` or `DecodePool` spec with defaults applied and its
//! rules checked, in one shape for both kinds so that the operator builds both with the same
//! code; the engines' [`Role`]. Pure, no I/O.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{EnvVar, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde::{Deserialize, Serialize};

use super::error::{SpecError, check_label_value, validate_label_key};
use super::fields::ranged;
use crate::labels::Component;
use crate::{
    AutoscalingSignal, AutoscalingSpec, DecodePoolSpec, EngineKind, EnginePodTemplate,
    EngineResources, EngineSpec, PrefillPoolSpec,
};

/// Serving phase of an engine pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Role {
    /// Computes prompts' KV cache.
    Prefill,
    /// Generates tokens from prefilled KV cache.
    Decode,
}

impl Role {
    /// The label component of the role's children.
    pub fn component(self) -> Component {
        match self {
            Self::Prefill => Component::Prefill,
            Self::Decode => Component::Decode,
        }
    }

    /// Lowercase name (`prefill`, `decode`), as engines are told their role.
    pub fn as_str(self) -> &'static str {
        self.component().as_str()
    }
}

/// Effective autoscaling bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingConfig {
    /// Fewest instances.
    pub min_replicas: u32,
    /// Most instances.
    pub max_replicas: u32,
    /// Load signal.
    pub signal: AutoscalingSignal,
}

/// A PrefillPool or DecodePool spec with defaults applied and rules checked: one shape for both
/// kinds, so the operator builds both with the same code.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedEnginePool {
    /// Prefill or decode.
    pub role: Role,
    /// Name of the KVCachePool in the same namespace.
    pub kv_cache_pool: String,
    /// Desired instances.
    pub replicas: u32,
    /// Engine implementation.
    pub kind: EngineKind,
    /// Engine image.
    pub image: String,
    /// Model, required unless `kind` is custom.
    pub model: Option<String>,
    /// Entrypoint override.
    pub command: Vec<String>,
    /// User arguments.
    pub args: Vec<String>,
    /// User environment.
    pub env: Vec<EnvVar>,
    /// GPUs per instance (a multiple of `tensor_parallel_size`).
    pub gpus: u32,
    /// GPU extended resource name.
    pub gpu_resource_name: String,
    /// RDMA extended resources per instance.
    pub rdma: BTreeMap<String, Quantity>,
    /// Other container resources.
    pub container: Option<ResourceRequirements>,
    /// GPUs per model replica.
    pub tensor_parallel_size: u32,
    /// The role's latency objective: TTFT for prefill, TPOT for decode, milliseconds.
    pub slo_millis: u32,
    /// Autoscaling bounds, if any.
    pub autoscaling: Option<AutoscalingConfig>,
    /// The user's part of the engine pods (`spec.template`), its label and annotation keys and
    /// label values checked.
    pub template: Option<EnginePodTemplate>,
}

/// The fields PrefillPoolSpec and DecodePoolSpec share, borrowed.
struct EngineFields<'a> {
    pool: &'a str,
    replicas: i32,
    engine: &'a EngineSpec,
    resources: &'a EngineResources,
    tensor_parallel_size: i32,
    autoscaling: Option<&'a AutoscalingSpec>,
    template: Option<&'a EnginePodTemplate>,
}

/// [`EngineFields`] of a PrefillPoolSpec or DecodePoolSpec: the same field names on two types.
macro_rules! engine_fields {
    ($spec:expr) => {
        EngineFields {
            pool: &$spec.kv_cache_pool_ref.name,
            replicas: $spec.replicas,
            engine: &$spec.engine,
            resources: &$spec.resources,
            tensor_parallel_size: $spec.tensor_parallel_size,
            autoscaling: $spec.autoscaling.as_ref(),
            template: $spec.template.as_ref(),
        }
    };
}

impl ValidatedEnginePool {
    /// Checks a PrefillPool spec.
    pub fn from_prefill(spec: &PrefillPoolSpec) -> Result<Self, SpecError> {
        let slo_millis = ranged("slo.ttftMillis", spec.slo.ttft_millis, 1, 3_600_000)?;
        Self::build(Role::Prefill, slo_millis, engine_fields!(spec))
    }

    /// Checks a DecodePool spec.
    pub fn from_decode(spec: &DecodePoolSpec) -> Result<Self, SpecError> {
        let slo_millis = ranged("slo.tpotMillis", spec.slo.tpot_millis, 1, 60_000)?;
        Self::build(Role::Decode, slo_millis, engine_fields!(spec))
    }

    /// The role's SLO as a duration.
    pub fn slo(&self) -> Duration {
        Duration::from_millis(u64::from(self.slo_millis))
    }

    fn build(role: Role, slo_millis: u32, f: EngineFields<'_>) -> Result<Self, SpecError> {
        if f.pool.is_empty() {
            return Err(SpecError::Missing {
                field: "kvCachePoolRef.name",
                message: "names the KVCachePool to use",
            });
        }
        let replicas = ranged("replicas", f.replicas, 0, 1024)?;
        let gpus: u32 = ranged("resources.gpus", f.resources.gpus, 0, 64)?;
        let tensor_parallel_size: u32 =
            ranged("tensorParallelSize", f.tensor_parallel_size, 1, 64)?;
        if !gpus.is_multiple_of(tensor_parallel_size) {
            return Err(SpecError::Conflict {
                field: "resources.gpus",
                message: "must be a multiple of tensorParallelSize",
            });
        }
        if f.engine.kind != EngineKind::Custom && f.engine.model.is_none() {
            return Err(SpecError::Missing {
                field: "engine.model",
                message: "required for engine.kind vllm and sglang",
            });
        }
        if f.engine.image.is_empty() {
            return Err(SpecError::Missing {
                field: "engine.image",
                message: "names the engine's container image",
            });
        }
        let autoscaling = match f.autoscaling {
            None => None,
            Some(a) => {
                let min_replicas = ranged("autoscaling.minReplicas", a.min_replicas, 0, 1024)?;
                let max_replicas = ranged("autoscaling.maxReplicas", a.max_replicas, 1, 1024)?;
                if min_replicas > max_replicas {
                    return Err(SpecError::Conflict {
                        field: "autoscaling.minReplicas",
                        message: "must not exceed autoscaling.maxReplicas",
                    });
                }
                if replicas < min_replicas || replicas > max_replicas {
                    return Err(SpecError::Conflict {
                        field: "replicas",
                        message: "must lie within autoscaling.minReplicas..autoscaling.maxReplicas",
                    });
                }
                Some(AutoscalingConfig {
                    min_replicas,
                    max_replicas,
                    signal: a.signal,
                })
            }
        };
        if let Some(t) = f.template {
            check_template(t)?;
        }
        Ok(Self {
            role,
            kv_cache_pool: f.pool.to_owned(),
            replicas,
            kind: f.engine.kind,
            image: f.engine.image.clone(),
            model: f.engine.model.clone(),
            command: f.engine.command.clone(),
            args: f.engine.args.clone(),
            env: f.engine.env.clone(),
            gpus,
            gpu_resource_name: f.resources.gpu_resource_name.clone(),
            rdma: f.resources.rdma.clone(),
            container: f.resources.container.clone(),
            tensor_parallel_size,
            slo_millis,
            autoscaling,
            template: f.template.cloned(),
        })
    }
}

/// The checks of `spec.template` the API server makes only on the Deployment (too late to name
/// the engine pool's field): label and annotation keys, label values, node selector entries.
fn check_template(t: &EnginePodTemplate) -> Result<(), SpecError> {
    let labels = |field: &'static str, map: &BTreeMap<String, String>| {
        for (key, value) in map {
            validate_label_key(field, key)?;
            if !value.is_empty() {
                check_label_value(value).map_err(|message| SpecError::InvalidLabelValue {
                    field,
                    key: key.clone(),
                    value: value.clone(),
                    message,
                })?;
            }
        }
        Ok(())
    };
    if let Some(m) = &t.metadata {
        labels("template.metadata.labels", &m.labels)?;
        for key in m.annotations.keys() {
            validate_label_key("template.metadata.annotations", key)?;
        }
    }
    if let Some(s) = &t.spec {
        labels("template.spec.nodeSelector", &s.node_selector)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DecodePool, PrefillPool};

    fn prefill(spec_yaml: &str) -> PrefillPoolSpec {
        let spec = format!("  kvCachePoolRef: {{name: cache}}\n{spec_yaml}");
        crate::validated::fixture::<PrefillPool>(&spec).spec
    }

    #[test]
    fn engine_pools_share_one_validated_shape() {
        let p = ValidatedEnginePool::from_prefill(&prefill(
            "  replicas: 2\n  engine: {kind: vllm, image: vllm/vllm-openai, model: m}\n  tensorParallelSize: 4\n  resources: {gpus: 8}\n  autoscaling: {minReplicas: 1, maxReplicas: 4}",
        ))
        .expect("valid");
        assert_eq!(p.role, Role::Prefill);
        assert_eq!(p.role.as_str(), "prefill");
        assert_eq!(p.kv_cache_pool, "cache");
        assert_eq!((p.replicas, p.gpus, p.tensor_parallel_size), (2, 8, 4));
        assert_eq!(p.gpu_resource_name, "nvidia.com/gpu");
        assert_eq!(p.slo(), Duration::from_secs(2));
        assert_eq!(
            p.autoscaling,
            Some(AutoscalingConfig {
                min_replicas: 1,
                max_replicas: 4,
                signal: AutoscalingSignal::SloAttainment
            })
        );

        let text = "apiVersion: kvpool.dev/v1alpha1\nkind: DecodePool\nmetadata: {name: d}\nspec:\n  kvCachePoolRef: {name: cache}\n  engine: {kind: custom, image: my/engine}\n  resources: {gpus: 0}\n  slo: {tpotMillis: 40}";
        let d: DecodePool = serde_saphyr::from_str(text).expect("parses");
        let d = ValidatedEnginePool::from_decode(&d.spec).expect("custom needs no model");
        assert_eq!(
            (d.role, d.gpus, d.model.as_deref()),
            (Role::Decode, 0, None)
        );
        assert_eq!(d.slo(), Duration::from_millis(40));
        assert_eq!(d.role.component(), Component::Decode);
    }

    #[test]
    fn the_pod_template_is_kept_as_written() {
        let p = ValidatedEnginePool::from_prefill(&prefill(
            "  engine: {kind: custom, image: i}\n  template:\n    metadata: {labels: {team: ml, empty: ''}, annotations: {'example.com/note': 'any text'}}\n    spec:\n      imagePullSecrets: [{name: regcred}]\n      volumes: [{name: models, persistentVolumeClaim: {claimName: models}}]\n      containers: [{name: engine, volumeMounts: [{name: models, mountPath: /models}]}]",
        ))
        .expect("valid");
        let t = p.template.expect("template");
        let spec = t.spec.expect("spec");
        assert_eq!(spec.image_pull_secrets[0].name, "regcred");
        assert_eq!(spec.volumes[0].name, "models");
        assert_eq!(spec.containers[0].name, crate::ENGINE_CONTAINER);
        let err = ValidatedEnginePool::from_prefill(&prefill(
            "  engine: {kind: custom, image: i}\n  template: {metadata: {labels: {team: 'ml platform'}}}",
        ))
        .expect_err("a space in a label value");
        assert_eq!(err.category(), "invalid_label_value");
        assert_eq!(
            err.to_string(),
            "spec.template.metadata.labels[\"team\"]: the value \"ml platform\" is not a label value: it must be alphanumerics, '-', '_' and '.', starting and ending with an alphanumeric"
        );
    }

    #[test]
    fn engine_pool_errors_name_the_field() {
        let cases: &[(&str, &str)] = &[
            ("  engine: {kind: vllm, image: i}", "engine.model"),
            ("  engine: {kind: custom, image: ''}", "engine.image"),
            (
                "  engine: {kind: custom, image: i}\n  tensorParallelSize: 2\n  resources: {gpus: 3}",
                "resources.gpus",
            ),
            (
                "  engine: {kind: custom, image: i}\n  replicas: 5\n  autoscaling: {maxReplicas: 4}",
                "replicas",
            ),
            (
                "  engine: {kind: custom, image: i}\n  autoscaling: {minReplicas: 3, maxReplicas: 2}",
                "autoscaling.minReplicas",
            ),
            (
                "  engine: {kind: custom, image: i}\n  slo: {ttftMillis: 0}",
                "slo.ttftMillis",
            ),
            (
                "  engine: {kind: custom, image: i}\n  replicas: -1",
                "replicas",
            ),
            (
                "  engine: {kind: custom, image: i}\n  template: {metadata: {labels: {'team name': ml}}}",
                "template.metadata.labels",
            ),
            (
                "  engine: {kind: custom, image: i}\n  template: {metadata: {labels: {team: 'ml platform'}}}",
                "template.metadata.labels",
            ),
            (
                "  engine: {kind: custom, image: i}\n  template: {metadata: {annotations: {'-x/y': ok}}}",
                "template.metadata.annotations",
            ),
            (
                "  engine: {kind: custom, image: i}\n  template: {spec: {nodeSelector: {pool: 'gpu/a'}}}",
                "template.spec.nodeSelector",
            ),
        ];
        for (yaml, field) in cases {
            let err = ValidatedEnginePool::from_prefill(&prefill(yaml)).expect_err(yaml);
            assert_eq!(err.field(), *field, "{yaml}: {err}");
        }
    }
}

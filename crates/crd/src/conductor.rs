//! The conductor's part of a `KVCachePool`: replicas, SLOs, the engines' block size and the
//! model's tokenizer files, which make the conductor's block hashes the engines', and the
//! Secrets of its API keys. Pure types, no I/O.

use k8s_openapi::api::core::v1::ResourceRequirements;
use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::defaults;
use super::pod_template::SecretKeyRef;

/// The scheduler and front door.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConductorSpec {
    /// Run a conductor for this pool.
    #[serde(default = "defaults::enabled")]
    pub enabled: bool,

    /// Conductor replicas (they share state through the master).
    #[serde(default = "defaults::one")]
    #[schemars(range(min = 1, max = 16))]
    pub replicas: i32,

    /// Default service-level objectives; a request is rejected early when the conductor predicts
    /// it cannot meet them.
    #[serde(default)]
    pub slo: ConductorSlo,

    /// Image of the `kvpool` CLI. Absent: the operator's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,

    /// Compute resources of the conductor container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,

    /// Tokens per KV block of the engines (vLLM's `--block-size`, SGLang's `--page-size`): the
    /// unit of the engines' block hashes and KV events, which the conductor recomputes for every
    /// request. The operator passes it to the conductor and to `vllm` and `sglang` engines
    /// (engine args that set it otherwise break the join). Default 16, vLLM's default on GPUs.
    #[serde(default = "defaults::engine_block_size")]
    #[schemars(range(min = 1, max = 1024))]
    pub engine_block_size: i32,

    /// The model's tokenizer files, so that the conductor's block hashes follow the engines'
    /// tokens: a volume holding `tokenizer.json` and, for chat requests, `tokenizer_config.json`
    /// (its `chat_template`) or `chat_template.jinja`. Absent: the files of the model the
    /// engine pools load, when they all serve one model from a path in one
    /// PersistentVolumeClaim (docs/crds.md, "Several engine pools on one KVCachePool"); else
    /// the conductor asks a prefill engine's `/tokenize` (vLLM's) for each prompt's tokens, and
    /// engines without it (SGLang) leave prompts keyed by stand-in text chunks, which match no
    /// real engine's blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<TokenizerSpec>,

    /// The client API keys: a Secret key holding one key per line (blank lines and `#`
    /// comments skipped). Every request but `/health` and `/v1/kvpool/load` must then carry
    /// one as `Authorization: Bearer <key>`, else 401. The conductor reads the keys at start:
    /// restart it after changing them. Absent: no key is asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_secret: Option<SecretKeyRef>,

    /// The engines' API key (their `--api-key`): a Secret key holding exactly one key, sent as
    /// `Authorization: Bearer` on every call to the engines. Absent: a client's own
    /// `Authorization` goes to the engines with its request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_api_key_secret: Option<SecretKeyRef>,
}

/// Where the conductor finds the model's tokenizer files (exactly one source).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(has(self.configMap) ? 1 : 0) + (has(self.persistentVolumeClaim) ? 1 : 0) + (has(self.image) ? 1 : 0) == 1").message("conductor.tokenizer needs exactly one of configMap, persistentVolumeClaim and image").reason(Reason::FieldValueInvalid))]
pub struct TokenizerSpec {
    /// A ConfigMap whose keys are the files (`tokenizer.json`, ...). A ConfigMap holds at most
    /// 1 MiB, too little for most real tokenizers: use a volume claim or an image for those.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub config_map: Option<String>,

    /// A PersistentVolumeClaim holding the files (mounted read-only; ReadOnlyMany or
    /// ReadWriteMany when the conductor has several replicas).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub persistent_volume_claim: Option<String>,

    /// An OCI image holding the files, mounted as an image volume (Kubernetes 1.33 and later).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub image: Option<String>,

    /// The directory inside the volume that holds the files (relative, no `..`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    #[x_kube(validation = Rule::new("self.matches('^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$') && !self.matches('(^|/)[.][.]?(/|$)')").message("conductor.tokenizer.subPath must be a relative path without '.' or '..' segments").reason(Reason::FieldValueInvalid))]
    pub sub_path: Option<String>,
}

impl Default for ConductorSpec {
    fn default() -> Self {
        Self {
            enabled: defaults::enabled(),
            replicas: defaults::one(),
            slo: ConductorSlo::default(),
            image: None,
            resources: None,
            engine_block_size: defaults::engine_block_size(),
            tokenizer: None,
            api_key_secret: None,
            engine_api_key_secret: None,
        }
    }
}

/// Latency objectives, in whole milliseconds.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConductorSlo {
    /// Time to first token, milliseconds.
    #[serde(default = "defaults::ttft_millis")]
    #[schemars(range(min = 1, max = 3_600_000))]
    pub ttft_millis: i32,

    /// Time per output token, milliseconds.
    #[serde(default = "defaults::tpot_millis")]
    #[schemars(range(min = 1, max = 60_000))]
    pub tpot_millis: i32,
}

impl Default for ConductorSlo {
    fn default() -> Self {
        Self {
            ttft_millis: defaults::ttft_millis(),
            tpot_millis: defaults::tpot_millis(),
        }
    }
}

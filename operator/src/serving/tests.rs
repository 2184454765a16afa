use kvpool_crd::conditions::reasons;
use kvpool_crd::{DecodePool, PrefillPool, Role};

use super::*;
use crate::test_fixtures::{decode_sglang, prefill_custom, prefill_vllm};

/// A vLLM pool of `role` named `name` serving `model` over `tp` GPUs.
fn vllm(role: Role, name: &str, model: &str, tp: u32) -> EngineServing {
    EngineServing {
        kind: match role {
            Role::Prefill => "PrefillPool",
            Role::Decode => "DecodePool",
        },
        name: name.to_owned(),
        role,
        model: Some(model.to_owned()),
        protocol: "vllm".to_owned(),
        protocol_source: "engine.kind vllm",
        tensor_parallel_size: tp,
        model_files: None,
    }
}

fn sglang(role: Role, name: &str, model: &str, tp: u32) -> EngineServing {
    EngineServing {
        protocol: "sglang".to_owned(),
        protocol_source: "engine.kind sglang",
        ..vllm(role, name, model, tp)
    }
}

/// A custom engine without `engine.model`.
fn unknown(role: Role, name: &str) -> EngineServing {
    EngineServing {
        model: None,
        protocol_source: "engine.kind custom, the conductor's default",
        ..vllm(role, name, "-", 1)
    }
}

#[test]
fn one_model_with_prefill_and_decode_that_agree_passes() {
    let pools = [
        vllm(Role::Prefill, "qwen", "Qwen/Qwen3-8B", 2),
        vllm(Role::Decode, "qwen", "Qwen/Qwen3-8B", 2),
        vllm(Role::Decode, "qwen-long", "Qwen/Qwen3-8B", 2),
    ];
    assert_eq!(check(&pools), []);
    let c = pool_condition("cache", &pools);
    assert!(!c.status);
    assert_eq!(c.reason, reasons::ENGINE_POOLS_MATCH);
    assert_eq!(
        c.message,
        "the engine pools agree on each model: \"Qwen/Qwen3-8B\" by DecodePool qwen, \
         DecodePool qwen-long, PrefillPool qwen"
    );
    let e = engine_condition("cache", &pools[1], &pools);
    assert!(!e.status);
    assert!(
        e.message.contains("vllm") && e.message.contains("(2)"),
        "{}",
        e.message
    );
}

/// Two models on one pool, each with its own prefill and decode pools, even of different
/// engines and sizes: each model is checked on its own.
#[test]
fn two_models_each_with_its_own_prefill_and_decode_pools_pass() {
    let pools = [
        vllm(Role::Prefill, "qwen", "Qwen/Qwen3-8B", 1),
        sglang(Role::Prefill, "llama", "meta-llama/Llama-3.1-70B", 4),
        vllm(Role::Decode, "qwen", "Qwen/Qwen3-8B", 1),
        sglang(Role::Decode, "llama", "meta-llama/Llama-3.1-70B", 4),
    ];
    assert_eq!(check(&pools), []);
    let c = pool_condition("cache", &pools);
    assert!(!c.status, "{}", c.message);
    assert!(
        c.message
            .contains("\"meta-llama/Llama-3.1-70B\" by DecodePool llama, PrefillPool llama")
    );
    assert!(
        c.message
            .contains("\"Qwen/Qwen3-8B\" by DecodePool qwen, PrefillPool qwen")
    );
    // The conductor gets no model directory, and no tensor parallel size (they differ).
    assert_eq!(conductor_facts(&pools), ConductorFacts::default());
}

#[test]
fn a_model_without_decode_pools_is_reported_on_its_prefill_pools_only() {
    let pools = [
        vllm(Role::Prefill, "qwen", "Qwen/Qwen3-8B", 1),
        vllm(Role::Decode, "qwen", "Qwen/Qwen3-8B", 1),
        vllm(Role::Prefill, "llama", "meta-llama/Llama-3.1-8B", 1),
    ];
    assert_eq!(
        check(&pools),
        [Mismatch::NoDecode {
            model: "meta-llama/Llama-3.1-8B".into(),
            pools: vec!["PrefillPool llama".into()],
        }]
    );
    let c = pool_condition("cache", &pools);
    assert!(c.status);
    assert_eq!(c.reason, reasons::NO_DECODE_POOL);
    assert_eq!(
        c.message,
        "model \"meta-llama/Llama-3.1-8B\" is served by PrefillPool llama but by no DecodePool \
         of KVCachePool cache: its requests cannot be decoded"
    );
    assert!(engine_condition("cache", &pools[2], &pools).status);
    // The qwen pools are not concerned.
    let qwen = engine_condition("cache", &pools[0], &pools);
    assert!(!qwen.status);
    assert_eq!(qwen.reason, reasons::ENGINE_POOLS_MATCH);
}

#[test]
fn a_model_without_prefill_pools_is_reported() {
    let pools = [vllm(Role::Decode, "qwen", "Qwen/Qwen3-8B", 1)];
    let c = pool_condition("cache", &pools);
    assert_eq!(c.reason, reasons::NO_PREFILL_POOL);
    assert!(
        c.message
            .contains("served by DecodePool qwen but by no PrefillPool"),
        "{}",
        c.message
    );
    assert_eq!(
        engine_condition("cache", &pools[0], &pools).reason,
        reasons::NO_PREFILL_POOL
    );
}

#[test]
fn pools_of_one_model_with_different_conventions_are_reported() {
    let pools = [
        vllm(Role::Prefill, "qwen", "Qwen/Qwen3-8B", 1),
        sglang(Role::Decode, "qwen", "Qwen/Qwen3-8B", 1),
    ];
    let c = pool_condition("cache", &pools);
    assert!(c.status);
    assert_eq!(c.reason, reasons::ENGINE_PROTOCOL_MISMATCH);
    assert_eq!(
        c.message,
        "the pools of KVCachePool cache serving model \"Qwen/Qwen3-8B\" hand KV over by \
         different conventions: DecodePool qwen (sglang: engine.kind sglang), PrefillPool qwen \
         (vllm: engine.kind vllm)"
    );
    for p in &pools {
        assert_eq!(
            engine_condition("cache", p, &pools).reason,
            reasons::ENGINE_PROTOCOL_MISMATCH
        );
    }
    // A custom engine that declares vLLM's convention pairs with vLLM engines.
    let custom = EngineServing {
        protocol_source: "engine.kind custom, the conductor's default",
        ..vllm(Role::Decode, "qwen", "Qwen/Qwen3-8B", 1)
    };
    assert_eq!(check(&[pools[0].clone(), custom]), []);
}

#[test]
fn pools_of_one_model_with_different_tensor_parallel_sizes_are_reported() {
    let pools = [
        vllm(Role::Prefill, "qwen", "Qwen/Qwen3-32B", 4),
        vllm(Role::Decode, "qwen", "Qwen/Qwen3-32B", 2),
    ];
    let c = pool_condition("cache", &pools);
    assert_eq!(c.reason, reasons::TENSOR_PARALLEL_MISMATCH);
    assert!(
        c.message.ends_with(
            "DecodePool qwen (tensorParallelSize 2), PrefillPool qwen (tensorParallelSize 4)"
        ),
        "{}",
        c.message
    );
    assert_eq!(conductor_facts(&pools).tensor_parallel_size, None);
}

/// Several failures: the first one's reason, every message.
#[test]
fn several_failures_are_all_named() {
    let pools = [
        vllm(Role::Prefill, "qwen", "Qwen/Qwen3-32B", 4),
        sglang(Role::Decode, "qwen", "Qwen/Qwen3-32B", 2),
        vllm(Role::Decode, "llama", "meta-llama/Llama-3.1-8B", 1),
    ];
    let found: Vec<&str> = check(&pools).iter().map(Mismatch::reason).collect();
    // By model ("Qwen/..." sorts before "meta-llama/..."), then by kind of failure.
    assert_eq!(
        found,
        [
            reasons::ENGINE_PROTOCOL_MISMATCH,
            reasons::TENSOR_PARALLEL_MISMATCH,
            reasons::NO_PREFILL_POOL,
        ]
    );
    let c = pool_condition("cache", &pools);
    assert_eq!(c.reason, reasons::ENGINE_PROTOCOL_MISMATCH);
    assert_eq!(c.message.matches("; ").count(), 2, "{}", c.message);
    // The llama pool sees only its own failure.
    let llama = engine_condition("cache", &pools[2], &pools);
    assert_eq!(llama.reason, reasons::NO_PREFILL_POOL);
    assert!(!llama.message.contains("Qwen"), "{}", llama.message);
}

/// A custom engine without `engine.model` serves a model the operator cannot know: it is
/// compared with nothing, and counts as a possible pool of its role for every model.
#[test]
fn pools_of_unknown_models_are_not_checked() {
    let only = [
        unknown(Role::Prefill, "synthetic"),
        unknown(Role::Decode, "synthetic"),
    ];
    assert_eq!(check(&only), []);
    let c = pool_condition("tcp", &only);
    assert!(!c.status);
    assert!(c.message.contains("not checked"), "{}", c.message);
    assert!(
        engine_condition("tcp", &only[0], &only)
            .message
            .contains("unknown")
    );

    let mixed = [
        vllm(Role::Prefill, "qwen", "Qwen/Qwen3-8B", 1),
        unknown(Role::Decode, "synthetic"),
    ];
    assert_eq!(check(&mixed), []);
    assert_eq!(
        pool_condition("cache", &[]).message,
        "no valid PrefillPool or DecodePool references the pool"
    );
}

#[test]
fn served_model_names_come_from_the_engine_arguments() {
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(served_model_name(&args(&["--max-model-len", "8"])), None);
    assert_eq!(
        served_model_name(&args(&["--served-model-name", "qwen", "q"])),
        Some("qwen".into())
    );
    assert_eq!(
        served_model_name(&args(&["--served-model-name=qwen"])),
        Some("qwen".into())
    );
    assert_eq!(
        served_model_name(&args(&["--served-model-name", "--x"])),
        None
    );
}

/// What the fixtures serve: the engine kind gives the convention, a custom engine's template
/// may declare one, and `--served-model-name` renames the model.
#[test]
fn serving_reads_the_engine_pools_spec() {
    let prefill = serving(&prefill_vllm()).expect("valid");
    assert_eq!(
        (prefill.kind, prefill.role, prefill.protocol.as_str()),
        ("PrefillPool", Role::Prefill, "vllm")
    );
    assert_eq!(prefill.model.as_deref(), Some("Qwen/Qwen3-32B"));
    assert_eq!(prefill.tensor_parallel_size, 4);
    assert_eq!(prefill.model_files, None, "a Hugging Face id");
    let decode: DecodePool = decode_sglang();
    let decode = serving(&decode).expect("valid");
    assert_eq!(
        (decode.protocol.as_str(), decode.tensor_parallel_size),
        ("sglang", 2)
    );
    // The fixtures disagree on both counts.
    let reasons: Vec<&str> = check(&[prefill, decode])
        .iter()
        .map(Mismatch::reason)
        .collect();
    assert_eq!(
        reasons,
        [
            reasons::ENGINE_PROTOCOL_MISMATCH,
            reasons::TENSOR_PARALLEL_MISMATCH
        ]
    );

    let mut custom: PrefillPool = prefill_custom();
    let plain = serving(&custom).expect("valid");
    assert_eq!(
        (plain.model.as_deref(), plain.protocol.as_str()),
        (None, "vllm")
    );
    custom.spec.engine.model = Some("/models/qwen".into());
    custom.spec.engine.args = vec!["--served-model-name".into(), "qwen".into()];
    custom.spec.template = Some(
        serde_saphyr::from_str(
            "metadata: {annotations: {kvpool.dev/engine-protocol: vllm-mooncake}}",
        )
        .expect("template"),
    );
    let named = serving(&custom).expect("valid");
    assert_eq!(named.model.as_deref(), Some("qwen"));
    assert_eq!(named.protocol, "vllm-mooncake");

    let mut invalid = prefill_vllm();
    invalid.spec.resources.gpus = 3;
    assert_eq!(serving(&invalid), None, "an invalid pool runs nothing");
}

fn template(yaml: &str) -> kvpool_crd::EnginePodTemplate {
    serde_saphyr::from_str(yaml).expect("template")
}

const CLAIM_TEMPLATE: &str = "
spec:
  volumes:
    - {name: models, persistentVolumeClaim: {claimName: weights}}
    - {name: scratch, emptyDir: {}}
  containers:
    - name: engine
      volumeMounts:
        - {name: models, mountPath: /models, subPath: hub}
        - {name: scratch, mountPath: /models/tmp}
";

#[test]
fn a_model_path_inside_a_claim_the_engine_mounts_is_found() {
    let t = template(CLAIM_TEMPLATE);
    assert_eq!(
        conductor::model_files("/models/qwen/8b", Some(&t)),
        Some(ModelFiles {
            claim: "weights".into(),
            path: "hub/qwen/8b".into()
        })
    );
    // The deepest mount is the one the path lies in: not a claim.
    assert_eq!(conductor::model_files("/models/tmp/qwen", Some(&t)), None);
    // A Hugging Face id, a path outside every mount, an escape, no template.
    for model in ["Qwen/Qwen3-8B", "/opt/qwen", "/models/../etc"] {
        assert_eq!(conductor::model_files(model, Some(&t)), None, "{model}");
    }
    assert_eq!(conductor::model_files("/models/qwen", None), None);
    // A mount path is matched by components, not by characters.
    assert_eq!(conductor::model_files("/modelsx/qwen", Some(&t)), None);
    let root = template(
        "spec:\n  volumes: [{name: m, persistentVolumeClaim: {claimName: w}}]\n  \
         containers: [{name: engine, volumeMounts: [{name: m, mountPath: /models/qwen/}]}]\n",
    );
    assert_eq!(
        conductor::model_files("/models/qwen", Some(&root)),
        Some(ModelFiles {
            claim: "w".into(),
            path: String::new()
        })
    );
}

#[test]
fn the_conductor_gets_the_agreed_size_and_one_models_files() {
    let files = ModelFiles {
        claim: "weights".into(),
        path: "qwen".into(),
    };
    let with_files = |mut p: EngineServing| {
        p.model_files = Some(files.clone());
        p
    };
    let pools = [
        with_files(vllm(Role::Prefill, "qwen", "/models/qwen", 2)),
        with_files(vllm(Role::Decode, "qwen", "/models/qwen", 2)),
    ];
    assert_eq!(
        conductor_facts(&pools),
        ConductorFacts {
            tensor_parallel_size: Some(2),
            model_files: Some(files.clone()),
        }
    );
    // One pool loads it from elsewhere (or not from a claim): no files.
    let elsewhere = [
        pools[0].clone(),
        vllm(Role::Decode, "qwen", "/models/qwen", 2),
    ];
    assert_eq!(
        conductor_facts(&elsewhere),
        ConductorFacts {
            tensor_parallel_size: Some(2),
            model_files: None,
        }
    );
    // Two models: no files, even if the first pools have them.
    let two = [
        pools[0].clone(),
        pools[1].clone(),
        vllm(Role::Prefill, "llama", "llama", 2),
    ];
    assert_eq!(conductor_facts(&two).model_files, None);
    // A pool of unknown model: no files either.
    let unknown_too = [
        pools[0].clone(),
        pools[1].clone(),
        unknown(Role::Decode, "x"),
    ];
    assert_eq!(conductor_facts(&unknown_too).model_files, None);
    assert_eq!(conductor_facts(&[]), ConductorFacts::default());
}

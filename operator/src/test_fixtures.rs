//! YAML fixtures under operator/tests/fixtures, parsed for unit tests, and lookups into the
//! argument lists and volumes the builders return. Test-only, no I/O.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, HostPathVolumeSource, PodTemplateSpec, Volume};
use kvpool_crd::{DecodePool, KVCachePool, PrefillPool};

use crate::cachepool::validate::{ValidCachePool, validate};
use crate::context::Settings;

fn parse<T: serde::de::DeserializeOwned>(text: &str) -> T {
    serde_saphyr::from_str(text).expect("fixture parses")
}

pub fn roce() -> KVCachePool {
    parse(include_str!("../tests/fixtures/kvcachepool-roce.yaml"))
}

pub fn tcp() -> KVCachePool {
    parse(include_str!("../tests/fixtures/kvcachepool-tcp.yaml"))
}

pub fn prefill_vllm() -> PrefillPool {
    parse(include_str!("../tests/fixtures/prefillpool-vllm.yaml"))
}

pub fn decode_sglang() -> DecodePool {
    parse(include_str!("../tests/fixtures/decodepool-sglang.yaml"))
}

pub fn prefill_custom() -> PrefillPool {
    parse(include_str!("../tests/fixtures/prefillpool-custom.yaml"))
}

pub fn valid(pool: &KVCachePool) -> ValidCachePool {
    validate(pool, &Settings::for_tests()).expect("fixture is valid")
}

/// The value that follows `flag` in `args`.
pub fn after<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.windows(2)
        .find(|w| w[0] == flag)
        .map(|w| w[1].as_str())
}

/// Whether `flag` followed by `value` stands anywhere in `args`.
pub fn has_arg(args: &[String], flag: &str, value: &str) -> bool {
    args.windows(2).any(|w| w[0] == flag && w[1] == value)
}

/// The host directory of the hostPath volume `name`.
pub fn host_path<'a>(volumes: &'a [Volume], name: &str) -> &'a HostPathVolumeSource {
    volumes
        .iter()
        .find(|v| v.name == name)
        .and_then(|v| v.host_path.as_ref())
        .unwrap_or_else(|| panic!("{name} hostPath"))
}

/// The labels of a pod template.
pub fn template_labels(template: &PodTemplateSpec) -> &BTreeMap<String, String> {
    let meta = template.metadata.as_ref().expect("template metadata");
    meta.labels.as_ref().expect("template labels")
}

/// The annotations of a pod template.
pub fn template_annotations(template: &PodTemplateSpec) -> &BTreeMap<String, String> {
    let meta = template.metadata.as_ref().expect("template metadata");
    meta.annotations.as_ref().expect("annotations")
}

/// `c` runs the `kvpool` binary with `command_line`, split at white space, as its arguments.
pub fn assert_runs_kvpool(c: &Container, command_line: &str) {
    assert_eq!(c.command.as_deref(), Some(&["kvpool".to_owned()][..]));
    let args: Vec<&str> = c
        .args
        .as_deref()
        .expect("args")
        .iter()
        .map(String::as_str)
        .collect();
    assert_eq!(args, command_line.split_whitespace().collect::<Vec<_>>());
}

//! YAML fixtures under operator/tests/fixtures, parsed for unit tests. Test-only.

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

//! Default values of the custom resources' fields, shared by the serde defaults, the generated
//! schema and the operator's effective settings. Pure constants, no I/O.

/// Tokens per block when `blockSizeTokens` is absent (the Mooncake trace's block size).
pub const BLOCK_SIZE_TOKENS: i32 = 512;
/// Share of node memory, in percent, that the DRAM tier takes when no size is given.
pub const NODE_MEMORY_PERCENT: i32 = 25;
/// TCP port of the agents' transfer endpoint.
pub const TRANSPORT_PORT: i32 = 15500;
/// DRAM usage, in percent, at which eviction starts.
pub const HIGH_WATERMARK_PERCENT: i32 = 90;
/// DRAM usage, in percent, at which eviction stops.
pub const LOW_WATERMARK_PERCENT: i32 = 80;
/// Node label that copies of a block are spread over.
pub const SPREAD_LABEL_KEY: &str = "kubernetes.io/hostname";
/// Extended resource name of an NVIDIA GPU.
pub const GPU_RESOURCE_NAME: &str = "nvidia.com/gpu";
/// Time-to-first-token objective, milliseconds.
pub const TTFT_MILLIS: i32 = 2_000;
/// Time-per-output-token objective, milliseconds.
pub const TPOT_MILLIS: i32 = 100;

pub(crate) fn block_size_tokens() -> i32 {
    BLOCK_SIZE_TOKENS
}

pub(crate) fn transport_port() -> i32 {
    TRANSPORT_PORT
}

pub(crate) fn high_watermark_percent() -> i32 {
    HIGH_WATERMARK_PERCENT
}

pub(crate) fn low_watermark_percent() -> i32 {
    LOW_WATERMARK_PERCENT
}

pub(crate) fn spread_label_key() -> String {
    SPREAD_LABEL_KEY.to_owned()
}

pub(crate) fn gpu_resource_name() -> String {
    GPU_RESOURCE_NAME.to_owned()
}

/// vLLM's default KV block size on GPUs, tokens.
pub const ENGINE_BLOCK_SIZE: i32 = 16;

pub(crate) fn engine_block_size() -> i32 {
    ENGINE_BLOCK_SIZE
}

pub(crate) fn ttft_millis() -> i32 {
    TTFT_MILLIS
}

pub(crate) fn tpot_millis() -> i32 {
    TPOT_MILLIS
}

pub(crate) fn one() -> i32 {
    1
}

pub(crate) fn enabled() -> bool {
    true
}

//! SGLang's health and server-information endpoints, which SGLang's router (`sglang-router`)
//! calls when it registers a worker and then at every health-check interval: `GET /health`
//! (200, empty body, once the engine serves), `GET /server_info` and `GET /model_info` (and
//! their older names `/get_server_info` and `/get_model_info`, which the router falls back to
//! on a 404). The bodies carry the subset of SGLang's fields a router reads: the served model,
//! one tensor/data-parallel rank, and the disaggregation mode (`"null"`, `"prefill"` or
//! `"decode"`, as SGLang spells them). Pure: JSON from the engine's configuration; I/O
//! boundary: none (the routes are served with the rest of `endpoints`).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Json;
use axum::routing::get;
use serde_json::{Value, json};

use super::shared::Shared;
use crate::{EngineConfig, SglangRole};

/// SGLang's `--disaggregation-mode` value for this engine.
fn disaggregation_mode(config: &EngineConfig) -> &'static str {
    match config.sglang.map(|m| m.role) {
        None => "null",
        Some(SglangRole::Prefill) => "prefill",
        Some(SglangRole::Decode) => "decode",
    }
}

/// The body of `GET /server_info`: SGLang answers with its server arguments and scheduler
/// state; these are the ones a router reads.
pub(super) fn server_info(config: &EngineConfig) -> Value {
    json!({
        "model_path": config.model,
        "served_model_name": config.model,
        "tokenizer_path": null,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "disaggregation_mode": disaggregation_mode(config),
        "disaggregation_transfer_backend": "kvpool",
        "version": concat!("kvpool-synthetic ", env!("CARGO_PKG_VERSION")),
        "internal_states": [],
    })
}

/// The body of `GET /model_info`, SGLang's fields.
pub(super) fn model_info(config: &EngineConfig) -> Value {
    json!({
        "model_path": config.model,
        "tokenizer_path": null,
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": "default",
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "model_type": null,
        "architectures": null,
    })
}

/// Adds SGLang's health and information routes to the engine's router.
pub(super) fn routes(router: Router<Arc<Shared>>) -> Router<Arc<Shared>> {
    let server = |State(s): State<Arc<Shared>>| async move { Json(server_info(&s.config)) };
    let model = |State(s): State<Arc<Shared>>| async move { Json(model_info(&s.config)) };
    router
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/server_info", get(server))
        .route("/get_server_info", get(server))
        .route("/model_info", get(model))
        .route("/get_model_info", get(model))
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use axum::body::Body;
    use axum::http::Request;
    use kvpool_core::sched::{DecodeCost, PrefillCost};
    use prometheus::Registry;
    use tower::ServiceExt;

    use super::*;
    use crate::SglangMode;

    fn config(role: Option<SglangRole>) -> EngineConfig {
        EngineConfig {
            model: "synthetic-70b".into(),
            prefill_cost: PrefillCost::default(),
            decode_cost: DecodeCost::default(),
            block_size: NonZeroU32::new(16).unwrap(),
            cache_blocks: 10,
            chunk_bytes: 4,
            time_scale: 0.001,
            sglang: role.map(|role| SglangMode {
                role,
                bootstrap_timeout: std::time::Duration::from_secs(1),
            }),
            hashing: kvpool_core::sched::BlockHashing::vllm("0"),
        }
    }

    async fn get(config: EngineConfig, path: &str) -> (StatusCode, Vec<u8>) {
        let router = super::super::router(config, &Registry::new()).unwrap();
        let resp = router
            .oneshot(Request::get(path).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .unwrap();
        (status, body.to_vec())
    }

    #[tokio::test]
    async fn health_answers_200_with_an_empty_body_as_sglang_does() {
        let (status, body) = get(config(Some(SglangRole::Decode)), "/health").await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.is_empty());
    }

    #[tokio::test]
    async fn server_info_names_the_model_and_the_disaggregation_mode_under_both_paths() {
        for (role, mode) in [
            (None, "null"),
            (Some(SglangRole::Prefill), "prefill"),
            (Some(SglangRole::Decode), "decode"),
        ] {
            for path in ["/server_info", "/get_server_info"] {
                let (status, body) = get(config(role), path).await;
                assert_eq!(status, StatusCode::OK, "{path}");
                let v: Value = serde_json::from_slice(&body).unwrap();
                assert_eq!(v["disaggregation_mode"], mode, "{path}: {v}");
                assert_eq!(v["served_model_name"], "synthetic-70b");
                assert_eq!(v["model_path"], "synthetic-70b");
                assert_eq!(v["dp_size"], 1);
                assert_eq!(v["tp_size"], 1);
            }
        }
    }

    #[tokio::test]
    async fn model_info_says_a_generation_model_under_both_paths() {
        for path in ["/model_info", "/get_model_info"] {
            let (status, body) = get(config(None), path).await;
            assert_eq!(status, StatusCode::OK, "{path}");
            let v: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["model_path"], "synthetic-70b");
            assert_eq!(v["is_generation"], true);
        }
    }
}

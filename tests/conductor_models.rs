//! Several models on one pool (issue 35): a conductor in front of synthetic engines serving two
//! different models routes every request only to a prefill and a decode engine of its `model`
//! (as the engines list it on their `/v1/models`), also when the other model's engine holds the
//! same prompt's blocks and is idle, answers 404 `model_not_found` naming a model no engine
//! serves, and shows which engine serves what on `/v1/kvpool/status`.

mod serve_support;

use std::net::SocketAddr;

use kvpool_core::sched::{PrefillCost, Rejection};
use serde_json::{Value, json};
use serve_support::{assert_openai_error, exchange, header, start_conductor, start_engine};
use tokio_util::sync::CancellationToken;

const A: &str = "org/model-a";
const B: &str = "org/model-b";
const BLOCK: u32 = 16;

async fn engine(model: &str, shutdown: &CancellationToken) -> String {
    let (addr, _) = start_engine(serve_support::engine_config(model, BLOCK), shutdown).await;
    format!("http://{addr}")
}

/// Prefill A, prefill B, decode A, decode B, and a conductor over all four; `models` are its
/// `--model` names (empty: learnt from the engines).
async fn two_models(models: &[&str], shutdown: &CancellationToken) -> (SocketAddr, [String; 4]) {
    let urls = [
        engine(A, shutdown).await,
        engine(B, shutdown).await,
        engine(A, shutdown).await,
        engine(B, shutdown).await,
    ];
    let mut c = serve_support::conductor_config(
        A,
        BLOCK,
        vec![urls[0].clone(), urls[1].clone()],
        urls[2].clone(),
        Rejection::None,
        30.0,
    );
    c.models = models.iter().map(|m| m.to_string()).collect();
    c.decode = vec![urls[2].clone(), urls[3].clone()];
    c.scheduler.prefill_costs = vec![PrefillCost::default(); 2];
    let (conductor, _) = start_conductor(c, shutdown).await;
    (conductor, urls)
}

async fn complete(conductor: SocketAddr, model: &str, prompt: &str) -> (u16, String, String) {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 2});
    let (status, head, text) =
        exchange(conductor, "POST", "/v1/completions", &body.to_string()).await;
    assert_eq!(status, 200, "{model}: {text}");
    let engine = |h: &str| header(&head, h).unwrap_or_default().to_owned();
    (
        status,
        engine("x-kvpool-prefill-engine"),
        engine("x-kvpool-decode-engine"),
    )
}

/// Every request of each model, on the same prompts, reaches only that model's engines.
async fn requests_keep_to_their_models(conductor: SocketAddr, urls: &[String; 4]) {
    let prompt = "the same long shared prefix for both models ".repeat(8);
    for i in 0..6 {
        for (model, prefill, decode) in [(A, &urls[0], &urls[2]), (B, &urls[1], &urls[3])] {
            let (_, p, d) = complete(conductor, model, &format!("{prompt}{i}")).await;
            assert_eq!((&p, &d), (prefill, decode), "request {i} for {model}");
        }
    }
}

#[tokio::test]
async fn requests_reach_only_engines_of_their_model() {
    let shutdown = CancellationToken::new();
    let (conductor, urls) = two_models(&[], &shutdown).await;
    requests_keep_to_their_models(conductor, &urls).await;
    // A model no engine serves: 404 in OpenAI's shape, naming it.
    let body = json!({"model": "org/model-c", "prompt": "hi", "max_tokens": 1});
    let (status, _, text) = exchange(conductor, "POST", "/v1/completions", &body.to_string()).await;
    assert_eq!(status, 404, "{text}");
    assert_openai_error(&text, "model_not_found", "org/model-c");
    // The status page says which engine serves what.
    let (status, _, text) = exchange(conductor, "GET", "/v1/kvpool/status", "").await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["engine_models"][&urls[1]], json!([B]), "{text}");
    assert_eq!(v["engine_models"][&urls[2]], json!([A]), "{text}");
    shutdown.cancel();
}

#[tokio::test]
async fn with_model_flags_the_engines_answers_still_route() {
    let shutdown = CancellationToken::new();
    let (conductor, urls) = two_models(&[A, B], &shutdown).await;
    // The names served are the flags'; the engines are asked where each is served (reading
    // /v1/models asks them at once, as the first request would in the background).
    let (status, _, text) = exchange(conductor, "GET", "/v1/models", "").await;
    assert_eq!(status, 200, "{text}");
    requests_keep_to_their_models(conductor, &urls).await;
    shutdown.cancel();
}

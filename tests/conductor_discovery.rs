//! The conductor's engine set at run time: Kubernetes discovery through kube's real client
//! against an in-process API double (tower-test) that answers the Pod list and watch as the API
//! server does, and a conductor whose engines (real synthetic engines on loopback) are added and
//! removed through the same channel discovery feeds.

mod serve_support;

use std::net::SocketAddr;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use kvpool_conductor::Engines;
use kvpool_conductor::discovery::{self, DiscoveryConfig};
use kvpool_core::sched::Rejection;
use kvpool_runtime::admin::Readiness;
use prometheus::Registry;
use serde_json::{Value, json};
use serve_support::{assert_metric, conductor_config, http, listen};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

const PREFILL_SELECTOR: &str = "kvpool.dev/pool=cache,kvpool.dev/component=prefill";
const DECODE_SELECTOR: &str = "kvpool.dev/pool=cache,kvpool.dev/component=decode";

fn pod(name: &str, rv: &str, ip: Option<&str>, ready: bool) -> Value {
    let mut status = json!({
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
    });
    if let Some(ip) = ip {
        status["podIP"] = json!(ip);
    }
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "llm", "resourceVersion": rv},
           "status": status})
}

fn reply(send: tower_test::mock::SendResponse<Response<Body>>, body: Vec<u8>) {
    send.send_response(
        Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/json")
            .body(Body::from(body))
            .expect("response"),
    );
}

/// The API server side: answers the list of each selector with `lists`, its first watch with
/// the `watches` events (then the stream ends, as a watch timeout would), and parks later
/// watches unanswered. Returns how many list and watch requests it saw per role.
async fn api_server(
    mut handle: Handle,
    lists: [(String, Vec<Value>); 2],
    watches: [(String, Vec<Value>); 2],
) {
    let mut watched = [false, false];
    let mut parked = Vec::new();
    while let Some((request, send)) = handle.next_request().await {
        assert_eq!(request.method(), Method::GET, "{}", request.uri());
        assert_eq!(request.uri().path(), "/api/v1/namespaces/llm/pods");
        let query = request.uri().query().unwrap_or_default().to_owned();
        // Selectors are percent-encoded; the role names tell them apart.
        let role = if query.contains("prefill") {
            0
        } else if query.contains("decode") {
            1
        } else {
            panic!("a pod request without a role selector: {query}");
        };
        if query.contains("watch=true") {
            if watched[role] {
                parked.push(send);
                continue;
            }
            watched[role] = true;
            let (rv, events) = &watches[role];
            assert!(query.contains(&format!("resourceVersion={rv}")), "{query}");
            let mut body = Vec::new();
            for e in events {
                body.extend(serde_json::to_vec(e).expect("json"));
                body.push(b'\n');
            }
            reply(send, body);
        } else {
            let (rv, items) = &lists[role];
            let list = json!({"apiVersion": "v1", "kind": "PodList",
                              "metadata": {"resourceVersion": rv}, "items": items});
            reply(send, serde_json::to_vec(&list).expect("json"));
        }
    }
}

async fn wait_for(rx: &mut watch::Receiver<Engines>, want: &Engines) {
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if &*rx.borrow_and_update() == want {
                return;
            }
            rx.changed().await.expect("discovery still running");
        }
    })
    .await;
    assert!(
        waited.is_ok(),
        "engine set never became {want:?}; last {:?}",
        *rx.borrow()
    );
}

#[tokio::test]
async fn discovery_follows_ready_pods_through_list_and_watch() {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "llm");
    let lists = [
        (
            "10".to_owned(),
            vec![
                pod("p-ready", "5", Some("10.0.0.1"), true),
                pod("p-starting", "6", Some("10.0.0.2"), false),
                pod("p-no-ip", "7", None, true),
            ],
        ),
        ("20".to_owned(), vec![]),
    ];
    let watches = [
        (
            "10".to_owned(),
            vec![
                json!({"type": "ADDED", "object": pod("p-new", "11", Some("10.0.0.3"), true)}),
                json!({"type": "MODIFIED", "object": pod("p-starting", "12", Some("10.0.0.2"), true)}),
                json!({"type": "DELETED", "object": pod("p-ready", "13", Some("10.0.0.1"), true)}),
            ],
        ),
        (
            "20".to_owned(),
            vec![
                json!({"type": "ADDED", "object": pod("d-0", "21", Some("10.0.1.1"), true)}),
                json!({"type": "ADDED", "object": pod("d-1", "22", Some("10.0.1.2"), false)}),
            ],
        ),
    ];
    let server = tokio::spawn(api_server(handle, lists, watches));
    let (tx, mut rx) = watch::channel(Engines::default());
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(discovery::run(
        client,
        DiscoveryConfig {
            namespace: "llm".into(),
            prefill_selector: PREFILL_SELECTOR.into(),
            decode_selector: DECODE_SELECTOR.into(),
            engine_port: 8000,
        },
        tx,
        shutdown.clone(),
    ));
    // The ready pod that was deleted is gone, the one that became ready and the added one are
    // in; the not-ready decode pod and the pod without an IP never count.
    wait_for(
        &mut rx,
        &Engines {
            prefill: vec!["http://10.0.0.2:8000".into(), "http://10.0.0.3:8000".into()],
            decode: vec!["http://10.0.1.1:8000".into()],
            ..Engines::default()
        },
    )
    .await;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("discovery stops on shutdown")
        .expect("no panic");
    // The client is gone with the task: the double's loop ends.
    tokio::time::timeout(Duration::from_secs(30), server)
        .await
        .expect("double finished")
        .expect("double did not panic");
}

/// A completion request to the conductor.
async fn post(addr: SocketAddr, body: &str) -> (u16, String) {
    http(addr, "POST", "/v1/completions", body).await
}

const MODEL: &str = "synthetic-70b";
const BLOCK: u32 = 16;

/// What discovery reports next: `prefill` and `decode` engines.
fn report_engines(tx: &watch::Sender<Engines>, prefill: Vec<String>, decode: Vec<String>) {
    tx.send(Engines {
        prefill,
        decode,
        ..Engines::default()
    })
    .expect("send");
}

async fn engine(shutdown: &CancellationToken) -> (String, Registry) {
    let (a, registry) =
        serve_support::start_engine(serve_support::engine_config(MODEL, BLOCK), shutdown).await;
    (format!("http://{a}"), registry)
}

fn gauge(registry: &Registry, name: &str, role: &str) -> f64 {
    registry
        .gather()
        .iter()
        .filter(|f| f.name() == name)
        .flat_map(|f| f.get_metric().iter())
        .filter(|m| m.get_label().iter().any(|l| l.value() == role))
        .map(|m| m.get_gauge().get_value())
        .sum()
}

async fn until_ready(readiness: &Readiness, want: bool) {
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        while readiness.is_ready() != want {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "readiness never became {want}");
}

#[tokio::test]
async fn engines_added_at_run_time_receive_traffic_and_removed_ones_none() {
    let shutdown = CancellationToken::new();
    let mut config = conductor_config("", BLOCK, vec![], String::new(), Rejection::None, 30.0);
    // No fixed names: the conductor serves what the engines list on /v1/models.
    config.models = vec![];
    config.decode = vec![];
    config.scheduler.hot.fanout = 0;
    let registry = Registry::new();
    let conductor = kvpool_conductor::server::conductor(config, &registry).expect("conductor");
    let (l, addr) = listen().await;
    tokio::spawn(kvpool_conductor::server::serve(
        l,
        conductor.router,
        shutdown.clone(),
    ));
    let readiness = Readiness::new();
    let (tx, rx) = watch::channel(Engines::default());
    tokio::spawn(
        conductor
            .engines
            .clone()
            .follow(rx, readiness.clone(), shutdown.clone()),
    );
    let ask = |q: &str| format!(r#"{{"model":"{MODEL}","prompt":"{q}","max_tokens":3}}"#);

    // No engines yet: 503 no_engines, not ready.
    let (status, body) = post(addr, &ask("hello")).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("no_engines"), "{body}");
    assert!(!readiness.is_ready());

    // A prefill and a decode engine appear: ready, and they serve the request.
    let (p0, p0_metrics) = engine(&shutdown).await;
    let (d0, d0_metrics) = engine(&shutdown).await;
    report_engines(&tx, vec![p0.clone()], vec![d0.clone()]);
    until_ready(&readiness, true).await;
    // The model name was never configured: the first request learns it from the engines.
    let (status, body) = post(addr, &ask("first")).await;
    assert_eq!(status, 200, "{body}");
    assert_metric(&p0_metrics, "kvpool_engine_generated_tokens_total", 1.0);
    let (status, models) = http(addr, "GET", "/v1/models", "").await;
    assert_eq!(status, 200, "{models}");
    let models: serde_json::Value = serde_json::from_str(&models).expect("json");
    assert_eq!(models["data"][0]["id"], MODEL, "{models}");
    assert_eq!(models["data"].as_array().map(Vec::len), Some(1), "{models}");
    // A model no engine serves: OpenAI's 404, naming it.
    let (status, body) = post(
        addr,
        r#"{"model":"gpt-nothing","prompt":"x","max_tokens":1}"#,
    )
    .await;
    assert_eq!(status, 404, "{body}");
    serve_support::assert_openai_error(&body, "model_not_found", "gpt-nothing");
    assert_metric(&d0_metrics, "kvpool_engine_generated_tokens_total", 3.0);
    assert_eq!(gauge(&registry, "kvpool_conductor_engines", "prefill"), 1.0);

    // A second prefill engine joins and the first leaves: traffic goes to the new one only.
    let (p1, p1_metrics) = engine(&shutdown).await;
    report_engines(&tx, vec![p1.clone()], vec![d0.clone()]);
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        while conductor.engines.current().prefill != vec![p1.clone()] {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "engine set applied");
    for q in ["second", "third"] {
        let (status, body) = post(addr, &ask(q)).await;
        assert_eq!(status, 200, "{body}");
    }
    assert_metric(&p0_metrics, "kvpool_engine_generated_tokens_total", 1.0);
    assert_metric(&p1_metrics, "kvpool_engine_generated_tokens_total", 2.0);
    assert_metric(&d0_metrics, "kvpool_engine_generated_tokens_total", 9.0);

    // The last decode engine goes: not ready, 503 again.
    report_engines(&tx, vec![p1], vec![]);
    until_ready(&readiness, false).await;
    let (status, body) = post(addr, &ask("fourth")).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(gauge(&registry, "kvpool_conductor_engines", "decode"), 0.0);
    shutdown.cancel();
}

//! The agent's use of its Node object against an API double: kube's real `Client` over
//! `tower_test::mock::pair`, the double checking method, path, query, content type and body of
//! every request and answering as the API server would. The topology published is the one
//! discovery finds on the dgx-roce sysfs fixture; the failure domain comes from the node's
//! label, or is empty (with the metric set) when the label is missing or unreadable.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use serde_json::{Value, json};
use tower_test::mock::{Handle, SendResponse};

use kvpool_agent::config::{self, AgentConfig};
use kvpool_agent::discovery::{Roots, discover};
use kvpool_agent::node::{NodeClient, NodeMetrics, prepare, topology_patch};
use kvpool_agent::topology::{NodeSummary, summarize};

const NODE: &str = "gpu-7";

fn dgx_summary() -> NodeSummary {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dgx-roce");
    let roots = Roots {
        sysfs: root.join("sys"),
        procfs: root.join("proc"),
    };
    summarize(&discover(&roots, &BTreeMap::new()).expect("discover"))
}

fn agent_config(kubernetes: &str, pool_domain: Option<&str>) -> AgentConfig {
    let mut yaml = format!("node_name: {NODE}\n{kubernetes}\n");
    yaml.push_str("pool: {master: [m:1], auth_key_file: /k, advertise_host: 10.0.0.1");
    if let Some(d) = pool_domain {
        yaml.push_str(&format!(", failure_domain: {d}"));
    }
    yaml.push_str("}\n");
    config::validate(&config::parse(&yaml, Path::new("agent.yaml")).expect("parses"))
        .expect("valid")
}

/// The API server's side: the next request, checked (method, path, query pairs), with its
/// content type and JSON body.
async fn expect(
    handle: &mut Handle<Request<Body>, Response<Body>>,
    method: Method,
    query: &[&str],
) -> (Value, Option<String>, SendResponse<Response<Body>>) {
    let (request, send) = handle
        .next_request()
        .await
        .unwrap_or_else(|| panic!("expected {method}; the client hung up"));
    let (parts, body) = request.into_parts();
    assert_eq!(parts.method, method);
    assert_eq!(parts.uri.path(), format!("/api/v1/nodes/{NODE}"));
    let pairs: Vec<&str> = parts
        .uri
        .query()
        .unwrap_or_default()
        .split('&')
        .filter(|kv| !kv.is_empty())
        .collect();
    assert_eq!(pairs, query, "query of {method}");
    let content_type = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let bytes = body.collect_bytes().await.expect("body");
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).expect("JSON body")
    };
    (body, content_type, send)
}

fn reply(send: SendResponse<Response<Body>>, code: StatusCode, body: &Value) {
    send.send_response(
        Response::builder()
            .status(code)
            .header("content-type", "application/json")
            .body(Body::from(serde_json::to_vec(body).expect("json")))
            .expect("response"),
    );
}

/// A Node as the API server returns it: the agent decodes only the metadata and must skip the
/// rest.
fn node(labels: &Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": NODE, "labels": labels, "resourceVersion": "7"},
           "spec": {"podCIDR": "10.244.3.0/24", "providerID": "kind://docker/kind/gpu-0",
                    "taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]},
           "status": {
               "addresses": [{"type": "InternalIP", "address": "172.18.0.3"}],
               "allocatable": {"cpu": "96", "memory": "1056Gi", "nvidia.com/gpu": "8"},
               "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                               "lastHeartbeatTime": "2026-12-05T03:00:00Z"}],
               "images": [{"names": ["vllm/vllm-openai:v0.11.0"], "sizeBytes": 9_000_000_000u64}],
               "nodeInfo": {"architecture": "amd64", "kubeletVersion": "v1.33.1",
                            "containerRuntimeVersion": "containerd://2.1.1"}}})
}

fn forbidden(verb: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": format!("nodes \"{NODE}\" is forbidden: cannot {verb} resource \"nodes\""),
           "reason": "Forbidden", "code": 403})
}

fn double() -> (NodeClient, Handle<Request<Body>, Response<Body>>) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    (NodeClient::new(client, NODE), handle)
}

/// The query of every patch: the agent's field manager.
const PATCH_QUERY: &[&str] = &["fieldManager=kvpool-agent"];

#[tokio::test]
async fn the_dgx_topology_is_merge_patched_onto_the_node() {
    let summary = dgx_summary();
    let labels = &summary.labels;
    assert_eq!(labels["kvpool.dev/numa-nodes"], "2");
    assert_eq!(labels["kvpool.dev/gpus"], "8");
    assert_eq!(labels["kvpool.dev/rdma-nics"], "8");
    assert_eq!(labels["kvpool.dev/rdma-link-layer"], "ethernet");
    assert_eq!(labels["kvpool.dev/sriov-vfs"], "4");
    let (client, mut handle) = double();
    let server = async {
        let (body, content_type, send) = expect(&mut handle, Method::PATCH, PATCH_QUERY).await;
        assert_eq!(
            content_type.as_deref(),
            Some("application/merge-patch+json")
        );
        assert_eq!(body, topology_patch(&summary));
        assert_eq!(body["metadata"]["labels"]["kvpool.dev/gpus"], "8");
        assert!(body.get("spec").is_none(), "only metadata is written");
        reply(send, StatusCode::OK, &node(&body["metadata"]["labels"]));
    };
    let (published, ()) = tokio::join!(client.publish_topology(&summary), server);
    published.expect("published");
}

#[tokio::test]
async fn the_failure_domain_is_the_nodes_value_of_the_spread_label() {
    let cfg = agent_config(
        "kubernetes: {failure_domain_label: topology.kubernetes.io/zone, publish_topology: true}",
        None,
    );
    let summary = dgx_summary();
    let metrics = NodeMetrics::new(&prometheus::Registry::new()).expect("metrics");
    let (client, mut handle) = double();
    let server = async {
        let (_, _, send) = expect(&mut handle, Method::PATCH, PATCH_QUERY).await;
        reply(send, StatusCode::OK, &node(&json!({})));
        let (body, _, send) = expect(&mut handle, Method::GET, &[]).await;
        assert_eq!(body, Value::Null);
        reply(
            send,
            StatusCode::OK,
            &node(
                &json!({"topology.kubernetes.io/zone": "zone-b", "kubernetes.io/hostname": NODE}),
            ),
        );
    };
    let (domain, ()) = tokio::join!(prepare(&cfg, &summary, Some(&client), &metrics), server);
    assert_eq!(domain, "zone-b");
    assert_eq!(metrics.failure_domain_missing.get(), 0);
    assert_eq!(metrics.api_errors.with_label_values(&["get"]).get(), 0);
}

#[tokio::test]
async fn a_missing_label_or_forbidden_node_gives_no_domain_and_says_so() {
    let summary = dgx_summary();
    // The label is not on the node; nothing is published.
    let cfg = agent_config("kubernetes: {failure_domain_label: example.com/rack}", None);
    let metrics = NodeMetrics::new(&prometheus::Registry::new()).expect("metrics");
    let (client, mut handle) = double();
    let server = async {
        let (_, _, send) = expect(&mut handle, Method::GET, &[]).await;
        reply(
            send,
            StatusCode::OK,
            &node(&json!({"kubernetes.io/hostname": NODE})),
        );
    };
    let (domain, ()) = tokio::join!(prepare(&cfg, &summary, Some(&client), &metrics), server);
    assert_eq!(domain, "");
    assert_eq!(metrics.failure_domain_missing.get(), 1);

    // No RBAC grant: the patch and the read are refused; both are counted.
    let cfg = agent_config(
        "kubernetes: {failure_domain_label: example.com/rack, publish_topology: true}",
        None,
    );
    let metrics = NodeMetrics::new(&prometheus::Registry::new()).expect("metrics");
    let (client, mut handle) = double();
    let server = async {
        let (_, _, send) = expect(&mut handle, Method::PATCH, PATCH_QUERY).await;
        reply(send, StatusCode::FORBIDDEN, &forbidden("patch"));
        let (_, _, send) = expect(&mut handle, Method::GET, &[]).await;
        reply(send, StatusCode::FORBIDDEN, &forbidden("get"));
    };
    let (domain, ()) = tokio::join!(prepare(&cfg, &summary, Some(&client), &metrics), server);
    assert_eq!(domain, "");
    assert_eq!(metrics.failure_domain_missing.get(), 1);
    assert_eq!(metrics.api_errors.with_label_values(&["patch"]).get(), 1);
    assert_eq!(metrics.api_errors.with_label_values(&["get"]).get(), 1);
}

#[tokio::test]
async fn a_configured_domain_needs_no_api_call() {
    let cfg = agent_config(
        "kubernetes: {failure_domain_label: example.com/rack}",
        Some("rack-3"),
    );
    let metrics = NodeMetrics::new(&prometheus::Registry::new()).expect("metrics");
    let (client, mut handle) = double();
    let domain = prepare(&cfg, &dgx_summary(), Some(&client), &metrics).await;
    assert_eq!(domain, "rack-3");
    assert_eq!(metrics.failure_domain_missing.get(), 0);
    drop(client);
    assert!(
        handle.next_request().await.is_none(),
        "no request reached the API server"
    );
}

#[tokio::test]
async fn the_hostname_label_is_the_node_name_without_api_access() {
    // The pool document's default spread label, on an agent without a ServiceAccount token.
    let cfg = agent_config(
        "kubernetes: {failure_domain_label: kubernetes.io/hostname, publish_topology: true}",
        None,
    );
    let metrics = NodeMetrics::new(&prometheus::Registry::new()).expect("metrics");
    assert_eq!(prepare(&cfg, &dgx_summary(), None, &metrics).await, NODE);
    assert_eq!(metrics.failure_domain_missing.get(), 0);
    // Any other label cannot be read without the API: no domain, and the metric says so.
    let cfg = agent_config("kubernetes: {failure_domain_label: example.com/rack}", None);
    assert_eq!(prepare(&cfg, &dgx_summary(), None, &metrics).await, "");
    assert_eq!(metrics.failure_domain_missing.get(), 1);
}

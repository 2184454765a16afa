//! Kubernetes engine discovery for the conductor: watches the Pods of its namespace that carry
//! the prefill and the decode label selectors (the labels the operator puts on PrefillPool and
//! DecodePool pods) and publishes the engine set on a `watch` channel, which
//! [`super::server::EngineSet::follow`] applies. A pod counts once it is Ready, has a pod IP and
//! is not being deleted; its base URL is `http://<podIP>:<engine port>`.
//! I/O boundary: the Kubernetes API (list and watch of Pods) in [`run`]; [`engine_url`] and
//! [`engine_urls`] are pure. The watch is the crate's `kube` feature: built without it,
//! [`supported`] refuses `--discover-namespace` and [`Client`] has no values.

#[cfg(feature = "kube")]
use kvpool_runtime::telemetry::chain;
#[cfg(feature = "kube")]
use std::sync::Arc;

#[cfg(feature = "kube")]
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, PodCondition};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
#[cfg(feature = "kube")]
use kube::Api;
#[cfg(feature = "kube")]
use kube::runtime::reflector::{self, Store};
#[cfg(feature = "kube")]
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;
#[cfg(feature = "kube")]
use tokio_util::sync::CancellationToken;

use super::{Engines, RoutingProtocol};
use kvpool_crd::labels::{
    BOOTSTRAP_PORT_ANNOTATION, ENGINE_PROTOCOL_ANNOTATION, SGLANG_DEFAULT_BOOTSTRAP_PORT,
};

/// An engine pod as discovery reads it: the Pod's metadata and the two status fields that
/// decide whether it serves (its conditions and its IP). The rest of a Pod (its spec, the
/// container statuses...) is skipped while decoding, so the watch caches only this much per
/// pod and the conductor carries no decoder for the whole PodSpec.
#[derive(kube::Resource, Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[resource(inherit = "Pod")]
pub struct EnginePod {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub status: Option<EnginePodStatus>,
}

/// The part of a Pod's status discovery reads.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
pub struct EnginePodStatus {
    #[serde(default)]
    pub conditions: Option<Vec<PodCondition>>,
    #[serde(default, rename = "podIP")]
    pub pod_ip: Option<String>,
}

/// What to watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoveryConfig {
    /// Namespace of the engine pods (the conductor's own).
    pub namespace: String,
    /// Label selector of the prefill engine pods.
    pub prefill_selector: String,
    /// Label selector of the decode engine pods.
    pub decode_selector: String,
    /// Port the engines serve their OpenAI-compatible API on.
    pub engine_port: u16,
}

/// Errors of engine discovery.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum DiscoveryError {
    #[cfg(feature = "kube")]
    #[error("cannot build a Kubernetes client (in-cluster or kubeconfig)")]
    Client(#[source] kube::Error),
    #[cfg(not(feature = "kube"))]
    #[error("engine discovery {NO_KUBE}")]
    Unsupported,
}

kvpool_runtime::error_category!(DiscoveryError);

/// Why `--discover-namespace` is refused by a conductor built without the `kube` feature (the
/// lean `kvpool` binary, docs/adr/0011-lean-embedded-build.md).
pub const NO_KUBE: &str = "needs the Kubernetes API, but this kvpool was built without Kubernetes support; rebuild \
     with --features k8s";

/// `Ok` when this build can discover engines; else why not ([`NO_KUBE`]).
pub fn supported() -> Result<(), &'static str> {
    if cfg!(feature = "kube") {
        Ok(())
    } else {
        Err(NO_KUBE)
    }
}

/// The Kubernetes client [`run`] watches with.
#[cfg(feature = "kube")]
pub use kube::Client;

/// Built without the `kube` feature there is no client: [`client`] never returns one.
#[cfg(not(feature = "kube"))]
#[derive(Debug)]
pub enum Client {}

/// The base URL of `pod` as an engine, or `None` while it does not count: not Ready, no pod IP
/// yet, or being deleted.
pub fn engine_url(pod: &EnginePod, port: u16) -> Option<String> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .as_ref()?
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let ip = status.pod_ip.as_deref().filter(|ip| !ip.is_empty())?;
    if !ready {
        return None;
    }
    Some(if ip.contains(':') {
        format!("http://[{ip}]:{port}")
    } else {
        format!("http://{ip}:{port}")
    })
}

/// The engine URLs of `pods`, sorted and without duplicates.
pub fn engine_urls<'a>(pods: impl IntoIterator<Item = &'a EnginePod>, port: u16) -> Vec<String> {
    let mut urls: Vec<String> = pods
        .into_iter()
        .filter_map(|p| engine_url(p, port))
        .collect();
    urls.sort();
    urls.dedup();
    urls
}

/// The routing convention `pod` declares in its `kvpool.dev/engine-protocol` annotation (with
/// `kvpool.dev/bootstrap-port` for SGLang, SGLang's default port when absent); `Ok(None)` when
/// it declares none. An unknown protocol or a port that is not a number from 1 to 65535 is an
/// error naming the annotation.
pub fn engine_protocol(pod: &EnginePod) -> Result<Option<RoutingProtocol>, String> {
    let Some(notes) = pod.metadata.annotations.as_ref() else {
        return Ok(None);
    };
    let Some(protocol) = notes.get(ENGINE_PROTOCOL_ANNOTATION) else {
        return Ok(None);
    };
    match protocol.as_str() {
        "vllm" => Ok(Some(RoutingProtocol::Vllm)),
        "vllm-mooncake" => Ok(Some(RoutingProtocol::VllmMooncake {
            bootstrap_port: bootstrap_port(notes)?,
        })),
        "sglang" => Ok(Some(RoutingProtocol::Sglang {
            bootstrap_port: bootstrap_port(notes)?,
        })),
        other => Err(format!(
            "{ENGINE_PROTOCOL_ANNOTATION} {other:?} is not one of \"vllm\", \"vllm-mooncake\", \
             \"sglang\""
        )),
    }
}

/// The `kvpool.dev/bootstrap-port` of a pod's annotations (SGLang's and vLLM's default, 8998,
/// when absent); a value that is not a port from 1 to 65535 is an error naming the annotation.
fn bootstrap_port(notes: &std::collections::BTreeMap<String, String>) -> Result<u16, String> {
    match notes.get(BOOTSTRAP_PORT_ANNOTATION) {
        None => Ok(SGLANG_DEFAULT_BOOTSTRAP_PORT),
        Some(v) => v.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| {
            format!("{BOOTSTRAP_PORT_ANNOTATION} {v:?} is not a port from 1 to 65535")
        }),
    }
}

/// The engines among `prefill` and `decode` pods that count, with the protocols they declare.
/// A pod whose annotations are invalid is logged and routed by the conductor's default.
pub fn engines_of<'a>(
    prefill: impl IntoIterator<Item = &'a EnginePod> + Clone,
    decode: impl IntoIterator<Item = &'a EnginePod> + Clone,
    port: u16,
) -> Engines {
    let mut protocols = std::collections::BTreeMap::new();
    for pod in prefill.clone().into_iter().chain(decode.clone()) {
        let Some(url) = engine_url(pod, port) else {
            continue;
        };
        match engine_protocol(pod) {
            Ok(Some(p)) => {
                protocols.insert(url, p);
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(pod = ?pod.metadata.name, error = %e,
                "engine pod annotation ignored; routing it by the conductor's --engine-protocol"),
        }
    }
    Engines {
        prefill: engine_urls(prefill, port),
        decode: engine_urls(decode, port),
        protocols,
    }
}

#[cfg(feature = "kube")]
fn current(prefill: &Store<EnginePod>, decode: &Store<EnginePod>, port: u16) -> Engines {
    let prefill: Vec<Arc<EnginePod>> = prefill.state();
    let decode: Vec<Arc<EnginePod>> = decode.state();
    engines_of(
        prefill.iter().map(Arc::as_ref),
        decode.iter().map(Arc::as_ref),
        port,
    )
}

/// Watch the engine pods with `client` and publish every change of the engine set on `tx`
/// until `shutdown` fires. Watch errors are logged and retried with kube's default backoff.
#[cfg(feature = "kube")]
pub async fn run(
    client: Client,
    config: DiscoveryConfig,
    tx: watch::Sender<Engines>,
    shutdown: CancellationToken,
) {
    let api: Api<EnginePod> = Api::namespaced(client, &config.namespace);
    let (prefill_store, prefill_writer) = reflector::store::<EnginePod>();
    let (decode_store, decode_writer) = reflector::store::<EnginePod>();
    let follow = |writer, selector: &str| {
        reflector::reflector(
            writer,
            watcher(api.clone(), watcher::Config::default().labels(selector)),
        )
        .default_backoff()
        .map(|event| {
            if let Err(e) = event {
                tracing::warn!(error = %chain(&e), "engine pod watch failed; retrying");
            }
        })
        .boxed()
    };
    let mut events = futures::stream::select(
        follow(prefill_writer, &config.prefill_selector),
        follow(decode_writer, &config.decode_selector),
    );
    tracing::info!(
        namespace = %config.namespace,
        prefill = %config.prefill_selector,
        decode = %config.decode_selector,
        "discovering engine pods"
    );
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            event = events.next() => {
                if event.is_none() {
                    break;
                }
                let engines = current(&prefill_store, &decode_store, config.engine_port);
                tx.send_if_modified(|old| {
                    if *old == engines {
                        false
                    } else {
                        tracing::debug!(?engines, "discovered engine set");
                        *old = engines;
                        true
                    }
                });
            }
        }
    }
}

/// Built without the `kube` feature: there is no client to watch with.
#[cfg(not(feature = "kube"))]
pub async fn run(
    client: Client,
    _: DiscoveryConfig,
    _: watch::Sender<Engines>,
    _: tokio_util::sync::CancellationToken,
) {
    match client {}
}

/// A Kubernetes client from the pod's service account (or a kubeconfig outside a cluster).
#[cfg(feature = "kube")]
pub async fn client() -> Result<Client, DiscoveryError> {
    kube::Client::try_default()
        .await
        .map_err(DiscoveryError::Client)
}

/// Built without the `kube` feature: always [`DiscoveryError::Unsupported`].
#[cfg(not(feature = "kube"))]
pub async fn client() -> Result<Client, DiscoveryError> {
    Err(DiscoveryError::Unsupported)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    pub(super) fn pod(name: &str, ip: Option<&str>, ready: bool) -> EnginePod {
        let mut status = json!({
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
        });
        if let Some(ip) = ip {
            status["podIP"] = json!(ip);
        }
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "llm", "resourceVersion": "1"},
            "status": status,
        }))
        .expect("pod")
    }

    fn annotated(name: &str, ip: &str, notes: &[(&str, &str)]) -> EnginePod {
        let mut p = pod(name, Some(ip), true);
        p.metadata.annotations = Some(
            notes
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        );
        p
    }

    #[test]
    fn engine_protocol_comes_from_the_annotations() {
        let none = pod("plain", Some("10.0.0.1"), true);
        assert_eq!(engine_protocol(&none), Ok(None));
        let vllm = annotated("v", "10.0.0.2", &[(ENGINE_PROTOCOL_ANNOTATION, "vllm")]);
        assert_eq!(engine_protocol(&vllm), Ok(Some(RoutingProtocol::Vllm)));
        let sg = annotated("s", "10.0.0.3", &[(ENGINE_PROTOCOL_ANNOTATION, "sglang")]);
        assert_eq!(
            engine_protocol(&sg),
            Ok(Some(RoutingProtocol::Sglang {
                bootstrap_port: 8998
            }))
        );
        let vm = annotated(
            "vm",
            "10.0.0.5",
            &[
                (ENGINE_PROTOCOL_ANNOTATION, "vllm-mooncake"),
                (BOOTSTRAP_PORT_ANNOTATION, "8100"),
            ],
        );
        assert_eq!(
            engine_protocol(&vm),
            Ok(Some(RoutingProtocol::VllmMooncake {
                bootstrap_port: 8100
            }))
        );
        let sg_port = annotated(
            "s2",
            "10.0.0.4",
            &[
                (ENGINE_PROTOCOL_ANNOTATION, "sglang"),
                (BOOTSTRAP_PORT_ANNOTATION, "9000"),
            ],
        );
        assert_eq!(
            engine_protocol(&sg_port),
            Ok(Some(RoutingProtocol::Sglang {
                bootstrap_port: 9000
            }))
        );
        for bad_port in ["0", "70000", "x"] {
            let p = annotated(
                "b",
                "10.0.0.5",
                &[
                    (ENGINE_PROTOCOL_ANNOTATION, "sglang"),
                    (BOOTSTRAP_PORT_ANNOTATION, bad_port),
                ],
            );
            let e = engine_protocol(&p).expect_err(bad_port);
            assert!(e.contains(BOOTSTRAP_PORT_ANNOTATION), "{e}");
        }
        let unknown = annotated("u", "10.0.0.6", &[(ENGINE_PROTOCOL_ANNOTATION, "trtllm")]);
        let e = engine_protocol(&unknown).expect_err("unknown protocol");
        assert!(e.contains("trtllm"), "{e}");
    }

    #[test]
    fn engines_carry_the_declared_protocols_of_counted_pods() {
        let prefill = [
            annotated("p0", "10.0.0.1", &[(ENGINE_PROTOCOL_ANNOTATION, "sglang")]),
            // Declares a protocol but is not ready: not an engine, not in the map.
            {
                let mut p = annotated("p1", "10.0.0.2", &[(ENGINE_PROTOCOL_ANNOTATION, "sglang")]);
                p.status = pod("x", Some("10.0.0.2"), false).status;
                p
            },
            // Invalid annotation: an engine, routed by the default.
            annotated("p2", "10.0.0.3", &[(ENGINE_PROTOCOL_ANNOTATION, "nope")]),
        ];
        let decode = [annotated(
            "d0",
            "10.0.1.1",
            &[(ENGINE_PROTOCOL_ANNOTATION, "sglang")],
        )];
        let e = engines_of(&prefill, &decode, 8000);
        assert_eq!(e.prefill, ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]);
        assert_eq!(e.decode, ["http://10.0.1.1:8000"]);
        let sg = RoutingProtocol::Sglang {
            bootstrap_port: 8998,
        };
        assert_eq!(
            e.protocols.into_iter().collect::<Vec<_>>(),
            vec![
                ("http://10.0.0.1:8000".to_owned(), sg),
                ("http://10.0.1.1:8000".to_owned(), sg),
            ]
        );
    }

    #[test]
    fn only_ready_pods_with_an_ip_count() {
        assert_eq!(
            engine_url(&pod("a", Some("10.0.0.1"), true), 8000).as_deref(),
            Some("http://10.0.0.1:8000")
        );
        assert_eq!(
            engine_url(&pod("v6", Some("fd00::7"), true), 8000).as_deref(),
            Some("http://[fd00::7]:8000")
        );
        assert_eq!(engine_url(&pod("b", Some("10.0.0.2"), false), 8000), None);
        assert_eq!(engine_url(&pod("c", None, true), 8000), None);
        assert_eq!(engine_url(&pod("d", Some(""), true), 8000), None);
        let mut deleting = pod("e", Some("10.0.0.5"), true);
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        assert_eq!(engine_url(&deleting, 8000), None);
        let no_status = EnginePod::default();
        assert_eq!(engine_url(&no_status, 8000), None);
    }

    #[test]
    fn urls_are_sorted_and_unique() {
        let pods = [
            pod("b", Some("10.0.0.2"), true),
            pod("a", Some("10.0.0.1"), true),
            pod("a2", Some("10.0.0.1"), true),
            pod("x", Some("10.0.0.9"), false),
        ];
        assert_eq!(
            engine_urls(&pods, 9),
            vec![
                "http://10.0.0.1:9".to_owned(),
                "http://10.0.0.2:9".to_owned()
            ]
        );
    }
}

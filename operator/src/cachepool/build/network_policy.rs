//! The pool's NetworkPolicies, one per server it runs: the master admits gRPC and the block
//! events from the pool's own pods (agents, conductor, engines) and gRPC from the operator's
//! usage query; the agents admit the transfer port from the pool's own pods; the conductor admits
//! its HTTP port from `spec.networkPolicy.conductorFrom` (default: its namespace) and from the
//! operator (its autoscaling reads `/v1/kvpool/load` there). Admin ports
//! (`/metrics`) admit `spec.networkPolicy.metricsFrom` only; the kubelet's probes come from the
//! node, which a NetworkPolicy cannot block. Ingress only; egress stays open. Absent when
//! `spec.networkPolicy.enabled` is false. I/O boundary: none.

use std::collections::BTreeMap;

use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{meta, selector};
use crate::cachepool::validate::ValidCachePool;
use crate::contract;
use crate::labels::{self, Component};

/// Labels of the operator's pods that the master admits for the usage query (`Stats`), in any
/// namespace. The chart puts them on the operator's pod template.
pub const OPERATOR_POD_LABELS: [(&str, &str); 2] = [
    (labels::APP_COMPONENT, "operator"),
    (labels::APP_PART_OF, labels::APP_NAME_VALUE),
];

pub(crate) fn tcp(port: u16) -> NetworkPolicyPort {
    NetworkPolicyPort {
        port: Some(IntOrString::Int(i32::from(port))),
        protocol: Some("TCP".to_owned()),
        ..NetworkPolicyPort::default()
    }
}

pub(crate) fn rule(from: Vec<NetworkPolicyPeer>, ports: &[u16]) -> NetworkPolicyIngressRule {
    NetworkPolicyIngressRule {
        from: Some(from),
        ports: Some(ports.iter().copied().map(tcp).collect()),
    }
}

fn pod_peer(labels: BTreeMap<String, String>) -> NetworkPolicyPeer {
    NetworkPolicyPeer {
        pod_selector: Some(LabelSelector {
            match_labels: Some(labels),
            ..LabelSelector::default()
        }),
        ..NetworkPolicyPeer::default()
    }
}

/// Every pod of the pool in its namespace: agents, master, conductor and the engines of the
/// Prefill and DecodePools that name it (they all carry the pool label).
pub fn pool_pods(pool: &ValidCachePool) -> NetworkPolicyPeer {
    pod_peer(BTreeMap::from([
        (
            labels::APP_NAME.to_owned(),
            labels::APP_NAME_VALUE.to_owned(),
        ),
        (labels::POOL.to_owned(), pool.name.clone()),
    ]))
}

/// The operator's pods: in its own namespace when the operator knows it (the chart tells it),
/// else in any namespace.
pub fn operator_pods(namespace: Option<&str>) -> NetworkPolicyPeer {
    let namespace_selector = match namespace {
        Some(ns) => LabelSelector {
            match_labels: Some(BTreeMap::from([(
                "kubernetes.io/metadata.name".to_owned(),
                ns.to_owned(),
            )])),
            ..LabelSelector::default()
        },
        None => LabelSelector::default(),
    };
    NetworkPolicyPeer {
        namespace_selector: Some(namespace_selector),
        ..pod_peer(
            OPERATOR_POD_LABELS
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        )
    }
}

/// The spec's peers as NetworkPolicy peers.
pub(crate) fn peers<'a, P: 'a>(named: &'a [P]) -> Vec<NetworkPolicyPeer>
where
    NetworkPolicyPeer: From<&'a P>,
{
    named.iter().map(NetworkPolicyPeer::from).collect()
}

/// Every pod of the pool's namespace (the conductor's callers when none are named).
pub(crate) fn namespace_pods() -> NetworkPolicyPeer {
    NetworkPolicyPeer {
        pod_selector: Some(LabelSelector::default()),
        ..NetworkPolicyPeer::default()
    }
}

/// The policy of the pool's pods of `component`, with the metrics rule appended when scrapers
/// are named.
fn policy(
    pool: &ValidCachePool,
    component: Component,
    mut rules: Vec<NetworkPolicyIngressRule>,
) -> NetworkPolicy {
    let scrapers = peers(&pool.spec.network_policy.metrics_from);
    if !scrapers.is_empty() {
        rules.push(rule(scrapers, &[contract::ADMIN_PORT]));
    }
    NetworkPolicy {
        metadata: meta(pool, component),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(selector(pool, component)),
            policy_types: Some(vec!["Ingress".to_owned()]),
            ingress: Some(rules),
            ..NetworkPolicySpec::default()
        }),
    }
}

/// The pool's NetworkPolicies (master, agents and, when enabled, conductor); none when
/// `spec.networkPolicy.enabled` is false.
pub fn network_policies(pool: &ValidCachePool) -> Vec<NetworkPolicy> {
    let spec = &pool.spec.network_policy;
    if !spec.enabled {
        return Vec::new();
    }
    let mut out = vec![
        policy(
            pool,
            Component::Master,
            vec![
                rule(
                    vec![pool_pods(pool)],
                    &[
                        contract::MASTER_PORT,
                        contract::KV_EVENTS_PORT,
                        contract::KV_EVENTS_PORT + 1,
                    ],
                ),
                rule(
                    vec![operator_pods(pool.operator_namespace.as_deref())],
                    &[contract::MASTER_PORT],
                ),
            ],
        ),
        policy(
            pool,
            Component::Agent,
            vec![rule(
                vec![pool_pods(pool)],
                &[pool.effective.transport.port],
            )],
        ),
    ];
    if pool.effective.conductor.is_some() {
        let callers = if spec.conductor_from.is_empty() {
            vec![namespace_pods()]
        } else {
            peers(&spec.conductor_from)
        };
        out.push(policy(
            pool,
            Component::Conductor,
            vec![
                rule(callers, &[contract::CONDUCTOR_PORT]),
                rule(
                    vec![operator_pods(pool.operator_namespace.as_deref())],
                    &[contract::CONDUCTOR_PORT],
                ),
            ],
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::networking::v1::NetworkPolicyPeer;
    use kvpool_crd::KVCachePool;

    use super::*;

    #[test]
    fn the_operator_is_admitted_from_its_own_namespace_when_it_knows_it() {
        let mine = operator_pods(Some("kvpool-system"));
        let ns = mine.namespace_selector.expect("namespace selector");
        assert_eq!(
            ns.match_labels.expect("labels")["kubernetes.io/metadata.name"],
            "kvpool-system"
        );
        // Unknown: any namespace (an empty selector), as before the chart passed it.
        assert_eq!(
            operator_pods(None).namespace_selector,
            Some(LabelSelector::default())
        );
    }
    use crate::test_fixtures::{roce, tcp, valid};

    /// `(peers, ports)` of each ingress rule of the policy named `name`.
    fn rules(policies: &[NetworkPolicy], name: &str) -> Vec<(Vec<NetworkPolicyPeer>, Vec<i32>)> {
        let policy = policies
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no policy {name}"));
        let spec = policy.spec.as_ref().expect("spec");
        assert_eq!(
            spec.policy_types.as_deref(),
            Some(&["Ingress".to_owned()][..])
        );
        spec.ingress
            .iter()
            .flatten()
            .map(|r| {
                let ports = r
                    .ports
                    .iter()
                    .flatten()
                    .map(|p| {
                        assert_eq!(p.protocol.as_deref(), Some("TCP"));
                        match p.port {
                            Some(IntOrString::Int(n)) => n,
                            ref other => panic!("port {other:?}"),
                        }
                    })
                    .collect();
                (r.from.clone().unwrap_or_default(), ports)
            })
            .collect()
    }

    fn labels_of(peer: &NetworkPolicyPeer) -> BTreeMap<String, String> {
        peer.pod_selector
            .as_ref()
            .and_then(|s| s.match_labels.clone())
            .unwrap_or_default()
    }

    fn with_network_policy(mut pool: KVCachePool, yaml: &str) -> KVCachePool {
        pool.spec.network_policy = serde_saphyr::from_str(yaml).expect("networkPolicy parses");
        pool
    }

    #[test]
    fn master_admits_grpc_and_block_events_from_the_pool_and_grpc_from_the_operator() {
        let pool = valid(&roce());
        let policies = network_policies(&pool);
        let names: Vec<_> = policies
            .iter()
            .filter_map(|p| p.metadata.name.as_deref())
            .collect();
        assert_eq!(names, ["roce-master", "roce-agent", "roce-conductor"]);
        for p in &policies {
            // Owned by the pool and found by its labels, like every other child.
            assert_eq!(p.metadata.namespace.as_deref(), Some("llm"));
            let owner = &p.metadata.owner_references.as_ref().expect("owner")[0];
            assert_eq!(
                (owner.kind.as_str(), owner.controller),
                ("KVCachePool", Some(true))
            );
            let labels = p.metadata.labels.as_ref().expect("labels");
            assert_eq!(labels[labels::OWNER_NAME], "roce");
            assert_eq!(labels[labels::APP_MANAGED_BY], labels::MANAGED_BY_VALUE);
        }

        let master = &policies[0];
        assert_eq!(
            master.spec.as_ref().and_then(|s| s.pod_selector.clone()),
            Some(selector(&pool, Component::Master)),
            "selects the master pods only"
        );
        let master_rules = rules(&policies, "roce-master");
        assert_eq!(master_rules.len(), 2, "no metrics rule without scrapers");
        let (from, ports) = &master_rules[0];
        assert_eq!(ports, &[50051, 5557, 5558]);
        assert_eq!(from.len(), 1);
        assert_eq!(
            labels_of(&from[0]),
            BTreeMap::from([
                ("app.kubernetes.io/name".to_owned(), "kvpool".to_owned()),
                ("kvpool.dev/pool".to_owned(), "roce".to_owned()),
            ])
        );
        assert!(
            from[0].namespace_selector.is_none(),
            "the pool's namespace only"
        );
        let (from, ports) = &master_rules[1];
        assert_eq!(ports, &[50051], "the operator reads Stats over gRPC only");
        assert_eq!(
            from[0].namespace_selector,
            Some(LabelSelector::default()),
            "the operator may run in any namespace"
        );
        assert_eq!(
            labels_of(&from[0]),
            BTreeMap::from([
                (
                    "app.kubernetes.io/component".to_owned(),
                    "operator".to_owned()
                ),
                ("app.kubernetes.io/part-of".to_owned(), "kvpool".to_owned()),
            ])
        );
    }

    #[test]
    fn agents_admit_the_transfer_port_from_the_pool_and_the_conductor_its_namespace() {
        let pool = valid(&roce());
        let policies = network_policies(&pool);
        let agent = rules(&policies, "roce-agent");
        assert_eq!(agent.len(), 1);
        assert_eq!(agent[0].1, [15500]);
        assert_eq!(agent[0].0, [pool_pods(&pool)]);
        assert_eq!(
            policies[1]
                .spec
                .as_ref()
                .and_then(|s| s.pod_selector.clone()),
            Some(selector(&pool, Component::Agent))
        );

        let conductor = rules(&policies, "roce-conductor");
        assert_eq!(conductor.len(), 2);
        assert_eq!(conductor[0].1, [8000]);
        // The operator reads the load the engine pools autoscale by.
        assert_eq!(conductor[1], (vec![operator_pods(None)], vec![8000]));
        // Every pod of the namespace: an empty pod selector and no namespace selector.
        assert_eq!(
            conductor[0].0,
            [NetworkPolicyPeer {
                pod_selector: Some(LabelSelector::default()),
                ..NetworkPolicyPeer::default()
            }]
        );

        // A pool on another transfer port opens that port.
        let mut other = roce();
        other.spec.transport.port = 16000;
        let policies = network_policies(&valid(&other));
        assert_eq!(rules(&policies, "roce-agent")[0].1, [16000]);
    }

    #[test]
    fn named_peers_replace_the_defaults_and_scrapers_reach_every_admin_port() {
        let pool = with_network_policy(
            roce(),
            "conductorFrom:\n  - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: gateway}}\n\
             metricsFrom:\n  - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: monitoring}}\n    \
             podSelector: {matchLabels: {app.kubernetes.io/name: prometheus}}\n",
        );
        let pool = valid(&pool);
        let policies = network_policies(&pool);
        let gateway = &peers(&pool.spec.network_policy.conductor_from);
        let prometheus = &peers(&pool.spec.network_policy.metrics_from);
        assert_eq!(gateway.len(), 1);
        assert_eq!(prometheus.len(), 1);
        let ns_label = |peer: &NetworkPolicyPeer| {
            peer.namespace_selector
                .as_ref()
                .and_then(|s| s.match_labels.as_ref())
                .and_then(|l| l.get("kubernetes.io/metadata.name").cloned())
        };
        assert_eq!(ns_label(&gateway[0]).as_deref(), Some("gateway"));
        assert_eq!(ns_label(&prometheus[0]).as_deref(), Some("monitoring"));
        assert_eq!(
            labels_of(&prometheus[0])
                .get("app.kubernetes.io/name")
                .map(String::as_str),
            Some("prometheus")
        );
        let conductor = rules(&policies, "roce-conductor");
        assert_eq!(conductor[0], (gateway.clone(), vec![8000]));
        for name in ["roce-master", "roce-agent", "roce-conductor"] {
            let all = rules(&policies, name);
            assert_eq!(
                all.last(),
                Some(&(prometheus.clone(), vec![9090])),
                "{name}: admin port for the scrapers, last"
            );
            // Only the metrics rule opens the admin port.
            assert_eq!(
                all.iter()
                    .filter(|(_, ports)| ports.contains(&9090))
                    .count(),
                1,
                "{name}"
            );
        }
    }

    #[test]
    fn no_conductor_policy_without_a_conductor_and_none_at_all_when_turned_off() {
        let policies = network_policies(&valid(&tcp()));
        let names: Vec<_> = policies
            .iter()
            .filter_map(|p| p.metadata.name.as_deref())
            .collect();
        assert_eq!(names, ["tcp-master", "tcp-agent"]);
        let off = with_network_policy(roce(), "enabled: false");
        assert!(network_policies(&valid(&off)).is_empty());
        // Defaults: on, with no extra peers.
        assert!(roce().spec.network_policy.enabled);
    }
}

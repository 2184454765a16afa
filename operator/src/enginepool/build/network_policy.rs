//! The NetworkPolicy of an engine pool's pods (with the pool's `spec.networkPolicy.enabled`):
//! every port from the pool's own pods (its agents, master, conductor and the engines of every
//! Prefill- and DecodePool on it, which hand KV over to each other); the API port from
//! `networkPolicy.engineFrom`, or, when that is empty and the pool runs no conductor, from every
//! pod in the namespace (with a conductor, outside callers go through it and its admission
//! control); the API port (where engines serve `/metrics`) from `networkPolicy.metricsFrom`.
//! Ingress only. I/O boundary: none.

use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::meta;
use crate::cachepool::build::{namespace_pods, peers, pool_pods, rule};
use crate::contract;
use crate::enginepool::validate::ValidEnginePool;
use crate::labels;

/// The engine pods' policy, or `None` when the pool's policies are turned off.
pub fn network_policy(p: &ValidEnginePool) -> Option<NetworkPolicy> {
    let spec = &p.pool.spec.network_policy;
    if !spec.enabled {
        return None;
    }
    let mut rules = vec![NetworkPolicyIngressRule {
        from: Some(vec![pool_pods(&p.pool)]),
        // Every port: the engines' own KV hand-over and event ports differ by engine.
        ports: None,
    }];
    let callers = if !spec.engine_from.is_empty() {
        peers(&spec.engine_from)
    } else if p.pool.effective.conductor.is_none() {
        vec![namespace_pods()]
    } else {
        Vec::new()
    };
    if !callers.is_empty() {
        rules.push(rule(callers, &[contract::ENGINE_PORT]));
    }
    let scrapers = peers(&spec.metrics_from);
    if !scrapers.is_empty() {
        rules.push(rule(scrapers, &[contract::ENGINE_PORT]));
    }
    Some(NetworkPolicy {
        metadata: meta(p),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(labels::selector_labels(&p.pool.name, &p.name, p.component)),
                ..LabelSelector::default()
            }),
            policy_types: Some(vec!["Ingress".to_owned()]),
            ingress: Some(rules),
            ..NetworkPolicySpec::default()
        }),
    })
}

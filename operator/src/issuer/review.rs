//! The issuer's decision, pure: who a TokenReview says the caller is, and whether that pod is
//! one of the pool's agent DaemonSet's pods, scheduled on a node. The pod is checked against
//! what the API server reports (its uid matches the one bound into the token; it is
//! controlled by the DaemonSet with the agent's name *and* that object's uid; the DaemonSet is
//! controlled by the pool) rather than against names alone, so a pod that only calls itself an
//! agent gets nothing. Trust boundary: whoever can create pods in the pool's namespace can
//! mount the pool's Secrets anyway; the issuer keeps an agent from acting for another node
//! and keeps every other workload out. I/O boundary: none.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::authentication::v1::TokenReviewStatus;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kvpool_proto::issuer::{AUDIENCE, IssueRequest};

use crate::labels::{Component, child_name};

/// The `extra` keys of a pod-bound ServiceAccount token's review.
pub const EXTRA_POD_NAME: &str = "authentication.kubernetes.io/pod-name";
pub const EXTRA_POD_UID: &str = "authentication.kubernetes.io/pod-uid";

/// Why a caller gets no credential: an HTTP status, a snake_case reason (also the metric's
/// `outcome` label) and a message for the agent's log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub reason: &'static str,
    pub message: String,
}

fn refuse(status: u16, reason: &'static str, message: impl Into<String>) -> Refusal {
    Refusal {
        status,
        reason,
        message: message.into(),
    }
}

/// The caller as the TokenReview names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub namespace: String,
    pub service_account: String,
    pub pod_name: String,
    pub pod_uid: String,
}

/// What the issuer grants: the node's credential in the pool with `pool_uid`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    pub node: String,
    pub pool_uid: String,
}

fn one_extra<'a>(extra: &'a BTreeMap<String, Vec<String>>, key: &str) -> Option<&'a str> {
    match extra.get(key).map(Vec::as_slice) {
        Some([one]) if !one.is_empty() => Some(one),
        _ => None,
    }
}

/// The caller of a TokenReview's status: authenticated, for [`AUDIENCE`], a ServiceAccount,
/// and bound to a pod.
pub fn caller(status: &TokenReviewStatus) -> Result<Caller, Refusal> {
    if status.authenticated != Some(true) {
        let why = status.error.as_deref().unwrap_or("no reason given");
        return Err(refuse(
            401,
            "token_rejected",
            format!("the API server did not authenticate the token: {why}"),
        ));
    }
    if !status.audiences.iter().flatten().any(|a| a == AUDIENCE) {
        return Err(refuse(
            401,
            "wrong_audience",
            format!("the token is not for the audience {AUDIENCE}"),
        ));
    }
    let user = status.user.clone().unwrap_or_default();
    let username = user.username.unwrap_or_default();
    let Some((namespace, service_account)) = username
        .strip_prefix("system:serviceaccount:")
        .and_then(|rest| rest.split_once(':'))
    else {
        return Err(refuse(
            403,
            "not_a_service_account",
            format!("{username:?} is not a ServiceAccount"),
        ));
    };
    let extra = user.extra.unwrap_or_default();
    let (Some(pod_name), Some(pod_uid)) = (
        one_extra(&extra, EXTRA_POD_NAME),
        one_extra(&extra, EXTRA_POD_UID),
    ) else {
        return Err(refuse(
            403,
            "not_pod_bound",
            "the token is not bound to a pod (mount a projected ServiceAccount token)",
        ));
    };
    Ok(Caller {
        namespace: namespace.to_owned(),
        service_account: service_account.to_owned(),
        pod_name: pod_name.to_owned(),
        pod_uid: pod_uid.to_owned(),
    })
}

fn controller(refs: Option<&Vec<OwnerReference>>) -> Option<&OwnerReference> {
    refs.into_iter()
        .flatten()
        .find(|r| r.controller == Some(true))
}

/// The caller must run in the pool's namespace (checked before anything is read for it).
pub fn same_namespace(req: &IssueRequest, caller: &Caller) -> Result<(), Refusal> {
    if caller.namespace != req.namespace {
        return Err(refuse(
            403,
            "wrong_namespace",
            format!(
                "the caller runs in namespace {}, the pool in {}",
                caller.namespace, req.namespace
            ),
        ));
    }
    Ok(())
}

/// Whether `caller`, whose pod and its controlling DaemonSet the API server returned (`None`:
/// not found), may have the credential of its node in the pool `req` names.
pub fn grant(
    req: &IssueRequest,
    caller: &Caller,
    pod: Option<&Pod>,
    daemonset: Option<&DaemonSet>,
) -> Result<Grant, Refusal> {
    same_namespace(req, caller)?;
    let pod = pod.ok_or_else(|| {
        refuse(
            403,
            "pod_gone",
            format!(
                "pod {}/{} does not exist",
                caller.namespace, caller.pod_name
            ),
        )
    })?;
    if pod.metadata.uid.as_deref() != Some(caller.pod_uid.as_str()) {
        return Err(refuse(
            403,
            "pod_gone",
            format!(
                "pod {}/{} is not the pod the token was issued to (uid differs)",
                caller.namespace, caller.pod_name
            ),
        ));
    }
    let agent_ds = child_name(&req.pool, Component::Agent);
    let owner = controller(pod.metadata.owner_references.as_ref());
    let ds = daemonset.filter(|ds| {
        owner.is_some_and(|o| {
            o.kind == "DaemonSet" && o.name == agent_ds && Some(&o.uid) == ds.metadata.uid.as_ref()
        })
    });
    let Some(ds) = ds else {
        return Err(refuse(
            403,
            "not_an_agent",
            format!(
                "pod {}/{} is not a pod of the pool's agent DaemonSet {agent_ds}",
                caller.namespace, caller.pod_name
            ),
        ));
    };
    let pool_owner = controller(ds.metadata.owner_references.as_ref())
        .filter(|o| o.kind == "KVCachePool" && o.name == req.pool)
        .ok_or_else(|| {
            refuse(
                403,
                "not_an_agent",
                format!(
                    "DaemonSet {agent_ds} is not controlled by KVCachePool {}",
                    req.pool
                ),
            )
        })?;
    let pod_spec = pod.spec.as_ref();
    let ds_sa = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| s.service_account_name.as_deref())
        .unwrap_or("default");
    if caller.service_account != ds_sa {
        return Err(refuse(
            403,
            "not_an_agent",
            format!(
                "the token is ServiceAccount {}'s, the agents run as {ds_sa}",
                caller.service_account
            ),
        ));
    }
    let node = pod_spec
        .and_then(|s| s.node_name.as_deref())
        .filter(|n| !n.is_empty())
        .ok_or_else(|| {
            refuse(
                409,
                "not_scheduled",
                format!("pod {} is not scheduled on a node yet", caller.pod_name),
            )
        })?;
    Ok(Grant {
        node: node.to_owned(),
        pool_uid: pool_owner.uid.clone(),
    })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::apps::v1::DaemonSetSpec;
    use k8s_openapi::api::authentication::v1::UserInfo;
    use k8s_openapi::api::core::v1::{PodSpec, PodTemplateSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn status(username: &str, pod: &str, uid: &str) -> TokenReviewStatus {
        TokenReviewStatus {
            authenticated: Some(true),
            audiences: Some(vec![AUDIENCE.to_owned()]),
            user: Some(UserInfo {
                username: Some(username.to_owned()),
                extra: Some(BTreeMap::from([
                    (EXTRA_POD_NAME.to_owned(), vec![pod.to_owned()]),
                    (EXTRA_POD_UID.to_owned(), vec![uid.to_owned()]),
                ])),
                ..UserInfo::default()
            }),
            ..TokenReviewStatus::default()
        }
    }

    fn owner(kind: &str, name: &str, uid: &str) -> Vec<OwnerReference> {
        vec![OwnerReference {
            kind: kind.to_owned(),
            name: name.to_owned(),
            uid: uid.to_owned(),
            controller: Some(true),
            ..OwnerReference::default()
        }]
    }

    fn pod(uid: &str, ds_uid: &str, node: Option<&str>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("kv-agent-x1".into()),
                uid: Some(uid.into()),
                owner_references: Some(owner("DaemonSet", "kv-agent", ds_uid)),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: node.map(str::to_owned),
                ..PodSpec::default()
            }),
            ..Pod::default()
        }
    }

    fn daemonset(uid: &str, sa: Option<&str>) -> DaemonSet {
        DaemonSet {
            metadata: ObjectMeta {
                name: Some("kv-agent".into()),
                uid: Some(uid.into()),
                owner_references: Some(owner("KVCachePool", "kv", "pool-uid")),
                ..ObjectMeta::default()
            },
            spec: Some(DaemonSetSpec {
                template: PodTemplateSpec {
                    spec: Some(PodSpec {
                        service_account_name: sa.map(str::to_owned),
                        ..PodSpec::default()
                    }),
                    ..PodTemplateSpec::default()
                },
                ..DaemonSetSpec::default()
            }),
            ..DaemonSet::default()
        }
    }

    fn request() -> IssueRequest {
        IssueRequest {
            namespace: "ml".into(),
            pool: "kv".into(),
        }
    }

    fn agent_caller() -> Caller {
        caller(&status(
            "system:serviceaccount:ml:kv-agent",
            "kv-agent-x1",
            "pod-uid",
        ))
        .expect("caller")
    }

    #[test]
    fn an_agent_pod_gets_its_own_node() {
        let c = agent_caller();
        assert_eq!(c.service_account, "kv-agent");
        let granted = grant(
            &request(),
            &c,
            Some(&pod("pod-uid", "ds-uid", Some("gpu-7"))),
            Some(&daemonset("ds-uid", Some("kv-agent"))),
        );
        assert_eq!(
            granted,
            Ok(Grant {
                node: "gpu-7".into(),
                pool_uid: "pool-uid".into()
            })
        );
    }

    #[test]
    fn tokens_that_prove_no_agent_pod_are_refused_with_their_reason() {
        let mut unauth = status("system:serviceaccount:ml:kv-agent", "p", "u");
        unauth.authenticated = Some(false);
        let mut wrong_aud = status("system:serviceaccount:ml:kv-agent", "p", "u");
        wrong_aud.audiences = Some(vec!["https://kubernetes.default.svc".into()]);
        let mut unbound = status("system:serviceaccount:ml:kv-agent", "p", "u");
        unbound.user.as_mut().expect("user").extra = None;
        for (s, reason) in [
            (unauth, "token_rejected"),
            (wrong_aud, "wrong_audience"),
            (status("alice", "p", "u"), "not_a_service_account"),
            (unbound, "not_pod_bound"),
        ] {
            assert_eq!(caller(&s).expect_err("refused").reason, reason);
        }
    }

    #[test]
    fn pods_that_are_not_this_pools_agents_are_refused() {
        let c = agent_caller();
        let ds = daemonset("ds-uid", Some("kv-agent"));
        let good = pod("pod-uid", "ds-uid", Some("gpu-7"));
        let other_ns = Caller {
            namespace: "other".into(),
            ..c.clone()
        };
        let other_sa = Caller {
            service_account: "default".into(),
            ..c.clone()
        };
        let mut foreign_pool = daemonset("ds-uid", Some("kv-agent"));
        foreign_pool.metadata.owner_references = Some(owner("KVCachePool", "other", "u2"));
        let cases: Vec<(Caller, Option<Pod>, Option<DaemonSet>, &str)> = vec![
            (
                other_ns,
                Some(good.clone()),
                Some(ds.clone()),
                "wrong_namespace",
            ),
            (c.clone(), None, Some(ds.clone()), "pod_gone"),
            // A pod of the same name made again (the token was bound to the old one).
            (
                c.clone(),
                Some(pod("new-uid", "ds-uid", Some("gpu-7"))),
                Some(ds.clone()),
                "pod_gone",
            ),
            // An owner reference copied by hand names the DaemonSet but not its uid.
            (
                c.clone(),
                Some(pod("pod-uid", "forged", Some("gpu-7"))),
                Some(ds.clone()),
                "not_an_agent",
            ),
            (c.clone(), Some(good.clone()), None, "not_an_agent"),
            (
                c.clone(),
                Some(good.clone()),
                Some(foreign_pool),
                "not_an_agent",
            ),
            (
                other_sa,
                Some(good.clone()),
                Some(ds.clone()),
                "not_an_agent",
            ),
            (
                c.clone(),
                Some(pod("pod-uid", "ds-uid", None)),
                Some(ds.clone()),
                "not_scheduled",
            ),
        ];
        for (caller, pod, ds, reason) in cases {
            let refused = grant(&request(), &caller, pod.as_ref(), ds.as_ref()).expect_err(reason);
            assert_eq!(refused.reason, reason, "{}", refused.message);
        }
    }

    #[test]
    fn the_default_service_account_counts_when_the_pool_names_none() {
        let c = caller(&status(
            "system:serviceaccount:ml:default",
            "kv-agent-x1",
            "pod-uid",
        ))
        .expect("caller");
        let granted = grant(
            &request(),
            &c,
            Some(&pod("pod-uid", "ds-uid", Some("n1"))),
            Some(&daemonset("ds-uid", None)),
        );
        assert_eq!(granted.map(|g| g.node), Ok("n1".to_owned()));
    }
}

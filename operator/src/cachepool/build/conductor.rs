//! The conductor Deployment (`kvpool conductor`: the OpenAI-compatible front door and
//! KVCache-centric scheduler, which discovers the pool's engine pods through the API server as
//! its own ServiceAccount) and its Service. I/O boundary: none.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;

use super::workload::{self, KvpoolContainer};
use crate::cachepool::validate::ValidCachePool;
use crate::contract;
use crate::labels::{self, Component};

/// Named ports of the conductor container and Service.
const CONDUCTOR_PORTS: [(&str, u16); 2] = [
    ("http", contract::CONDUCTOR_PORT),
    ("admin", contract::ADMIN_PORT),
];

/// The conductor Deployment and Service.
pub fn conductor(pool: &ValidCachePool, config_hash: &str) -> (Deployment, Service) {
    let c = &pool.spec.conductor;
    let slo = pool.effective.conductor.as_ref();
    let container = workload::kvpool_container(KvpoolContainer {
        name: "conductor",
        image: &pool.conductor_image,
        args: contract::conductor_args(
            &pool.name,
            &pool.namespace,
            &pool.master_addr(),
            slo.map_or(
                u64::from(kvpool_crd::defaults::TTFT_MILLIS.unsigned_abs()),
                |s| u64::from(s.ttft_millis),
            ),
            slo.map_or(
                u64::from(kvpool_crd::defaults::TPOT_MILLIS.unsigned_abs()),
                |s| u64::from(s.tpot_millis),
            ),
        ),
        env: None,
        ports: &CONDUCTOR_PORTS,
        resources: c.resources.clone(),
    });
    let mut deployment = workload::deployment(
        pool,
        Component::Conductor,
        c.replicas,
        container,
        config_hash,
    );
    // The conductor talks to the API server (engine discovery) as its own ServiceAccount; the
    // token is mounted into this pod only, not into every pod of the account.
    if let Some(spec) = deployment
        .spec
        .as_mut()
        .and_then(|s| s.template.spec.as_mut())
    {
        spec.service_account_name = Some(labels::child_name(&pool.name, Component::Conductor));
        spec.automount_service_account_token = Some(true);
    }
    (
        deployment,
        workload::service(pool, Component::Conductor, &CONDUCTOR_PORTS),
    )
}

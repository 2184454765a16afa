//! The master Deployment (`kvpool master`, HA through etcd when endpoints are given) and the
//! Service that the agents, the conductor, the engines and the operator's usage reader reach it
//! by. I/O boundary: none.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;

use super::workload::{self, KvpoolContainer};
use crate::cachepool::validate::ValidCachePool;
use crate::contract;
use crate::labels::Component;
use crate::pod;

/// Named ports of the master container and Service: gRPC, admin, and the pool's block events
/// (ZMQ PUB and its replay socket).
const MASTER_PORTS: [(&str, u16); 4] = [
    ("grpc", contract::MASTER_PORT),
    ("admin", contract::ADMIN_PORT),
    ("kv-events", contract::KV_EVENTS_PORT),
    ("kv-replay", contract::KV_EVENTS_PORT + 1),
];

/// The master Deployment.
pub fn master_deployment(pool: &ValidCachePool, config_hash: &str) -> Deployment {
    let master = &pool.spec.master;
    let container = workload::kvpool_container(KvpoolContainer {
        name: "master",
        image: &pool.master_image,
        args: contract::master_args(
            &master.etcd_endpoints,
            &pool.effective.eviction,
            pool.agent_issuer.is_none(),
        ),
        env: Some(vec![pod::field_env(contract::env::POD_IP, "status.podIP")]),
        ports: &MASTER_PORTS,
        resources: master.resources.clone(),
    });
    workload::deployment(
        pool,
        Component::Master,
        master.replicas,
        container,
        config_hash,
    )
}

/// The master Service.
pub fn master_service(pool: &ValidCachePool) -> Service {
    workload::service(pool, Component::Master, &MASTER_PORTS)
}

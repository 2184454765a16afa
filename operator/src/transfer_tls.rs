//! TLS of a pool's transfer lanes in its pods (`spec.transport.tls`): every agent mounts the
//! certificate Secret (certificate, key, CA) where its pool document says the files are
//! (`kvpool_crd::TRANSFER_TLS_DIR`); engines mount the CA alone and get the
//! `KVPOOL_TRANSFER_*` variables their transfer engines read
//! (`kvpool_client::pool::transfer_tls_from_env`). Applied to the built pod specs, like
//! `master_tls`. Pure: no I/O.

use k8s_openapi::api::core::v1::PodSpec;
use kvpool_client::pool::{TRANSFER_CA_FILE_ENV, TRANSFER_SERVER_NAME_ENV, TRANSFER_TLS_ENV};
use kvpool_crd::{TRANSFER_TLS_DIR, TransferTlsSpec};

use crate::master_tls::{add_volume_and_mount, secret_volume, set_env};

const VOLUME: &str = "transfer-tls";

/// An agent's pod: the Secret's `tls.crt`, `tls.key` and `ca.crt` mounted on container
/// `container` (the agent reads them through the pool document).
pub fn agent_pod(pod: &mut PodSpec, container: usize, tls: &TransferTlsSpec) {
    add_volume_and_mount(
        pod,
        container,
        secret_volume(VOLUME, &tls.secret_name, &["tls.crt", "tls.key", "ca.crt"]),
        TRANSFER_TLS_DIR,
    );
}

/// An engine's pod: only the Secret's `ca.crt` mounted (never the agents' key), and the mode,
/// the CA file and the name to verify set on container `container` for pool `pool` in
/// `namespace`.
pub fn engine_pod(
    pod: &mut PodSpec,
    container: usize,
    tls: &TransferTlsSpec,
    pool: &str,
    namespace: &str,
) {
    add_volume_and_mount(
        pod,
        container,
        secret_volume(VOLUME, &tls.secret_name, &["ca.crt"]),
        TRANSFER_TLS_DIR,
    );
    if let Some(c) = pod.containers.get_mut(container) {
        set_env(c, TRANSFER_TLS_ENV, tls.mode.as_str().to_owned());
        set_env(
            c,
            TRANSFER_CA_FILE_ENV,
            format!("{TRANSFER_TLS_DIR}/ca.crt"),
        );
        set_env(
            c,
            TRANSFER_SERVER_NAME_ENV,
            tls.server_name_for(pool, namespace),
        );
    }
}

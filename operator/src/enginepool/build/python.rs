//! How an engine pod gets the `kvpool` Python package (docs/adr/0004-python-package-in-engine-pods.md):
//! an init container of the pool's `kvpool` image (the master's, so the client speaks the
//! master's protocol version) copies the package into an `emptyDir`, which the engine container
//! mounts read-only at [`contract::PYTHON_PACKAGE_DIR`] and puts first on `PYTHONPATH`.
//! I/O boundary: none.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, EmptyDirVolumeSource, EnvVar, ResourceRequirements, SecurityContext, Volume,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::contract;
use crate::enginepool::validate::ValidEnginePool;
use crate::pod::{self, KEY_READER_GROUP, mount};

/// Name of the volume holding the copy, and of the init container that fills it.
pub const VOLUME: &str = "kvpool-python";
/// Upper bound of the volume (the package is a few tens of MiB).
const VOLUME_SIZE_LIMIT: &str = "512Mi";

/// The `emptyDir` the init container fills.
pub fn python_volume() -> Volume {
    Volume {
        name: VOLUME.to_owned(),
        empty_dir: Some(EmptyDirVolumeSource {
            size_limit: Some(Quantity(VOLUME_SIZE_LIMIT.to_owned())),
            ..EmptyDirVolumeSource::default()
        }),
        ..Volume::default()
    }
}

/// The engine container's read-only mount of the copy.
pub fn python_mount() -> VolumeMount {
    mount(VOLUME, contract::PYTHON_PACKAGE_DIR, true)
}

/// The init container: `kvpool operator install-python` from the `kvpool` image, as its non-root
/// user on a read-only root filesystem, writing only into the shared volume.
pub fn python_init_container(p: &ValidEnginePool) -> Container {
    let quantity = |q: &str| Quantity(q.to_owned());
    Container {
        name: VOLUME.to_owned(),
        image: Some(p.pool.master_image.clone()),
        command: Some(contract::kvpool_command()),
        args: Some(contract::install_python_args()),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_owned(), quantity("10m")),
                ("memory".to_owned(), quantity("32Mi")),
            ])),
            limits: Some(BTreeMap::from([("memory".to_owned(), quantity("256Mi"))])),
            ..ResourceRequirements::default()
        }),
        security_context: Some(SecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(KEY_READER_GROUP),
            run_as_group: Some(KEY_READER_GROUP),
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            capabilities: pod::capabilities_only(&[]),
            seccomp_profile: pod::runtime_default_seccomp(),
            ..SecurityContext::default()
        }),
        volume_mounts: Some(vec![mount(VOLUME, contract::PYTHON_STAGING_DIR, false)]),
        ..Container::default()
    }
}

/// `PYTHONPATH` with the package first; `user` is the value the pool's `spec.engine.env` sets
/// for it, if any, and comes after (an empty value adds nothing).
pub fn python_path(user: Option<&str>) -> String {
    match user {
        Some(rest) if !rest.is_empty() => format!("{}:{rest}", contract::PYTHON_PACKAGE_DIR),
        _ => contract::PYTHON_PACKAGE_DIR.to_owned(),
    }
}

/// Merges the user's `PYTHONPATH` entry into the operator's: a plain value goes after the
/// package; one taken from a ConfigMap, Secret or field (`valueFrom`) cannot be joined here and
/// replaces the operator's, as every other user variable does (the user then owns the path).
pub fn merge_python_path(ours: &mut EnvVar, user: &EnvVar) {
    match (&user.value, &user.value_from) {
        (value, None) => ours.value = Some(python_path(value.as_deref())),
        (_, Some(_)) => *ours = user.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pod::plain_env;

    #[test]
    fn python_path_puts_the_package_first() {
        assert_eq!(python_path(None), "/opt/kvpool/python");
        assert_eq!(python_path(Some("")), "/opt/kvpool/python");
        assert_eq!(
            python_path(Some("/app:/lib/py")),
            "/opt/kvpool/python:/app:/lib/py"
        );
        let mut ours = plain_env("PYTHONPATH", python_path(None));
        merge_python_path(&mut ours, &plain_env("PYTHONPATH", "/app"));
        assert_eq!(ours.value.as_deref(), Some("/opt/kvpool/python:/app"));
        let from_field = EnvVar {
            name: "PYTHONPATH".to_owned(),
            value_from: Some(Default::default()),
            ..EnvVar::default()
        };
        merge_python_path(&mut ours, &from_field);
        assert_eq!(ours, from_field);
    }
}

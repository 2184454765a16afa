//! TLS of a pool's master in its pods (`spec.master.tls`): the master mounts its certificate
//! Secret and gets the `--tls-*` flags; the agents, the conductor and the engines mount the
//! CA (`ca.crt` of that Secret) and, for mutual TLS, the client certificate Secret, and get the
//! `KVPOOL_MASTER_*` variables every master client reads (`kvpool_client::master::MasterTls`).
//! Applied to the built pod specs, so the builders stay as they are without TLS. Pure: no I/O.

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Container, KeyToPath, PodSpec, SecretVolumeSource, Volume};
use kvpool_client::master::{
    CA_FILE_ENV, CLIENT_CERT_FILE_ENV, CLIENT_KEY_FILE_ENV, SERVER_NAME_ENV,
};
use kvpool_crd::MasterTlsSpec;

use crate::pod::{self, mount};

/// The pod spec of a Deployment's template, if it has one.
pub fn deployment_pod(d: &mut Deployment) -> Option<&mut PodSpec> {
    d.spec.as_mut().and_then(|s| s.template.spec.as_mut())
}

/// The pod spec of a DaemonSet's template, if it has one.
pub fn daemonset_pod(d: &mut DaemonSet) -> Option<&mut PodSpec> {
    d.spec.as_mut().and_then(|s| s.template.spec.as_mut())
}

/// Where the master's certificate, key and CA are mounted (in the master) or its CA alone (in
/// the clients).
pub const SERVER_DIR: &str = "/etc/kvpool/master-tls";
/// Where the clients' certificate and key are mounted (mutual TLS), and in the master the CA
/// that signed them.
pub const CLIENT_DIR: &str = "/etc/kvpool/master-client-tls";
/// Volume names.
const SERVER_VOLUME: &str = "master-tls";
const CLIENT_VOLUME: &str = "master-client-tls";
/// Items of a `kubernetes.io/tls` Secret (and cert-manager's `ca.crt`).
const CERT: &str = "tls.crt";
const KEY: &str = "tls.key";
const CA: &str = "ca.crt";
/// Mode of the mounted files: owner and the pod's `fsGroup` (the key reader group) may read.
const MODE: i32 = 0o440;

/// A read-only Secret volume with `items` (each under its own name).
pub(crate) fn secret_volume(name: &str, secret: &str, items: &[&str]) -> Volume {
    Volume {
        name: name.to_owned(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret.to_owned()),
            default_mode: Some(MODE),
            items: Some(
                items
                    .iter()
                    .map(|k| KeyToPath {
                        key: (*k).to_owned(),
                        path: (*k).to_owned(),
                        mode: None,
                    })
                    .collect(),
            ),
            optional: None,
        }),
        ..Volume::default()
    }
}

fn file(dir: &str, item: &str) -> String {
    format!("{dir}/{item}")
}

pub(crate) fn add_volume_and_mount(pod: &mut PodSpec, container: usize, volume: Volume, dir: &str) {
    let name = volume.name.clone();
    pod.volumes.get_or_insert_default().push(volume);
    if let Some(c) = pod.containers.get_mut(container) {
        c.volume_mounts
            .get_or_insert_default()
            .push(mount(&name, dir, true));
    }
}

/// The master's pod: its certificate, key and CA mounted, `--tls-cert-file` and
/// `--tls-key-file` added to the first container's arguments, and with mutual TLS the clients'
/// CA and `--tls-client-ca-file`.
pub fn master_pod(pod: &mut PodSpec, tls: &MasterTlsSpec) {
    add_volume_and_mount(
        pod,
        0,
        secret_volume(SERVER_VOLUME, &tls.secret_name, &[CERT, KEY, CA]),
        SERVER_DIR,
    );
    let mut args = vec![
        "--tls-cert-file".to_owned(),
        file(SERVER_DIR, CERT),
        "--tls-key-file".to_owned(),
        file(SERVER_DIR, KEY),
    ];
    if let Some(client) = &tls.client_secret_name {
        add_volume_and_mount(
            pod,
            0,
            secret_volume(CLIENT_VOLUME, client, &[CA]),
            CLIENT_DIR,
        );
        args.extend(["--tls-client-ca-file".to_owned(), file(CLIENT_DIR, CA)]);
    }
    if let Some(c) = pod.containers.first_mut() {
        c.args.get_or_insert_default().extend(args);
    }
}

/// The variables a master client reads, for a pool whose master is at `service_host`.
pub fn client_env(tls: &MasterTlsSpec) -> Vec<(&'static str, String)> {
    let mut env = vec![(CA_FILE_ENV, file(SERVER_DIR, CA))];
    if tls.client_secret_name.is_some() {
        env.push((CLIENT_CERT_FILE_ENV, file(CLIENT_DIR, CERT)));
        env.push((CLIENT_KEY_FILE_ENV, file(CLIENT_DIR, KEY)));
    }
    if let Some(name) = &tls.server_name {
        env.push((SERVER_NAME_ENV, name.clone()));
    }
    env
}

pub(crate) fn set_env(c: &mut Container, name: &str, value: String) {
    let env = c.env.get_or_insert_default();
    env.retain(|e| e.name != name);
    env.push(pod::plain_env(name, value));
}

/// A client's pod (agent, conductor, engine): the master's CA mounted (only `ca.crt` of the
/// master's Secret, never its key), the client certificate Secret with mutual TLS, and the
/// `KVPOOL_MASTER_*` variables set on container `container` (the one that talks to the master).
pub fn client_pod(pod: &mut PodSpec, container: usize, tls: &MasterTlsSpec) {
    add_volume_and_mount(
        pod,
        container,
        secret_volume(SERVER_VOLUME, &tls.secret_name, &[CA]),
        SERVER_DIR,
    );
    if let Some(client) = &tls.client_secret_name {
        add_volume_and_mount(
            pod,
            container,
            secret_volume(CLIENT_VOLUME, client, &[CERT, KEY]),
            CLIENT_DIR,
        );
    }
    if let Some(c) = pod.containers.get_mut(container) {
        for (name, value) in client_env(tls) {
            set_env(c, name, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_fixtures::has_arg;

    fn pod_with(name: &str) -> PodSpec {
        PodSpec {
            containers: vec![Container {
                name: name.to_owned(),
                args: Some(vec!["master".to_owned()]),
                ..Container::default()
            }],
            ..PodSpec::default()
        }
    }

    fn tls(client: bool, server_name: bool) -> MasterTlsSpec {
        MasterTlsSpec {
            secret_name: "roce-master-tls".into(),
            client_secret_name: client.then(|| "roce-client-tls".into()),
            server_name: server_name.then(|| "master.kvpool.example".into()),
        }
    }

    fn items(pod: &PodSpec, volume: &str) -> (String, Vec<String>, Option<i32>) {
        let v = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == volume)
            .and_then(|v| v.secret.clone())
            .expect("secret volume");
        (
            v.secret_name.unwrap_or_default(),
            v.items
                .unwrap_or_default()
                .into_iter()
                .map(|i| i.key)
                .collect(),
            v.default_mode,
        )
    }

    #[test]
    fn the_master_gets_its_certificate_and_with_mutual_tls_the_clients_ca() {
        let mut pod = pod_with("master");
        master_pod(&mut pod, &tls(false, false));
        assert_eq!(
            items(&pod, "master-tls"),
            (
                "roce-master-tls".into(),
                vec!["tls.crt".into(), "tls.key".into(), "ca.crt".into()],
                Some(0o440)
            )
        );
        let args = pod.containers[0].args.clone().expect("args");
        assert_eq!(
            args,
            [
                "master",
                "--tls-cert-file",
                "/etc/kvpool/master-tls/tls.crt",
                "--tls-key-file",
                "/etc/kvpool/master-tls/tls.key"
            ]
        );
        let mounts = pod.containers[0].volume_mounts.clone().expect("mounts");
        assert!(mounts.iter().all(|m| m.read_only == Some(true)));

        let mut pod = pod_with("master");
        master_pod(&mut pod, &tls(true, false));
        assert_eq!(
            items(&pod, "master-client-tls"),
            ("roce-client-tls".into(), vec!["ca.crt".into()], Some(0o440))
        );
        let args = pod.containers[0].args.clone().expect("args");
        assert!(
            has_arg(
                &args,
                "--tls-client-ca-file",
                "/etc/kvpool/master-client-tls/ca.crt"
            ),
            "{args:?}"
        );
    }

    #[test]
    fn a_client_gets_the_ca_alone_and_the_variables_its_master_client_reads() {
        let mut pod = pod_with("agent");
        client_pod(&mut pod, 0, &tls(false, false));
        // Never the master's key: the CA item only.
        assert_eq!(
            items(&pod, "master-tls"),
            ("roce-master-tls".into(), vec!["ca.crt".into()], Some(0o440))
        );
        assert!(
            pod.volumes
                .iter()
                .flatten()
                .all(|v| v.name != "master-client-tls")
        );
        let env: Vec<(String, Option<String>)> = pod.containers[0]
            .env
            .iter()
            .flatten()
            .map(|e| (e.name.clone(), e.value.clone()))
            .collect();
        assert_eq!(
            env,
            [(
                "KVPOOL_MASTER_CA_FILE".to_owned(),
                Some("/etc/kvpool/master-tls/ca.crt".to_owned())
            )]
        );

        let mut pod = pod_with("engine");
        client_pod(&mut pod, 0, &tls(true, true));
        assert_eq!(
            items(&pod, "master-client-tls"),
            (
                "roce-client-tls".into(),
                vec!["tls.crt".into(), "tls.key".into()],
                Some(0o440)
            )
        );
        let env: Vec<&str> = pod.containers[0]
            .env
            .iter()
            .flatten()
            .map(|e| e.name.as_str())
            .collect();
        assert_eq!(
            env,
            [
                "KVPOOL_MASTER_CA_FILE",
                "KVPOOL_MASTER_CLIENT_CERT_FILE",
                "KVPOOL_MASTER_CLIENT_KEY_FILE",
                "KVPOOL_MASTER_SERVER_NAME"
            ]
        );
        // The files the variables name are the mounted ones.
        let mounts = pod.containers[0].volume_mounts.clone().expect("mounts");
        for (_, path) in client_env(&tls(true, true)).iter().take(3) {
            assert!(
                mounts.iter().any(|m| path.starts_with(&m.mount_path)),
                "{path} is not mounted"
            );
        }
    }
}

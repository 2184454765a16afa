//! The operator's root key kept by the operator itself (`kvpool operator run --root-key-secret
//! NAME`), so that `helm install` needs no step before it: at start the operator reads the
//! Secret `NAME` in its own namespace and, when there is none, creates it with 32 random bytes
//! (64 hex digits) in its item `root-key`. Two replicas starting at once both try to create it;
//! the one that gets 409 reads the winner's. The key then lives only in that Secret: never in
//! Helm values, a release's history or a GitOps repository. Its RBAC is `get` on that one name
//! and `create` on Secrets in the operator's namespace. I/O boundary: the API server.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use tracing::info;

use crate::root_key::{MIN_ROOT_KEY_LEN, RootKey};

/// The Secret's item that holds the key (as the chart's and users' Secrets name it).
pub const ROOT_KEY_ITEM: &str = "root-key";

/// Why the root key Secret cannot be used.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum RootKeySecretError {
    #[error("cannot read the root key Secret {namespace}/{name}")]
    Get {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("cannot create the root key Secret {namespace}/{name}")]
    Create {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "the root key Secret {namespace}/{name} has no item {ROOT_KEY_ITEM} of at least \
         {MIN_ROOT_KEY_LEN} bytes (put one there: `openssl rand -hex 32`, or delete the Secret \
         to have the operator make one; pools keyed from another root key are locked out)"
    )]
    Unusable { namespace: String, name: String },
}

fn key_of(secret: &Secret) -> Option<RootKey> {
    let item = secret.data.as_ref()?.get(ROOT_KEY_ITEM)?;
    RootKey::from_bytes(&item.0)
}

/// The root key in the Secret `name` of `namespace`, made first when it does not exist.
pub async fn load_or_create(
    client: Client,
    namespace: &str,
    name: &str,
) -> Result<RootKey, RootKeySecretError> {
    let api: Api<Secret> = Api::namespaced(client, namespace);
    let get_err = |source| RootKeySecretError::Get {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        source,
    };
    let unusable = || RootKeySecretError::Unusable {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
    };
    if let Some(existing) = api.get_opt(name).await.map_err(get_err)? {
        return key_of(&existing).ok_or_else(unusable);
    }
    let key: String = (0..32)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect();
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([
                (
                    crate::labels::APP_NAME.to_owned(),
                    crate::labels::APP_NAME_VALUE.to_owned(),
                ),
                (
                    crate::labels::APP_COMPONENT.to_owned(),
                    "operator".to_owned(),
                ),
            ])),
            ..ObjectMeta::default()
        },
        type_: Some("Opaque".to_owned()),
        data: Some(BTreeMap::from([(
            ROOT_KEY_ITEM.to_owned(),
            ByteString(key.clone().into_bytes()),
        )])),
        ..Secret::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(created) => {
            info!(secret = %created.name_any(), %namespace, "created the operator's root key");
            RootKey::from_bytes(key.as_bytes()).ok_or_else(unusable)
        }
        // Another replica made it first: use the one that exists.
        Err(kube::Error::Api(e)) if e.code == 409 => {
            let existing = api
                .get_opt(name)
                .await
                .map_err(get_err)?
                .ok_or_else(unusable)?;
            key_of(&existing).ok_or_else(unusable)
        }
        Err(source) => Err(RootKeySecretError::Create {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            source,
        }),
    }
}

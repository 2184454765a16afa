//! Writes to the API server, the only place the controllers change cluster state: server-side
//! apply of children (one field manager, forced), create-if-absent for objects that must never
//! be overwritten, deletion of orphans by label, and status patches. The field manager is the
//! operator's (`--field-manager`, default `kvpool-operator`), passed in by the caller.
//! I/O boundary: the kube client.

use std::collections::BTreeSet;
use std::fmt::Debug;

use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};

fn apply_params(field_manager: &str) -> PatchParams {
    PatchParams::apply(field_manager).force()
}

/// Server-side apply `obj` (which must carry name, apiVersion and kind) and return the object
/// as the server stored it.
pub async fn apply<K>(field_manager: &str, api: &Api<K>, obj: &K) -> Result<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + Serialize + DeserializeOwned,
{
    let name = obj.name_any();
    api.patch(&name, &apply_params(field_manager), &Patch::Apply(obj))
        .await
        .map_err(|source| Error::Apply {
            kind: K::kind(&()).into_owned(),
            name,
            source,
        })
}

/// Whether the API server refused a change of `spec.selector`, which it keeps immutable on
/// Deployments and DaemonSets ("spec.selector: Invalid value: ...: field is immutable").
fn is_immutable_selector(error: &Error) -> bool {
    matches!(error, Error::Apply { source: kube::Error::Api(status), .. }
        if status.code == 422
            && status.message.contains("spec.selector")
            && status.message.contains("field is immutable"))
}

/// [`apply`] for a workload (Deployment, DaemonSet) whose selector may have changed since it
/// was created (an older operator selected its pods by other labels): the API server refuses
/// to change a selector, so such an object is deleted, its pods going with it in the
/// background, and created again with the new one. Any other failure is returned as it is.
pub async fn apply_workload<K>(field_manager: &str, api: &Api<K>, obj: &K) -> Result<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + Serialize + DeserializeOwned,
{
    match apply(field_manager, api, obj).await {
        Err(e) if is_immutable_selector(&e) => {
            let name = obj.name_any();
            tracing::warn!(kind = %K::kind(&()), %name,
                "its selector changed (labels of an older operator): deleting and recreating it");
            delete_background(api, &name).await?;
            apply(field_manager, api, obj).await
        }
        other => other,
    }
}

/// Delete `name`, its dependents in the background; one already gone is no error (someone
/// else finished the job).
async fn delete_background<K>(api: &Api<K>, name: &str) -> Result<()>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned,
{
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(source) => Err(Error::Delete {
            kind: K::kind(&()).into_owned(),
            name: name.to_owned(),
            source,
        }),
    }
}

/// Create `obj` unless an object of that name exists; an existing one is left untouched.
/// Returns true when this call created it.
pub async fn create_if_absent<K>(field_manager: &str, api: &Api<K>, obj: &K) -> Result<bool>
where
    K: Resource<DynamicType = ()> + Clone + Debug + Serialize + DeserializeOwned,
{
    let params = PostParams {
        field_manager: Some(field_manager.to_owned()),
        ..PostParams::default()
    };
    match api.create(&params, obj).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
        Err(source) => Err(Error::Create {
            kind: K::kind(&()).into_owned(),
            name: obj.name_any(),
            source,
        }),
    }
}

/// Delete every object matching `selector` whose name is not in `keep`. Returns the names
/// deleted, sorted.
pub async fn delete_orphans<K>(
    api: &Api<K>,
    selector: &str,
    keep: &BTreeSet<String>,
) -> Result<Vec<String>>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned,
{
    let list = api
        .list(&ListParams::default().labels(selector))
        .await
        .map_err(|source| Error::List {
            kind: K::kind(&()).into_owned(),
            selector: selector.to_owned(),
            source,
        })?;
    let mut deleted = Vec::new();
    for obj in list.items {
        let name = obj.name_any();
        if keep.contains(&name) || obj.meta().deletion_timestamp.is_some() {
            continue;
        }
        delete_background(api, &name).await?;
        deleted.push(name);
    }
    deleted.sort();
    Ok(deleted)
}

/// Apply the status subresource of `name` with `status` (the whole status object).
pub async fn patch_status<K, S>(
    field_manager: &str,
    api: &Api<K>,
    name: &str,
    status: &S,
) -> Result<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned,
    S: Serialize,
{
    let body = serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": status,
    });
    api.patch_status(name, &apply_params(field_manager), &Patch::Apply(&body))
        .await
        .map_err(|source| Error::PatchStatus {
            kind: K::kind(&()).into_owned(),
            name: name.to_owned(),
            source,
        })
}

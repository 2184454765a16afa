//! The API side of the check: reads the engine pools of a KVCachePool (every PrefillPool and
//! DecodePool of the namespace whose `kvCachePoolRef` names it, as [`EngineServing`], invalid
//! ones and those being deleted left out) and publishes the Warning Event of a new mismatch.
//! The namespace is listed whole and filtered here: a field selector on
//! `spec.kvCachePoolRef.name` needs an API server with CRD selectable fields.
//! I/O boundary: the two lists and the Event.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;
use kube::Resource;
use kube::api::{Api, ListParams};
use kvpool_crd::conditions::MODEL_MISMATCH;
use kvpool_crd::{DecodePool, PrefillPool};
use tracing::warn;

use super::{EngineServing, serving};
use crate::conditions::{self, Desired};
use crate::context::Context;
use crate::controller;
use crate::engine_kind::EnginePool;
use crate::error::{Error, Result};

async fn of_kind<K: EnginePool>(
    ctx: &Context,
    namespace: &str,
    pool: &str,
    out: &mut Vec<EngineServing>,
) -> Result<()> {
    let api: Api<K> = Api::namespaced(ctx.client.clone(), namespace);
    let list = api
        .list(&ListParams::default())
        .await
        .map_err(|source| Error::List {
            kind: K::KIND_NAME.to_owned(),
            selector: String::new(),
            source,
        })?;
    out.extend(
        list.items
            .iter()
            .filter(|o| o.pool_ref() == pool)
            .filter_map(serving),
    );
    Ok(())
}

/// The valid engine pools in `namespace` that reference KVCachePool `pool`: prefill pools
/// first, each kind in the API server's order.
pub async fn engine_pools(
    ctx: &Context,
    namespace: &str,
    pool: &str,
) -> Result<Vec<EngineServing>> {
    let mut out = Vec::new();
    of_kind::<PrefillPool>(ctx, namespace, pool, &mut out).await?;
    of_kind::<DecodePool>(ctx, namespace, pool, &mut out).await?;
    Ok(out)
}

/// Put `mismatch` (this pass's `ModelMismatch` of `obj`) into `current`, the conditions the
/// status step made, keeping its transition time from `previous`; when it is True and new or
/// changed, publish a Warning Event on `obj` with its reason and message (once per change, not
/// every pass).
pub async fn set_and_report<K: Resource<DynamicType = ()>>(
    ctx: &Context,
    obj: &K,
    current: &mut Vec<Condition>,
    previous: &[Condition],
    mismatch: &Desired,
    generation: Option<i64>,
    now: Timestamp,
) -> Result<()> {
    conditions::add(current, previous, mismatch, generation, now);
    if conditions::newly_true(previous, current, MODEL_MISMATCH).is_some() {
        warn!(message = %mismatch.message, "the engine pools cannot serve a model together");
        controller::publish_warning(
            ctx,
            obj,
            mismatch.reason,
            "CheckEnginePools",
            &mismatch.message,
        )
        .await?;
    }
    Ok(())
}

//! Who a reconciled object is: its name, namespace and the controller owner reference its
//! children carry, read from the object's metadata, and the rule its name must follow so that
//! every child name is a DNS label. Shared by the validate steps of all three kinds.
//! I/O boundary: none.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{Resource, ResourceExt};

use crate::error::{Error, Result};
use crate::labels::MAX_OWNER_NAME_LEN;

/// The identity of an object that passed [`identity`].
#[derive(Clone, Debug, PartialEq)]
pub struct Identity {
    pub name: String,
    pub namespace: String,
    /// The controller reference to the object, for its children.
    pub owner: OwnerReference,
}

/// Name, namespace and owner reference of `obj` (a missing one is [`Error::MissingObjectKey`]),
/// with the name checked by [`validate_name`].
pub fn identity<K: Resource<DynamicType = ()>>(obj: &K) -> Result<Identity> {
    let name = obj
        .meta()
        .name
        .clone()
        .ok_or(Error::MissingObjectKey("name"))?;
    let namespace = obj
        .namespace()
        .ok_or(Error::MissingObjectKey("namespace"))?;
    let owner = obj
        .controller_owner_ref(&())
        .ok_or(Error::MissingObjectKey("uid"))?;
    validate_name(&name)?;
    Ok(Identity {
        name,
        namespace,
        owner,
    })
}

/// Names must leave room for the longest child suffix within a DNS label.
pub fn validate_name(name: &str) -> Result<()> {
    if name.len() > MAX_OWNER_NAME_LEN {
        return Err(Error::InvalidSpec(format!(
            "metadata.name must be at most {MAX_OWNER_NAME_LEN} characters so that child names fit in 63, got {}",
            name.len()
        )));
    }
    if name.contains('.') {
        return Err(Error::InvalidSpec(format!(
            "metadata.name {name:?} must not contain '.': child Services need DNS labels"
        )));
    }
    Ok(())
}

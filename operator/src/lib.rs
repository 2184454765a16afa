//! `kvpool-operator`: reconciles `KVCachePool`, `PrefillPool` and `DecodePool` resources into
//! owned Kubernetes objects. Each controller is a pipeline dereference -> validate -> build
//! (pure) -> apply (server-side apply) -> status. The I/O boundary is the kube client inside
//! [`context::Context`] (used by [`apply`] and the dereference step), the master's `Stats` call
//! behind [`pool_usage::MasterStats`], the conductor's load endpoint behind
//! [`conductor_load::ConductorLoad`], the admin listener started by [`run`], and the file copy
//! of [`python_package`] (`kvpool operator install-python`, run by engine pods' init containers)
//! and the read of the root key file in [`root_key`]; every other module is pure.

pub mod apply;
pub mod cachepool;
pub mod cli;
pub mod conditions;
pub mod conductor_load;
pub mod context;
pub mod contract;
pub mod controller;
pub mod crd;
pub mod engine_kind;
pub mod enginepool;
pub mod error;
pub mod identity;
pub mod issuer;
pub mod labels;
pub mod master_tls;
pub mod metrics;
pub mod pod;
pub mod pool_usage;
pub mod python_package;
pub mod rbac;
pub mod root_key;
pub mod root_key_secret;
pub mod run;
pub mod serving;
#[cfg(test)]
mod test_fixtures;
pub mod transfer_tls;

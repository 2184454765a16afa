//! `Placement`: where a put's replicas go and how the object is pinned, as Python passes it.

use pyo3::prelude::*;

use crate::errors::Failure;
use crate::ops::PutArgs;

fn replicas(n: u32) -> Result<u8, Failure> {
    u8::try_from(n)
        .ok()
        .filter(|n| *n >= 1)
        .ok_or_else(|| Failure::invalid(format!("replica count {n} must be 1 to 255")))
}

/// Where a put's replicas go and how the object is pinned once committed (Mooncake's
/// `ReplicateConfig`): `replicas` copies, the first on node `preferred` when given, a hard pin
/// or a soft pin for `soft_pin_ttl_ms`. Checked when made.
#[pyclass(module = "kvpool._native", frozen)]
pub struct Placement {
    args: PutArgs,
}

#[pymethods]
impl Placement {
    #[new]
    #[pyo3(signature = (replicas = 1, preferred = None, hard_pin = false, soft_pin_ttl_ms = 0))]
    fn new(
        replicas: u32,
        preferred: Option<String>,
        hard_pin: bool,
        soft_pin_ttl_ms: u64,
    ) -> PyResult<Self> {
        Ok(Self {
            args: PutArgs {
                replicas: self::replicas(replicas)?,
                preferred: preferred.filter(|p| !p.is_empty()),
                hard_pin,
                soft_pin_ttl_ms,
            },
        })
    }
}

/// The put arguments of `placement` (one replica, no preference, no pin when none is given).
pub fn placed(placement: Option<Bound<'_, Placement>>) -> PutArgs {
    placement.map_or_else(
        || PutArgs {
            replicas: 1,
            ..PutArgs::default()
        },
        |p| p.get().args.clone(),
    )
}

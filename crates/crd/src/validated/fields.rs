//! Field-level checks shared by every kind: integers within their range, byte quantities that
//! are positive, lists the API server treats as sets. Each failure names the field. Pure, no I/O.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::error::SpecError;
use crate::quantity;

/// `value` converted to `T` if it lies within `min..=max`.
pub(super) fn ranged<T: TryFrom<i32>>(
    field: &'static str,
    value: i32,
    min: i32,
    max: i32,
) -> Result<T, SpecError> {
    let err = || SpecError::OutOfRange {
        field,
        value: i64::from(value),
        min: i64::from(min),
        max: i64::from(max),
    };
    if value < min || value > max {
        return Err(err());
    }
    T::try_from(value).map_err(|_| err())
}

/// The API server treats these lists as sets: an entry may appear once.
pub(super) fn unique(field: &'static str, items: &[String]) -> Result<(), SpecError> {
    let mut seen = std::collections::BTreeSet::new();
    if items.iter().all(|i| seen.insert(i)) {
        Ok(())
    } else {
        Err(SpecError::Conflict {
            field,
            message: "lists an entry more than once",
        })
    }
}

pub(super) fn positive_bytes(field: &'static str, q: &Quantity) -> Result<u64, SpecError> {
    match quantity::parse_bytes(q) {
        Ok(0) => Err(SpecError::OutOfRange {
            field,
            value: 0,
            min: 1,
            max: i64::MAX,
        }),
        Ok(bytes) => Ok(bytes),
        Err(source) => Err(SpecError::Quantity { field, source }),
    }
}

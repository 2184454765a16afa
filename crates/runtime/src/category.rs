//! The `category()` label of error enums: the variant's name in snake case, as metrics labels,
//! logs and events show it. Pure: a macro, no I/O.

/// Give each error enum an inherent `pub fn category(&self) -> &'static str`: the variant's
/// name, through the enum's `strum::IntoStaticStr` derive (with
/// `#[strum(serialize_all = "snake_case")]`, and `#[strum(serialize = "...")]` where a variant
/// wants another label).
///
/// ```
/// #[derive(Debug, strum::IntoStaticStr)]
/// #[strum(serialize_all = "snake_case")]
/// enum LoadError {
///     NotFound,
///     BadSyntax,
/// }
/// kvpool_runtime::error_category!(LoadError);
/// assert_eq!(LoadError::BadSyntax.category(), "bad_syntax");
/// ```
#[macro_export]
macro_rules! error_category {
    ($($error:ty),+ $(,)?) => {$(
        impl $error {
            /// Short label for metrics, logs and events: the variant's name in snake case.
            pub fn category(&self) -> &'static str {
                self.into()
            }
        }
    )+};
}

//! Range checks of command-line values shared by every role's flags: one error type that names
//! the flag and what is wrong with its value, and the checks the cost models and rates need.
//! Pure; no I/O.

/// A flag whose value is out of range. Displays as `--<flag>: <problem>`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("--{flag}: {problem}")]
pub struct FlagError {
    /// The flag's long name, without the dashes.
    pub flag: &'static str,
    /// What is wrong with the value.
    pub problem: String,
}

impl FlagError {
    pub fn new(flag: &'static str, problem: impl Into<String>) -> Self {
        Self {
            flag,
            problem: problem.into(),
        }
    }
}

/// `v` when it is a finite number above zero.
pub fn positive(flag: &'static str, v: f64) -> Result<f64, FlagError> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(FlagError::new(
            flag,
            format!("must be a finite number > 0, got {v}"),
        ))
    }
}

/// A bandwidth flag given in GB/s, in bytes per second; it must be finite and > 0.
pub fn gbps(flag: &'static str, v: f64) -> Result<f64, FlagError> {
    Ok(positive(flag, v)? * 1e9)
}

/// `v` when it is a finite number of zero or more.
pub fn non_negative(flag: &'static str, v: f64) -> Result<f64, FlagError> {
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(FlagError::new(
            flag,
            format!("must be a finite number >= 0, got {v}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_name_the_flag_and_the_value() {
        assert_eq!(positive("rate", 2.5), Ok(2.5));
        assert_eq!(non_negative("rate", 0.0), Ok(0.0));
        let e = positive("rate", 0.0).unwrap_err();
        assert_eq!(e.to_string(), "--rate: must be a finite number > 0, got 0");
        for bad in [f64::NAN, f64::INFINITY, -1.0] {
            assert_eq!(non_negative("x", bad).unwrap_err().flag, "x");
            assert!(positive("x", bad).is_err());
        }
    }
}

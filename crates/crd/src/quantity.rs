//! Byte sizes written as Kubernetes quantities (`512Gi`, `1.5T`, `3e9`): exact parsing into
//! bytes and rendering bytes back. Pure functions, no I/O.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// Why a quantity is not a byte size.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum QuantityError {
    /// The text does not follow the quantity grammar.
    #[error(
        "{text:?} is not a quantity (expected digits with an optional suffix such as Ki, Mi, Gi, k, M, G or e9)"
    )]
    #[strum(serialize = "quantity_syntax")]
    Syntax {
        /// The offending text.
        text: String,
    },
    /// The quantity is negative.
    #[error("{text:?} is negative")]
    #[strum(serialize = "quantity_negative")]
    Negative {
        /// The offending text.
        text: String,
    },
    /// The quantity does not fit in 64 bits or has too many digits.
    #[error("{text:?} is too large")]
    #[strum(serialize = "quantity_too_large")]
    TooLarge {
        /// The offending text.
        text: String,
    },
}

impl QuantityError {
    /// Short stable label for metrics and Events.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// Most significant digits accepted; more could overflow the exact arithmetic below.
const MAX_DIGITS: usize = 20;
/// Largest decimal exponent accepted (`e18`, `E` suffix).
const MAX_EXPONENT: i32 = 18;

/// Parses a quantity into bytes. Fractions of a byte round up, as Kubernetes does when it reads
/// a quantity as an integer.
pub fn parse_bytes(q: &Quantity) -> Result<u64, QuantityError> {
    parse_bytes_str(&q.0)
}

/// [`parse_bytes`] on a plain string.
pub fn parse_bytes_str(text: &str) -> Result<u64, QuantityError> {
    let syntax = || QuantityError::Syntax {
        text: text.to_owned(),
    };
    let too_large = || QuantityError::TooLarge {
        text: text.to_owned(),
    };
    let trimmed = text.trim();
    let (negative, rest) = match trimmed.as_bytes().first() {
        Some(b'-') => (true, &trimmed[1..]),
        Some(b'+') => (false, &trimmed[1..]),
        _ => (false, trimmed),
    };
    let number_len = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    let (number, suffix) = rest.split_at(number_len);
    let (int_part, frac_part) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number, ""),
    };
    if (int_part.is_empty() && frac_part.is_empty()) || frac_part.contains('.') {
        return Err(syntax());
    }
    // (numerator base, power of two, power of ten) of the suffix
    let (pow2, pow10): (u32, i32) = match suffix {
        "" => (0, 0),
        "Ki" => (10, 0),
        "Mi" => (20, 0),
        "Gi" => (30, 0),
        "Ti" => (40, 0),
        "Pi" => (50, 0),
        "Ei" => (60, 0),
        "m" => (0, -3),
        "k" => (0, 3),
        "M" => (0, 6),
        "G" => (0, 9),
        "T" => (0, 12),
        "P" => (0, 15),
        "E" => (0, 18),
        s if s.starts_with(['e', 'E']) => {
            let exp: i32 = s[1..].parse().map_err(|_| syntax())?;
            if exp.abs() > MAX_EXPONENT {
                return Err(too_large());
            }
            (0, exp)
        }
        _ => return Err(syntax()),
    };
    let digits = format!("{int_part}{frac_part}");
    let significant = digits.trim_start_matches('0');
    if significant.len() > MAX_DIGITS {
        return Err(too_large());
    }
    let mantissa: u128 = if significant.is_empty() {
        0
    } else {
        significant.parse().map_err(|_| syntax())?
    };
    if negative && mantissa != 0 {
        return Err(QuantityError::Negative {
            text: text.to_owned(),
        });
    }
    // value = mantissa * 2^pow2 * 10^(pow10 - frac_len)
    let frac_len = i32::try_from(frac_part.len()).map_err(|_| too_large())?;
    let scale10 = pow10 - frac_len;
    let mut numerator = mantissa << pow2;
    let mut denominator: u128 = 1;
    if scale10 >= 0 {
        let factor = 10u128
            .checked_pow(scale10.unsigned_abs())
            .ok_or_else(too_large)?;
        numerator = numerator.checked_mul(factor).ok_or_else(too_large)?;
    } else {
        denominator = 10u128
            .checked_pow(scale10.unsigned_abs())
            .ok_or_else(too_large)?;
    }
    let value = numerator.div_ceil(denominator);
    u64::try_from(value).map_err(|_| too_large())
}

/// Renders bytes as a quantity with the largest binary suffix that keeps it exact
/// (`1073741824` -> `1Gi`, `1536 MiB` -> `1536Mi`, `1000` -> `1000`).
pub fn format_bytes(bytes: u64) -> Quantity {
    const SUFFIXES: [(&str, u32); 6] = [
        ("Ei", 60),
        ("Pi", 50),
        ("Ti", 40),
        ("Gi", 30),
        ("Mi", 20),
        ("Ki", 10),
    ];
    if bytes == 0 {
        return Quantity("0".to_owned());
    }
    for (suffix, shift) in SUFFIXES {
        let unit = 1u64 << shift;
        if bytes.is_multiple_of(unit) {
            return Quantity(format!("{}{suffix}", bytes / unit));
        }
    }
    Quantity(bytes.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_every_suffix() {
        let cases: &[(&str, u64)] = &[
            ("0", 0),
            ("1", 1),
            ("1Ki", 1024),
            ("512Gi", 512 << 30),
            ("1.5Gi", 3 << 29),
            ("3Ti", 3 << 40),
            ("1Pi", 1 << 50),
            ("2Ei", 2 << 60),
            ("1k", 1_000),
            ("2M", 2_000_000),
            ("1.5G", 1_500_000_000),
            ("4T", 4_000_000_000_000),
            ("1P", 1_000_000_000_000_000),
            ("1E", 1_000_000_000_000_000_000),
            ("3e9", 3_000_000_000),
            ("3E9", 3_000_000_000),
            ("+7", 7),
            (".5Ki", 512),
            ("5.", 5),
            ("1500m", 2),
            ("1m", 1),
            ("0.1", 1),
            ("-0", 0),
            ("12e-1", 2),
            // 20 significant digits: the largest byte counts
            ("10000000000000000001", 10_000_000_000_000_000_001),
            ("18446744073709551615", u64::MAX),
            ("15Ei", 15 << 60),
        ];
        for (text, bytes) in cases {
            assert_eq!(parse_bytes_str(text), Ok(*bytes), "{text}");
        }
    }

    #[test]
    fn rejects_bad_text_with_the_right_error() {
        for text in ["", "Gi", "1.2.3", "1GB", "1 Gi", "ten", "1e", "1ex", "."] {
            assert!(
                matches!(parse_bytes_str(text), Err(QuantityError::Syntax { .. })),
                "{text:?}"
            );
        }
        assert!(matches!(
            parse_bytes_str("-1Gi"),
            Err(QuantityError::Negative { .. })
        ));
        for text in [
            "16Ei",
            "1e19",
            "1e40",
            "123456789012345678901",
            "18446744073709551616",
        ] {
            assert!(
                matches!(parse_bytes_str(text), Err(QuantityError::TooLarge { .. })),
                "{text:?}"
            );
        }
        assert_eq!(
            parse_bytes_str("1GB").map_err(|e| e.category()),
            Err("quantity_syntax")
        );
    }

    #[test]
    fn formats_with_the_largest_exact_binary_suffix() {
        assert_eq!(format_bytes(0).0, "0");
        assert_eq!(format_bytes(1000).0, "1000");
        assert_eq!(format_bytes(1024).0, "1Ki");
        assert_eq!(format_bytes(1536 << 20).0, "1536Mi");
        assert_eq!(format_bytes(4 << 40).0, "4Ti");
    }

    proptest! {
        // Fixed seed: deterministic in CI.
        #![proptest_config(ProptestConfig {
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x7175_616e),
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn format_then_parse_is_identity(bytes in any::<u64>()) {
            prop_assert_eq!(parse_bytes(&format_bytes(bytes)), Ok(bytes));
        }

        #[test]
        fn parse_never_panics(text in "[-+]?[0-9.]{0,24}([KMGTPE]i?|[mk]|[eE][-+]?[0-9]{0,3})?") {
            let _ = parse_bytes_str(&text);
        }
    }
}

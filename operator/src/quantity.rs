//! Byte quantities: parse a Kubernetes `Quantity` (`512Gi`, `3T`, `1.5Gi`, `1e9`) into whole
//! bytes and print bytes back as the shortest exact binary quantity. Used to validate capacities
//! and to add them up for status. I/O boundary: none.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// Why a quantity is not a byte count.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("{0:?} is not a quantity (expected a number with an optional suffix such as Gi)")]
    Syntax(String),
    #[error("{0:?} is out of range")]
    Range(String),
    #[error("{0:?} is not a whole number of bytes")]
    Fraction(String),
}

impl QuantityError {
    /// Short label for metrics and Events.
    pub fn category(&self) -> &'static str {
        match self {
            QuantityError::Syntax(_) => "quantity_syntax",
            QuantityError::Range(_) => "quantity_range",
            QuantityError::Fraction(_) => "quantity_fraction",
        }
    }
}

const SUFFIXES: &[(&str, u128)] = &[
    ("Ki", 1 << 10),
    ("Mi", 1 << 20),
    ("Gi", 1 << 30),
    ("Ti", 1 << 40),
    ("Pi", 1 << 50),
    ("Ei", 1 << 60),
    ("k", 1_000),
    ("M", 1_000_000),
    ("G", 1_000_000_000),
    ("T", 1_000_000_000_000),
    ("P", 1_000_000_000_000_000),
    ("E", 1_000_000_000_000_000_000),
];

/// Whole bytes of `q`.
pub fn bytes(q: &Quantity) -> Result<u128, QuantityError> {
    parse_bytes(&q.0)
}

/// Whole bytes of a quantity string.
pub fn parse_bytes(text: &str) -> Result<u128, QuantityError> {
    let s = text.trim();
    let syntax = || QuantityError::Syntax(text.to_owned());
    let range = || QuantityError::Range(text.to_owned());
    let (number, multiplier, exp10) = if let Some((n, m)) = SUFFIXES
        .iter()
        .find_map(|(suffix, m)| s.strip_suffix(suffix).map(|n| (n, *m)))
    {
        (n, m, 0i32)
    } else if let Some((n, e)) = s.split_once(['e', 'E']) {
        let e: i32 = e.parse().map_err(|_| syntax())?;
        (n, 1, e)
    } else {
        (s, 1, 0)
    };
    let number = number.strip_prefix('+').unwrap_or(number);
    if number.is_empty() || number.starts_with('-') {
        return Err(syntax());
    }
    let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
    if !int_part.chars().all(|c| c.is_ascii_digit())
        || !frac_part.chars().all(|c| c.is_ascii_digit())
    {
        return Err(syntax());
    }
    if int_part.is_empty() && frac_part.is_empty() {
        return Err(syntax());
    }
    // value = digits / 10^frac_len * multiplier * 10^exp10, kept exact in integers.
    let digits: u128 = format!("{int_part}{frac_part}")
        .parse()
        .map_err(|_| range())?;
    let mut numerator = digits.checked_mul(multiplier).ok_or_else(range)?;
    let mut denominator_exp = i32::try_from(frac_part.len()).map_err(|_| range())?;
    denominator_exp -= exp10;
    while denominator_exp < 0 {
        numerator = numerator.checked_mul(10).ok_or_else(range)?;
        denominator_exp += 1;
    }
    let denominator = 10u128
        .checked_pow(u32::try_from(denominator_exp).map_err(|_| range())?)
        .ok_or_else(range)?;
    if numerator % denominator != 0 {
        return Err(QuantityError::Fraction(text.to_owned()));
    }
    Ok(numerator / denominator)
}

/// The shortest exact binary quantity for `bytes` (`1536Mi`, `4Ti`, `0`).
pub fn format_bytes(bytes: u128) -> Quantity {
    const BINARY: &[(&str, u128)] = &[
        ("Ei", 1 << 60),
        ("Pi", 1 << 50),
        ("Ti", 1 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ];
    if bytes == 0 {
        return Quantity("0".to_owned());
    }
    for (suffix, unit) in BINARY {
        if bytes % unit == 0 {
            return Quantity(format!("{}{suffix}", bytes / unit));
        }
    }
    Quantity(bytes.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_decimal_fractional_and_exponent_forms() {
        assert_eq!(parse_bytes("512Gi"), Ok(512 << 30));
        assert_eq!(parse_bytes("3T"), Ok(3_000_000_000_000));
        assert_eq!(parse_bytes("1.5Gi"), Ok(3 << 29));
        assert_eq!(parse_bytes("1e9"), Ok(1_000_000_000));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("0"), Ok(0));
    }

    #[test]
    fn rejects_nonsense_with_the_offending_text() {
        assert_eq!(
            parse_bytes("lots"),
            Err(QuantityError::Syntax("lots".into()))
        );
        assert_eq!(
            parse_bytes("-1Gi"),
            Err(QuantityError::Syntax("-1Gi".into()))
        );
        assert_eq!(
            parse_bytes("0.5"),
            Err(QuantityError::Fraction("0.5".into()))
        );
        assert_eq!(
            parse_bytes("100m"),
            Err(QuantityError::Syntax("100m".into()))
        );
        assert!(matches!(parse_bytes("1e80"), Err(QuantityError::Range(_))));
        assert_eq!(parse_bytes(""), Err(QuantityError::Syntax(String::new())));
    }

    #[test]
    fn formats_the_shortest_exact_binary_unit() {
        assert_eq!(format_bytes(4 << 40).0, "4Ti");
        assert_eq!(format_bytes(1536 << 20).0, "1536Mi");
        assert_eq!(format_bytes(1000).0, "1000");
        assert_eq!(format_bytes(0).0, "0");
    }
}

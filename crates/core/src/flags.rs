//! Command-line values shared by every role's flags: one error type that names the flag and
//! what is wrong with its value, the range checks the cost models and rates need, and the
//! parsers of the two value kinds every binary spells the same way (docs/cli.md): durations
//! (`500ms`, `2s`, `1m 30s`) and data rates (`25GB/s`, `200Gbit/s`). Pure; no I/O.

use std::fmt;
use std::time::Duration;

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

/// Parses a duration flag: a humantime duration (`500ms`, `2s`, `1m 30s`), a decimal number
/// with one unit (`0.5s`, `2.5ms`, `1.5m`), or a bare number of seconds (`30`, `0.1`) — the
/// spelling of the `--*-s` flags the duration flags replaced, whose names stay as hidden
/// aliases for one release. Negative, NaN and out-of-range values are refused.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if let Ok(secs) = s.parse::<f64>() {
        return seconds(secs, s);
    }
    if let Ok(d) = humantime::parse_duration(s) {
        return Ok(d);
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let scale = match unit.trim() {
        "ns" => 1e-9,
        "us" | "\u{b5}s" => 1e-6,
        "ms" => 1e-3,
        "s" | "sec" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        _ => {
            return Err(format!(
                "`{s}` is not a duration (examples: 500ms, 2s, 1m 30s, 0.5s; a bare number is seconds)"
            ));
        }
    };
    let number: f64 = number
        .parse()
        .map_err(|_| format!("`{s}` is not a duration: `{number}` is not a number"))?;
    seconds(number * scale, s)
}

fn seconds(secs: f64, text: &str) -> Result<Duration, String> {
    Duration::try_from_secs_f64(secs).map_err(|_| {
        format!("`{text}` is not a duration of zero or more that fits in 64-bit seconds")
    })
}

/// A data rate, in bytes per second. Parsed from flags by [`parse_bandwidth`]; displays in
/// GB/s (10^9 bytes).
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd)]
pub struct Bandwidth(f64);

impl Bandwidth {
    /// `bytes_per_s`, when it is finite and above zero.
    pub fn from_bytes_per_s(bytes_per_s: f64) -> Option<Self> {
        (bytes_per_s.is_finite() && bytes_per_s > 0.0).then_some(Self(bytes_per_s))
    }

    pub fn bytes_per_s(self) -> f64 {
        self.0
    }
}

impl fmt::Display for Bandwidth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}GB/s", self.0 / 1e9)
    }
}

/// Parses a data-rate flag: a number and a unit that says whether it counts bytes (`B/s`,
/// `kB/s`, `MB/s`, `GB/s`, `TB/s`, `KiB/s`, `MiB/s`, `GiB/s`, `TiB/s`) or bits (`bit/s`,
/// `Mbit/s`, `Gbit/s`, `Tbit/s`, `Gb/s`, `Gbps`: a NIC's 200 Gbps is 25 GB/s). A bare number is
/// GB/s, as the `--*-bandwidth-gbps` flags this replaced read it (their names stay as hidden
/// aliases for one release). The rate must be finite and above zero.
pub fn parse_bandwidth(s: &str) -> Result<Bandwidth, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| {
            !(c.is_ascii_digit() || c == '.' || c == 'e' || c == 'E' || c == '-' || c == '+')
        })
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    const BITS: f64 = 1.0 / 8.0;
    let scale = match unit.trim() {
        "" | "GB/s" => 1e9,
        "B/s" => 1.0,
        "kB/s" | "KB/s" => 1e3,
        "MB/s" => 1e6,
        "TB/s" => 1e12,
        "KiB/s" => 1024.0,
        "MiB/s" => 1024.0 * 1024.0,
        "GiB/s" => 1024.0 * 1024.0 * 1024.0,
        "TiB/s" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        "bit/s" | "bps" => BITS,
        "kbit/s" | "kb/s" | "kbps" => 1e3 * BITS,
        "Mbit/s" | "Mb/s" | "Mbps" => 1e6 * BITS,
        "Gbit/s" | "Gb/s" | "Gbps" => 1e9 * BITS,
        "Tbit/s" | "Tb/s" | "Tbps" => 1e12 * BITS,
        other => {
            return Err(format!(
                "`{s}`: unknown rate unit `{other}` (bytes: B/s, kB/s, MB/s, GB/s, TB/s, KiB/s, MiB/s, GiB/s, TiB/s; bits: bit/s, Mbit/s, Gbit/s, Tbit/s, Gbps)"
            ));
        }
    };
    let number: f64 = number.parse().map_err(|_| {
        format!("`{s}` is not a data rate: `{number}` is not a number (example: 25GB/s)")
    })?;
    Bandwidth::from_bytes_per_s(number * scale)
        .ok_or_else(|| format!("`{s}`: a data rate must be finite and above zero"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_units_decimals_and_bare_seconds() {
        let ms = Duration::from_millis;
        assert_eq!(parse_duration("500ms"), Ok(ms(500)));
        assert_eq!(parse_duration("2s"), Ok(ms(2000)));
        assert_eq!(parse_duration("1m 30s"), Ok(ms(90_000)));
        assert_eq!(parse_duration("0.5s"), Ok(ms(500)));
        assert_eq!(parse_duration("2.5ms"), Ok(Duration::from_micros(2500)));
        assert_eq!(parse_duration("30"), Ok(ms(30_000)));
        assert_eq!(parse_duration("0.1"), Ok(ms(100)));
        assert_eq!(parse_duration(" 0 "), Ok(Duration::ZERO));
        for bad in [
            "-1",
            "-1s",
            "NaN",
            "inf",
            "1e30",
            "2 parsecs",
            "s",
            "",
            "1.2.3s",
        ] {
            let e = parse_duration(bad).unwrap_err();
            assert!(e.contains(bad.trim()), "{bad}: {e}");
        }
    }

    #[test]
    fn rates_say_bytes_or_bits() {
        let gbs = |s| parse_bandwidth(s).map(Bandwidth::bytes_per_s);
        assert_eq!(gbs("25GB/s"), Ok(25e9));
        assert_eq!(gbs("25"), Ok(25e9));
        assert_eq!(gbs("200Gbps"), Ok(25e9));
        assert_eq!(gbs("200 Gbit/s"), Ok(25e9));
        assert_eq!(gbs("1GiB/s"), Ok(1024.0 * 1024.0 * 1024.0));
        assert_eq!(gbs("12.5 GB/s"), Ok(12.5e9));
        assert_eq!(gbs("1e3MB/s"), Ok(1e9));
        for bad in ["0", "-5GB/s", "fast", "25 furlongs/s", "GB/s", "inf", "NaN"] {
            assert!(parse_bandwidth(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse_bandwidth("25").map(|b| b.to_string()),
            Ok("25GB/s".into())
        );
    }

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

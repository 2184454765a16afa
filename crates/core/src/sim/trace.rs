//! Mooncake request traces (JSON lines: `timestamp` ms, `input_length`, `output_length`,
//! `hash_ids`). I/O boundary: `load` opens a file; `parse` reads any `BufRead` and is pure
//! otherwise. Every error names the line and, where it applies, the field.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceRecord {
    /// Arrival time, milliseconds since the start of the trace.
    pub timestamp_ms: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Generated tokens.
    pub output_length: u32,
    /// Chained block keys of the prompt, one per block.
    pub hash_ids: Vec<u64>,
}

/// Errors of reading a trace.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum TraceError {
    #[error("cannot open trace {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read trace line {line}")]
    Read {
        line: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("trace line {line} is not valid JSON")]
    Json {
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("trace line {line}: field `{field}` {problem}")]
    Field {
        line: usize,
        field: &'static str,
        problem: String,
    },
    #[error("trace line {line} is not a JSON object")]
    NotObject { line: usize },
    #[error("trace has no requests")]
    Empty,
}

impl TraceError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// Reads the trace at `path`; see `parse`.
pub fn load(path: &Path, block_size: u32) -> Result<Vec<TraceRecord>, TraceError> {
    let file = std::fs::File::open(path).map_err(|source| TraceError::Open {
        path: path.to_owned(),
        source,
    })?;
    parse(std::io::BufReader::new(file), block_size)
}

/// Parses a trace: one JSON object per line (blank lines are skipped), each with exactly the
/// block count that `input_length` needs at `block_size` tokens per block. Records are returned
/// sorted by timestamp (stable: equal timestamps keep file order).
pub fn parse(reader: impl BufRead, block_size: u32) -> Result<Vec<TraceRecord>, TraceError> {
    let mut records = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line_no = i + 1;
        let text = line.map_err(|source| TraceError::Read {
            line: line_no,
            source,
        })?;
        if text.trim().is_empty() {
            continue;
        }
        records.push(parse_line(&text, line_no, block_size)?);
    }
    if records.is_empty() {
        return Err(TraceError::Empty);
    }
    records.sort_by_key(|r| r.timestamp_ms);
    Ok(records)
}

fn parse_line(text: &str, line: usize, block_size: u32) -> Result<TraceRecord, TraceError> {
    let value: Value =
        serde_json::from_str(text).map_err(|source| TraceError::Json { line, source })?;
    let obj = value.as_object().ok_or(TraceError::NotObject { line })?;
    let field_err = |field: &'static str, problem: String| TraceError::Field {
        line,
        field,
        problem,
    };
    let uint = |field: &'static str| -> Result<u64, TraceError> {
        match obj.get(field) {
            None => Err(field_err(field, "is missing".into())),
            Some(v) => v.as_u64().ok_or_else(|| {
                field_err(field, format!("must be a non-negative integer, got {v}"))
            }),
        }
    };
    let timestamp_ms = uint("timestamp")?;
    let input_length = uint("input_length")?;
    let output = uint("output_length")?;
    let output_length = u32::try_from(output)
        .map_err(|_| field_err("output_length", format!("is too large: {output}")))?;
    let ids = match obj.get("hash_ids") {
        None => return Err(field_err("hash_ids", "is missing".into())),
        Some(Value::Array(ids)) => ids,
        Some(v) => return Err(field_err("hash_ids", format!("must be an array, got {v}"))),
    };
    let mut hash_ids = Vec::with_capacity(ids.len());
    for (k, id) in ids.iter().enumerate() {
        let id = id.as_u64().ok_or_else(|| {
            field_err(
                "hash_ids",
                format!("element {k} must be a non-negative integer, got {id}"),
            )
        })?;
        hash_ids.push(id);
    }
    let needed = input_length.div_ceil(u64::from(block_size.max(1)));
    if hash_ids.len() as u64 != needed {
        return Err(field_err(
            "hash_ids",
            format!(
                "has {} ids but input_length {input_length} needs {needed} blocks of {block_size} tokens",
                hash_ids.len()
            ),
        ));
    }
    Ok(TraceRecord {
        timestamp_ms,
        input_length,
        output_length,
        hash_ids,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_str(s: &str) -> Result<Vec<TraceRecord>, TraceError> {
        parse(s.as_bytes(), 512)
    }

    #[test]
    fn parses_and_sorts() {
        let t = "{\"timestamp\": 5, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [0, 1]}\n\
                 \n\
                 {\"timestamp\": 2, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [7]}\n";
        let r = parse_str(t).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].timestamp_ms, 2);
        assert_eq!(r[1].hash_ids, vec![0, 1]);
        assert_eq!(r[1].output_length, 3);
    }

    #[test]
    fn errors_name_line_and_field() {
        let ok =
            "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0]}\n";
        let cases = [
            (
                "{\"timestamp\": 0}",
                "line 2: field `input_length` is missing",
            ),
            (
                "{\"timestamp\": -1, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}",
                "line 2: field `timestamp` must be a non-negative integer",
            ),
            (
                "{\"timestamp\": 1, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [\"x\"]}",
                "line 2: field `hash_ids` element 0 must be",
            ),
            (
                "{\"timestamp\": 1, \"input_length\": 1000, \"output_length\": 1, \"hash_ids\": [0]}",
                "line 2: field `hash_ids` has 1 ids but input_length 1000 needs 2 blocks",
            ),
            (
                "{\"timestamp\": 1, \"input_length\": 1, \"output_length\": 99999999999, \"hash_ids\": [0]}",
                "line 2: field `output_length` is too large",
            ),
            ("[1, 2]", "trace line 2 is not a JSON object"),
            ("{\"timestamp\": ", "trace line 2 is not valid JSON"),
        ];
        for (bad, want) in cases {
            let err = parse_str(&format!("{ok}{bad}\n")).unwrap_err();
            assert!(
                err.to_string().contains(want),
                "{err} does not contain {want}"
            );
        }
        assert_eq!(parse_str("\n").unwrap_err().category(), "empty");
        let err = load(Path::new("/nonexistent/trace.jsonl"), 512).unwrap_err();
        assert_eq!(err.category(), "open");
    }
}

//! Reading a Prometheus text exposition (a child's `/metrics`, format 0.0.4): its samples with
//! their labels, sums of a metric's samples with or without a label filter, and the first sample
//! carrying some labels. Label values may hold commas, braces and escapes (`\\`, `\"`, `\n`); a
//! sample may end with a timestamp. A line that is not a well-formed sample is skipped. Pure.
//!
//! Hand-written on purpose (docs/architecture.md, "Hand-written pieces we keep"): of the parser
//! crates, `prometheus-parse` splits label pairs on every comma, and `openmetrics-parser` rejects
//! valid expositions (one family whose series have different label names, a final line without
//! a newline).

/// One sample line: the series name (with any `_total`, `_sum`, `_count` or `_bucket` suffix),
/// its labels in the order written, and its value.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    /// The value of label `name`, if the sample has it.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Every well-formed sample of `text`, in order (comments, blank and malformed lines skipped).
pub fn samples(text: &str) -> impl Iterator<Item = Sample> + '_ {
    text.lines().filter_map(parse_sample)
}

/// Parses one line of an exposition; `None` for a comment, a blank or a malformed line.
pub fn parse_sample(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.starts_with('#') {
        return None;
    }
    let end = line
        .find(|c: char| c == '{' || c.is_ascii_whitespace())
        .unwrap_or(line.len());
    let (name, mut rest) = line.split_at(end);
    let valid_name = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    if name.is_empty() || !name.chars().all(valid_name) {
        return None;
    }
    let mut labels = Vec::new();
    if let Some(inner) = rest.strip_prefix('{') {
        rest = parse_labels(inner, &mut labels)?;
    }
    let mut fields = rest.split_ascii_whitespace();
    let value = parse_value(fields.next()?)?;
    // An optional timestamp (milliseconds since the epoch); nothing after it.
    if let Some(timestamp) = fields.next() {
        timestamp.parse::<i64>().ok()?;
    }
    if fields.next().is_some() {
        return None;
    }
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// Parses `name="value", ...}` (after the opening brace) into `labels`; the text after the `}`.
fn parse_labels<'a>(mut rest: &'a str, labels: &mut Vec<(String, String)>) -> Option<&'a str> {
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix('}') {
            return Some(after);
        }
        let (name, after) = rest.split_once('=')?;
        let name = name.trim();
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return None;
        }
        let (value, after) = parse_quoted(after.trim_start())?;
        labels.push((name.to_owned(), value));
        rest = after.trim_start();
        match rest.strip_prefix(',') {
            Some(after) => rest = after,
            None if rest.starts_with('}') => {}
            None => return None,
        }
    }
}

/// Parses `"..."` with the exposition's escapes; the unescaped text and what follows the quote.
fn parse_quoted(text: &str) -> Option<(String, &str)> {
    let body = text.strip_prefix('"')?;
    let mut value = String::new();
    let mut chars = body.char_indices();
    loop {
        match chars.next()? {
            (i, '"') => return Some((value, body.get(i + 1..)?)),
            (_, '\\') => match chars.next()?.1 {
                'n' => value.push('\n'),
                c => value.push(c),
            },
            (_, c) => value.push(c),
        }
    }
}

/// A sample value as Go writes floats (`1`, `2.5e-3`, `+Inf`, `-Inf`, `NaN`).
fn parse_value(text: &str) -> Option<f64> {
    match text {
        "+Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => text.parse().ok().filter(|v: &f64| v.is_finite()),
    }
}

/// Sum of every sample of metric `name`.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    samples(text)
        .filter(|s| s.name == name)
        .map(|s| s.value)
        .sum()
}

/// Sum of the samples of metric `name` whose labels include `label="value"`.
pub fn metric_sum_labelled(text: &str, name: &str, label: &str, value: &str) -> f64 {
    samples(text)
        .filter(|s| s.name == name && s.label(label) == Some(value))
        .map(|s| s.value)
        .sum()
}

/// The value of the first sample of `name` that carries every one of `labels`, each written as
/// in the exposition (`kind="repair"`). A label pair that does not parse matches nothing.
pub fn metric_value(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    let mut wanted = Vec::new();
    for pair in labels {
        parse_labels(&format!("{pair}}}"), &mut wanted)?;
    }
    samples(text)
        .find(|s| s.name == name && wanted.iter().all(|(l, v)| s.label(l) == Some(v)))
        .map(|s| s.value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_pick_every_series_of_a_name_or_of_one_label_value() {
        let text = "# HELP x y\n# TYPE x counter\nx_total{op=\"a\"} 2\nx_total{op=\"b\"} 3.5\nx_total_more 9\nx_total 1\n";
        assert_eq!(metric_sum(text, "x_total"), 6.5);
        assert_eq!(metric_sum(text, "absent"), 0.0);
        let text = "# HELP x_sum h\nx_sum{op=\"read\"} 1.5\nx_sum{op=\"write\"} 2\nx_sum{op=\"read\",n=\"a\"} 1\nx_count{op=\"read\"} 3\nx_sum 9\n";
        assert_eq!(metric_sum_labelled(text, "x_sum", "op", "read"), 2.5);
        assert_eq!(metric_sum_labelled(text, "x_sum", "op", "write"), 2.0);
        assert_eq!(metric_sum_labelled(text, "x_sum", "op", "exists"), 0.0);
    }

    #[test]
    fn the_first_sample_with_every_label_is_found() {
        let text =
            "t{kind=\"repair\",outcome=\"ok\"} 3\nt{kind=\"demote\",outcome=\"ok\"} 1\nu 7\n";
        assert_eq!(metric_value(text, "t", &["kind=\"demote\""]), Some(1.0));
        assert_eq!(
            metric_value(text, "t", &["outcome=\"ok\"", "kind=\"demote\""]),
            Some(1.0)
        );
        assert_eq!(metric_value(text, "t", &[]), Some(3.0));
        assert_eq!(metric_value(text, "u", &[]), Some(7.0));
        assert_eq!(metric_value(text, "t", &["kind=\"gone\""]), None);
        // A fragment of a value is not a label match, nor is text that is no label pair.
        assert_eq!(metric_value(text, "t", &["kind=\"dem\""]), None);
        assert_eq!(metric_value(text, "t", &["demote"]), None);
    }

    #[test]
    fn timestamps_are_read_past_and_not_taken_for_the_value() {
        let text = "a 3 1700000000000\nb{x=\"y\"} 4.5 -12\nc 1 2 3\nd 1 nope\n";
        assert_eq!(metric_sum(text, "a"), 3.0);
        assert_eq!(metric_value(text, "b", &["x=\"y\""]), Some(4.5));
        assert_eq!(metric_value(text, "c", &[]), None);
        assert_eq!(metric_value(text, "d", &[]), None);
    }

    #[test]
    fn label_values_keep_commas_braces_spaces_and_escapes() {
        let line = r#"err_total{msg="a, b=c} d",path="C:\\x",q="say \"hi\"\n", op="read" ,} 2"#;
        let s = parse_sample(line).expect("a sample");
        assert_eq!(s.name, "err_total");
        assert_eq!(
            s.labels,
            [
                ("msg", "a, b=c} d"),
                ("path", "C:\\x"),
                ("q", "say \"hi\"\n"),
                ("op", "read")
            ]
            .map(|(n, v)| (n.to_owned(), v.to_owned()))
        );
        assert_eq!(s.value, 2.0);
        let text = format!("{line}\nerr_total{{op=\"write\"}} 5\n");
        assert_eq!(metric_sum_labelled(&text, "err_total", "op", "read"), 2.0);
        assert_eq!(metric_sum_labelled(&text, "err_total", "msg", "a"), 0.0);
        assert_eq!(
            metric_value(&text, "err_total", &[r#"q="say \"hi\"\n""#]),
            Some(2.0)
        );
    }

    #[test]
    fn special_values_and_malformed_lines() {
        let text = "a +Inf\nb -Inf\nc NaN\nd 1e3\n";
        assert_eq!(metric_value(text, "a", &[]), Some(f64::INFINITY));
        assert_eq!(metric_value(text, "b", &[]), Some(f64::NEG_INFINITY));
        assert!(metric_value(text, "c", &[]).is_some_and(f64::is_nan));
        assert_eq!(metric_value(text, "d", &[]), Some(1000.0));
        for bad in [
            "",
            "# TYPE a counter",
            "a",
            "a{x=\"1\" 2",
            "a{x=\"1} 2",
            "a{x=1} 2",
            "a{x=\"1\"y=\"2\"} 3",
            "a{=\"1\"} 2",
            "a b",
            "a inf",
            "{x=\"1\"} 2",
            "a-b 1",
        ] {
            assert_eq!(parse_sample(bad), None, "{bad:?}");
        }
        assert_eq!(samples("a 1\ngarbage\nb 2").count(), 2);
    }
}

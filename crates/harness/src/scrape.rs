//! Reading a Prometheus text exposition (a child's `/metrics`): sums of a metric's samples, with
//! or without a label filter, and the first sample matching some fragments. Pure.

/// `(name, labels, value)` of every sample line (comments skipped).
fn samples(text: &str) -> impl Iterator<Item = (&str, &str, &str)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (name, labels) = series.split_once('{').unwrap_or((series, ""));
            Some((name, labels, value))
        })
}

/// Sum of every sample of metric `name`.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    samples(text)
        .filter(|(n, _, _)| *n == name)
        .filter_map(|(_, _, v)| v.parse::<f64>().ok())
        .sum()
}

/// Sum of the samples of metric `name` whose labels include `label="value"`.
pub fn metric_sum_labelled(text: &str, name: &str, label: &str, value: &str) -> f64 {
    let wanted = format!("{label}=\"{value}\"");
    samples(text)
        .filter(|(n, labels, _)| {
            *n == name && labels.split(',').any(|p| p.trim_end_matches('}') == wanted)
        })
        .filter_map(|(_, _, v)| v.parse::<f64>().ok())
        .sum()
}

/// The value of the first sample of `name` whose line contains every one of `fragments`
/// (label pairs such as `kind="repair"`, or any text of the line).
pub fn metric_value(text: &str, name: &str, fragments: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split([' ', '{']).next().is_some_and(|n| n == name))
        .find(|l| fragments.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
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
    fn the_first_sample_with_every_fragment_is_found() {
        let text =
            "t{kind=\"repair\",outcome=\"ok\"} 3\nt{kind=\"demote\",outcome=\"ok\"} 1\nu 7\n";
        assert_eq!(metric_value(text, "t", &["kind=\"demote\""]), Some(1.0));
        assert_eq!(metric_value(text, "t", &[]), Some(3.0));
        assert_eq!(metric_value(text, "u", &[]), Some(7.0));
        assert_eq!(metric_value(text, "t", &["gone"]), None);
    }
}

//! What the reader engines' memory was mapped with: the driver reads `AnonHugePages` of each
//! reader engine's process tree (vLLM's API server, engine core and worker) from
//! `/proc/PID/smaps_rollup` after the TTFT rounds, so a report that says `--engine-thp`
//! also says whether the engines' KV caches got transparent huge pages.

/// The report's line on the reader engines' transparent huge pages, from each arm's name and
/// the MiB the driver read (none when it read none), with a warning when `--engine-thp` asked
/// for them and an engine shows none.
pub fn thp_line<'a>(
    arms: impl IntoIterator<Item = (&'a str, Option<f64>)>,
    asked: bool,
) -> Option<String> {
    let read: Vec<(&str, f64)> = arms
        .into_iter()
        .filter_map(|(arm, mib)| Some((arm, mib?)))
        .collect();
    if read.is_empty() {
        return None;
    }
    let list = read
        .iter()
        .map(|(arm, mib)| format!("{arm} {mib:.0} MiB"))
        .collect::<Vec<_>>()
        .join(", ");
    let without: Vec<&str> = read
        .iter()
        .filter(|(_, mib)| *mib < 1.0)
        .map(|(arm, _)| *arm)
        .collect();
    let mut line = format!("reader engines' transparent huge pages (AnonHugePages): {list}");
    if asked && !without.is_empty() {
        line.push_str(&format!(
            " (warning: --engine-thp asked for them; none in {})",
            without.join(", ")
        ));
    }
    Some(line)
}

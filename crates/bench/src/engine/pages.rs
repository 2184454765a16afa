//! What the reader engines' memory was mapped with: the driver reads `AnonHugePages` of each
//! reader engine's process tree (vLLM's API server, engine core and worker) from
//! `/proc/PID/smaps_rollup` after the TTFT rounds, so a report that says `--engine-thp`
//! also says whether the engines' KV caches got transparent huge pages.

use super::report::ArmRun;

/// The report's line on the reader engines' transparent huge pages (none when the driver read
/// none), with a warning when `--engine-thp` asked for them and an engine shows none.
pub fn thp_line(arms: &[ArmRun], asked: bool) -> Option<String> {
    let read: Vec<(&str, f64)> = arms
        .iter()
        .filter_map(|a| Some((a.arm.as_str(), a.reader_thp_mib?)))
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

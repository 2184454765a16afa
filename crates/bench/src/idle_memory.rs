//! `kvpool bench idle-memory`: what it costs this machine to touch memory again after it sat
//! idle. On bare metal a page written a second ago and one written a minute ago cost the same
//! to read; on a virtual machine whose host reclaims guest memory that has not been touched
//! for a while (memory overcommit: host-side swap or compression of idle guest pages), the
//! second costs a host fault per page. A pool's DRAM tier and an engine's KV cache are such
//! memory: blocks saved by one engine and loaded by another seconds later, KV cache blocks
//! free since start-up. This benchmark measures the effect, so that numbers from such a
//! machine (the store and engine benchmarks) can be read for what they are.
//!
//! For each idle time: a fresh region is written, read once hot, left alone for the idle
//! time, then its first half is read and its second half written, each in 1 MiB copies. The
//! report gives microseconds per MiB for each, and the ratio to the hot read.
//! I/O boundary: memory and the clock (the caller prints the report).

use std::hint::black_box;
use std::time::{Duration, Instant};

use clap::Args;
use serde::Serialize;

use crate::transfer::parse_size;

const MIB: usize = 1 << 20;

/// Flags of `kvpool bench idle-memory`.
#[derive(Clone, Debug, Args)]
pub struct IdleMemoryArgs {
    /// Size of each region (a whole number of MiB, at least 2 MiB).
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    pub size: u64,
    /// Idle times to measure (comma separated), e.g. `0s,1s,5s,20s`.
    #[arg(long, value_delimiter = ',', default_value = "0s,1s,5s,20s",
          value_parser = kvpool_core::flags::parse_duration)]
    pub idle: Vec<Duration>,
    /// Pages of the regions: `4KiB` (plain anonymous memory, as a process's heap), `thp`
    /// (anonymous memory with `MADV_HUGEPAGE`: transparent huge pages where the host's THP
    /// setting is `madvise` or `always`, as PyTorch's `THP_MEM_ALLOC_ENABLE` asks for) or
    /// `2MiB` (hugetlb pages, as an agent's `dram.hugepages`: that many must be reserved,
    /// /proc/sys/vm/nr_hugepages).
    #[arg(long, default_value = "4KiB", value_parser = ["4KiB", "thp", "2MiB"])]
    pub pages: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// One idle time's figures, in microseconds per MiB.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct IdleRow {
    pub idle_s: f64,
    /// The first write of the fresh region (page faults included).
    pub first_write_us_per_mib: f64,
    /// A read of the whole region right after it was written.
    pub hot_read_us_per_mib: f64,
    /// A read of the first half after the idle time.
    pub idle_read_us_per_mib: f64,
    /// A write of the second half after the idle time.
    pub idle_write_us_per_mib: f64,
    /// `idle_read / hot_read`: 1 on a machine that leaves idle memory alone.
    pub read_slowdown: f64,
}

/// The whole report.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct IdleReport {
    pub size_bytes: u64,
    /// `--pages`.
    pub pages: String,
    pub rows: Vec<IdleRow>,
}

/// What is wrong with the arguments.
#[derive(Debug, thiserror::Error)]
pub enum IdleMemoryError {
    #[error("invalid arguments: {0}")]
    Args(String),
    #[error(
        "cannot map {size} bytes of {pages} pages: {source} (2MiB pages must be reserved: \
         /proc/sys/vm/nr_hugepages)"
    )]
    Map {
        size: usize,
        pages: String,
        source: std::io::Error,
    },
}

impl IdleMemoryError {
    pub fn category(&self) -> &'static str {
        match self {
            IdleMemoryError::Args(_) => "args",
            IdleMemoryError::Map { .. } => "map",
        }
    }
}

/// A fresh region of `size` bytes with the pages `pages` names (see [`IdleMemoryArgs`]).
fn region(size: usize, pages: &str) -> Result<memmap2::MmapMut, IdleMemoryError> {
    let mut opts = memmap2::MmapOptions::new();
    opts.len(size);
    if pages == "2MiB" {
        opts.huge(Some(21));
    }
    let map = opts
        .map_anon()
        .and_then(|m| {
            if pages == "thp" {
                m.advise(memmap2::Advice::HugePage)?;
            }
            Ok(m)
        })
        .map_err(|source| IdleMemoryError::Map {
            size,
            pages: pages.to_owned(),
            source,
        })?;
    Ok(map)
}

/// Microseconds per MiB of `f` run over `bytes` bytes.
fn per_mib(bytes: usize, f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e6 / (bytes.max(1) as f64 / MIB as f64)
}

/// Copy every MiB of `from` into `scratch` (a read of `from`).
fn read_all(from: &[u8], scratch: &mut [u8]) {
    for chunk in from.chunks(MIB) {
        scratch[..chunk.len()].copy_from_slice(chunk);
        black_box(&mut *scratch);
    }
}

/// Copy `scratch` over every MiB of `to` (a write of `to`).
fn write_all(to: &mut [u8], scratch: &[u8]) {
    for chunk in to.chunks_mut(MIB) {
        let n = chunk.len();
        chunk.copy_from_slice(&scratch[..n]);
        black_box(&mut *chunk);
    }
}

/// One idle time: a fresh region, written, read hot, left alone, then read and written.
fn measure(size: usize, idle: Duration, pages: &str) -> Result<IdleRow, IdleMemoryError> {
    let half = size / 2;
    let mut scratch: Vec<u8> = (0..MIB).map(|i| (i * 31 + 7) as u8).collect();
    // A fresh mapping: pages that the first write faults in.
    let mut region = region(size, pages)?;
    let first_write = per_mib(size, || write_all(&mut region, &scratch));
    let hot_read = per_mib(size, || read_all(&region, &mut scratch));
    std::thread::sleep(idle);
    let idle_read = per_mib(half, || read_all(&region[..half], &mut scratch));
    let idle_write = per_mib(size - half, || write_all(&mut region[half..], &scratch));
    black_box(&region);
    Ok(IdleRow {
        idle_s: idle.as_secs_f64(),
        first_write_us_per_mib: first_write,
        hot_read_us_per_mib: hot_read,
        idle_read_us_per_mib: idle_read,
        idle_write_us_per_mib: idle_write,
        read_slowdown: idle_read / hot_read.max(1e-9),
    })
}

/// The probe the store and engine benchmarks put in their reports: one 64 MiB region of
/// plain 4 KiB pages left idle for one second (about 1.5 s in all); none where the region
/// cannot be mapped.
pub fn probe() -> Option<IdleRow> {
    measure(64 * MIB, Duration::from_secs(1), "4KiB").ok()
}

/// One line for a report's text about the probe, with a warning where idle memory is slow.
pub fn note(row: &IdleRow) -> String {
    let mut line = format!(
        "memory idle for {:.0} s: read {:.1}x a hot read ({:.0} against {:.0} us/MiB; kvpool \
         bench idle-memory)",
        row.idle_s, row.read_slowdown, row.idle_read_us_per_mib, row.hot_read_us_per_mib
    );
    if row.read_slowdown >= 2.0 {
        line.push_str(
            "\nwarning: this machine slows memory that sat idle (a virtual machine whose host \
             reclaims idle guest memory?): blocks saved a second before they are loaded, and \
             engine memory free since start-up, cost several times their hot cost here \
             (4 KiB pages; huge pages pay far less: `kvpool bench idle-memory --pages 2MiB`, \
             `--store-hugepages`)",
        );
    }
    line
}

/// Run every idle time of `args`.
pub fn run_report(args: &IdleMemoryArgs) -> Result<IdleReport, IdleMemoryError> {
    let size = usize::try_from(args.size)
        .map_err(|_| IdleMemoryError::Args(format!("--size {} is too large", args.size)))?;
    if size < 2 * MIB || size % MIB != 0 {
        return Err(IdleMemoryError::Args(format!(
            "--size {} must be a whole number of MiB, at least 2 MiB",
            args.size
        )));
    }
    if args.idle.is_empty() {
        return Err(IdleMemoryError::Args(
            "--idle must name at least one time".into(),
        ));
    }
    let rows = args
        .idle
        .iter()
        .map(|&d| measure(size, d, &args.pages))
        .collect::<Result<_, _>>()?;
    Ok(IdleReport {
        size_bytes: args.size,
        pages: args.pages.clone(),
        rows,
    })
}

/// The report as text.
pub fn render_text(r: &IdleReport) -> String {
    let mut out = format!(
        "memory touched again after sitting idle ({} MiB regions of {} pages, µs per MiB)\n\
         idle    first write   hot read   read after idle   write after idle   read slowdown\n",
        r.size_bytes >> 20,
        r.pages
    );
    for row in &r.rows {
        out.push_str(&format!(
            "{:>5.1}s {:>12.0} {:>10.0} {:>17.0} {:>18.0} {:>14.1}x\n",
            row.idle_s,
            row.first_write_us_per_mib,
            row.hot_read_us_per_mib,
            row.idle_read_us_per_mib,
            row.idle_write_us_per_mib,
            row.read_slowdown
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_that_are_not_whole_mebibytes_are_refused_by_name() {
        for size in [MIB as u64, 3 * MIB as u64 + 1] {
            let args = IdleMemoryArgs {
                size,
                idle: vec![Duration::ZERO],
                pages: "4KiB".into(),
                json: true,
            };
            let e = run_report(&args).unwrap_err();
            assert!(e.to_string().contains("--size"), "{e}");
        }
        let none = IdleMemoryArgs {
            size: 4 * MIB as u64,
            idle: vec![],
            pages: "4KiB".into(),
            json: true,
        };
        assert!(
            run_report(&none)
                .unwrap_err()
                .to_string()
                .contains("--idle")
        );
    }

    #[test]
    fn the_reports_note_warns_from_twice_the_hot_cost_and_names_huge_pages() {
        let row = |slowdown: f64| IdleRow {
            idle_s: 1.0,
            first_write_us_per_mib: 700.0,
            hot_read_us_per_mib: 200.0,
            idle_read_us_per_mib: 200.0 * slowdown,
            idle_write_us_per_mib: 300.0,
            read_slowdown: slowdown,
        };
        let calm = note(&row(1.2));
        assert!(calm.starts_with("memory idle for 1 s: read 1.2x"), "{calm}");
        assert!(!calm.contains("warning"), "{calm}");
        let slow = note(&row(4.7));
        assert!(slow.contains("warning:"), "{slow}");
        assert!(slow.contains("--store-hugepages"), "{slow}");
    }

    #[test]
    fn a_run_reports_one_row_per_idle_time_with_positive_figures() {
        let args = IdleMemoryArgs {
            size: 4 * MIB as u64,
            idle: vec![Duration::ZERO, Duration::from_millis(20)],
            pages: "thp".into(),
            json: false,
        };
        let r = run_report(&args).unwrap();
        assert_eq!(r.pages, "thp");
        assert_eq!(r.rows.len(), 2);
        assert_eq!(r.rows[1].idle_s, 0.02);
        for row in &r.rows {
            assert!(row.hot_read_us_per_mib > 0.0 && row.idle_write_us_per_mib > 0.0);
            assert!(
                (row.read_slowdown - row.idle_read_us_per_mib / row.hot_read_us_per_mib).abs()
                    < 1e-9
            );
        }
        let text = render_text(&r);
        assert_eq!(text.lines().count(), 4, "{text}");
        assert!(text.contains("read slowdown"), "{text}");
    }
}

//! What `kvpool bench stress` reports: the driver's JSON per store (parsed), the cells both
//! stores ran, kvpool's rates over Mooncake's, and the text table. Pure: no I/O but stdout in
//! [`print_text`].

use serde::{Deserialize, Serialize};

/// One role (writer or reader) of one cell, as the driver reports it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RoleFigures {
    /// Values moved without failure.
    pub values: u64,
    /// Batch calls made.
    pub calls: u64,
    pub failures: u64,
    /// Time inside the calls (fills and checks excluded).
    pub seconds: f64,
    pub values_per_second: f64,
    pub bytes_per_second: f64,
    /// Latency of one batch call.
    pub p50_us: u64,
    pub p99_us: u64,
    /// Values read whose bytes equalled what was put (0 for the writer).
    pub verified: u64,
    pub first_error: Option<String>,
}

/// One cell on one store.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CellFigures {
    /// Bytes per value.
    pub size: u64,
    /// Values per batch call.
    pub batch: u64,
    /// Registered ranges per value: 1 is `batch_put_from` / `batch_get_into`, more the
    /// `_multi_buffers` forms.
    pub parts: u64,
    pub values: u64,
    pub put: RoleFigures,
    pub get: RoleFigures,
    /// Process id of the master of the pool the cell ran on: every cell gets a pool started
    /// for it alone (set by the coordinator for kvpool, by the driver for Mooncake).
    #[serde(default)]
    pub master_pid: Option<u32>,
}

/// One store's run, as the driver prints it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StoreRun {
    pub store: String,
    pub version: String,
    pub cells: Vec<CellFigures>,
}

/// kvpool over Mooncake in one cell (values per second; above 1 is kvpool ahead).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct CellRatio {
    pub size: u64,
    pub batch: u64,
    pub parts: u64,
    pub put: f64,
    pub get: f64,
}

/// The report of `kvpool bench stress`.
#[derive(Clone, Debug, Serialize)]
pub struct StressReport {
    pub kvpool: StoreRun,
    pub mooncake: Option<StoreRun>,
    pub ratios: Vec<CellRatio>,
    /// Every value of every cell read back and compared, on every store measured.
    pub all_values_verified: bool,
    /// The smallest ratio of all cells (put and get), when Mooncake was measured.
    pub min_ratio: Option<f64>,
    /// This machine's cost of reading memory that sat idle (`crate::idle_memory::probe`),
    /// measured before the cells.
    pub idle_memory: Option<crate::idle_memory::IdleRow>,
    /// The page size of both stores' DRAM (`--store-hugepages`).
    pub store_hugepages: String,
}

/// Parse a driver's output: its last line that starts a JSON object.
pub fn parse_run(stdout: &str) -> Result<StoreRun, String> {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or("the stress driver printed no JSON")?;
    serde_json::from_str(line).map_err(|e| format!("the stress driver's JSON: {e}"))
}

fn same_cell(a: &CellFigures, b: &CellFigures) -> bool {
    (a.size, a.batch, a.parts) == (b.size, b.batch, b.parts)
}

/// kvpool's rates over Mooncake's, per cell both ran.
pub fn ratios(ours: &StoreRun, theirs: &StoreRun) -> Vec<CellRatio> {
    let over = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    ours.cells
        .iter()
        .filter_map(|c| {
            let m = theirs.cells.iter().find(|m| same_cell(c, m))?;
            Some(CellRatio {
                size: c.size,
                batch: c.batch,
                parts: c.parts,
                put: over(c.put.values_per_second, m.put.values_per_second),
                get: over(c.get.values_per_second, m.get.values_per_second),
            })
        })
        .collect()
}

fn verified(run: &StoreRun) -> bool {
    run.cells.iter().all(|c| {
        c.put.failures == 0 && c.get.failures == 0 && c.get.verified == c.values && c.values > 0
    })
}

/// The report of both runs.
pub fn report(kvpool: StoreRun, mooncake: Option<StoreRun>) -> StressReport {
    let ratios = mooncake
        .as_ref()
        .map(|m| ratios(&kvpool, m))
        .unwrap_or_default();
    let min_ratio = ratios
        .iter()
        .flat_map(|r| [r.put, r.get])
        .filter(|x| x.is_finite())
        .min_by(f64::total_cmp);
    StressReport {
        all_values_verified: verified(&kvpool) && mooncake.as_ref().is_none_or(verified),
        kvpool,
        mooncake,
        ratios,
        min_ratio,
        idle_memory: None,
        store_hugepages: "none".into(),
    }
}

fn form(parts: u64) -> String {
    if parts == 1 {
        "batch_put_from/batch_get_into".into()
    } else {
        format!("_multi_buffers ({parts} ranges)")
    }
}

fn human(bytes: u64) -> String {
    bytesize::ByteSize::b(bytes).display().iec().to_string()
}

/// The report as a table.
pub fn print_text(r: &StressReport) {
    println!(
        "{:<34} {:>9} {:>5} {:>4} {:>10} {:>10} {:>10} {:>10} {:>7}",
        "form", "size", "batch", "op", "kvpool/s", "p50 us", "mooncake/s", "p50 us", "ratio"
    );
    for c in &r.kvpool.cells {
        let m = r
            .mooncake
            .as_ref()
            .and_then(|m| m.cells.iter().find(|m| same_cell(c, m)));
        for (op, ours, theirs) in [
            ("put", &c.put, m.map(|m| &m.put)),
            ("get", &c.get, m.map(|m| &m.get)),
        ] {
            let (mv, mp, ratio) = match theirs {
                Some(t) => (
                    format!("{:.0}", t.values_per_second),
                    t.p50_us.to_string(),
                    format!("{:.2}x", ours.values_per_second / t.values_per_second),
                ),
                None => ("-".into(), "-".into(), "-".into()),
            };
            println!(
                "{:<34} {:>9} {:>5} {:>4} {:>10.0} {:>10} {:>10} {:>10} {:>7}",
                form(c.parts),
                human(c.size),
                c.batch,
                op,
                ours.values_per_second,
                ours.p50_us,
                mv,
                mp,
                ratio
            );
        }
    }
    println!("all values verified: {}", r.all_values_verified);
    if let Some(m) = r.min_ratio {
        println!("smallest ratio: {m:.2}x");
    }
    println!("stores' huge pages: {}", r.store_hugepages);
    if let Some(row) = &r.idle_memory {
        println!("{}", crate::idle_memory::note(row));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(size: u64, batch: u64, put: f64, get: f64) -> CellFigures {
        let role = |v: f64, verified: u64| RoleFigures {
            values: 4,
            values_per_second: v,
            verified,
            ..RoleFigures::default()
        };
        CellFigures {
            size,
            batch,
            parts: 1,
            values: 4,
            put: role(put, 0),
            get: role(get, 4),
            master_pid: None,
        }
    }

    #[test]
    fn ratios_pair_the_same_cells_and_name_the_smallest() {
        let ours = StoreRun {
            store: "kvpool".into(),
            version: "0.1.0".into(),
            cells: vec![cell(65536, 1, 300.0, 200.0), cell(65536, 16, 100.0, 100.0)],
        };
        let theirs = StoreRun {
            store: "mooncake".into(),
            version: "0.3.13.post1".into(),
            cells: vec![cell(65536, 16, 50.0, 80.0), cell(65536, 1, 100.0, 100.0)],
        };
        let r = report(ours, Some(theirs));
        assert_eq!(r.ratios.len(), 2);
        assert_eq!((r.ratios[0].put, r.ratios[0].get), (3.0, 2.0));
        assert_eq!((r.ratios[1].put, r.ratios[1].get), (2.0, 1.25));
        assert_eq!(r.min_ratio, Some(1.25));
        assert!(r.all_values_verified);
    }

    #[test]
    fn a_value_not_verified_fails_the_run() {
        let mut c = cell(1024, 1, 1.0, 1.0);
        c.get.verified = 3;
        let ours = StoreRun {
            store: "kvpool".into(),
            version: String::new(),
            cells: vec![c],
        };
        assert!(!report(ours, None).all_values_verified);
    }

    #[test]
    fn the_drivers_last_json_line_is_its_run() {
        let out = "log line\n{\"store\": \"mooncake\", \"version\": \"0.3.13.post1\", \"cells\": \
                   [{\"size\": 65536, \"batch\": 1, \"parts\": 2, \"values\": 8, \
                   \"put\": {\"values\": 8, \"calls\": 8, \"failures\": 0, \"seconds\": 0.1, \
                   \"values_per_second\": 80.0, \"bytes_per_second\": 1.0, \"p50_us\": 9, \
                   \"p99_us\": 20, \"verified\": 0, \"first_error\": null}, \
                   \"get\": {\"values\": 8, \"calls\": 8, \"failures\": 0, \"seconds\": 0.1, \
                   \"values_per_second\": 80.0, \"bytes_per_second\": 1.0, \"p50_us\": 9, \
                   \"p99_us\": 20, \"verified\": 8, \"first_error\": null}}]}\n";
        let run = parse_run(out).unwrap();
        assert_eq!(run.cells[0].parts, 2);
        assert_eq!(run.cells[0].get.verified, 8);
        assert!(parse_run("nothing").is_err());
    }
}

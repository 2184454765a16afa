//! `kvpool bench tier`: DRAM-tier put/get through the real engine API (gRPC over a Unix
//! socket, bytes through shared memory) for several block sizes, against single-thread memcpy
//! measured in the same run (a memcpy pass before every put/get pass, so both see the same
//! background load); and SSD-tier sequential write/read against `dd` with direct I/O on
//! the same filesystem. I/O boundary: a temporary socket directory, files under `--dir`, and
//! `dd` child processes.

use futures::future::BoxFuture;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use bytesize::ByteSize;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::api::client::{ClientError, EngineClient};
use crate::api::server::{self, ApiLimits, EngineService, ServerError};
use crate::dram::{DramError, DramTier};
use crate::metrics::{AgentMetrics, MetricsError};
use crate::placement::SegmentPlan;
use crate::proto::Status;
use crate::ssd::{AlignedBuf, DirectIo, SsdConfig, SsdError, SsdTier};
use crate::store::TieredStore;

/// Flags of `bench tier`.
#[derive(Debug, clap::Args)]
pub struct TierArgs {
    /// Print the result as JSON (otherwise a short text table).
    #[arg(long)]
    pub json: bool,
    /// Directory on the filesystem whose SSD tier speed is measured.
    #[arg(long, default_value = "/var/tmp")]
    pub dir: PathBuf,
    /// Bytes moved per block size in the DRAM benchmark.
    #[arg(long, default_value = "512MiB")]
    pub dram_total: ByteSize,
    /// Bytes written and read in the SSD benchmark.
    #[arg(long, default_value = "1GiB")]
    pub ssd_total: ByteSize,
    /// Bytes per engine API batch.
    #[arg(long, default_value = "16MiB")]
    pub batch: ByteSize,
    /// Passes per measurement; the best pass counts (for memcpy and dd alike).
    #[arg(long, default_value_t = 3)]
    pub repeat: u32,
}

/// Errors of the benchmark.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum BenchError {
    #[error("metrics")]
    Metrics(#[source] MetricsError),
    #[error("DRAM tier")]
    Dram(#[source] DramError),
    #[error("SSD tier")]
    Ssd(#[source] SsdError),
    #[error("engine API server")]
    Server(#[source] ServerError),
    #[error("engine API client")]
    Client(#[source] ClientError),
    #[error("temporary directory")]
    TempDir(#[source] std::io::Error),
    #[error("running dd")]
    Dd(#[source] std::io::Error),
    #[error("block {key} came back as {status:?}")]
    BadStatus { key: String, status: Status },
    #[error("block {0} came back with different bytes")]
    BadData(String),
    #[error("bad arguments: {0}")]
    Args(String),
    #[error("segment index")]
    Index(#[source] crate::ssd::pool::PoolIndexError),
}

kvpool_runtime::error_category!(BenchError);

/// One block size through the engine API.
#[derive(Debug, Serialize)]
pub struct DramResult {
    pub block_bytes: u64,
    pub blocks: u64,
    pub put_gib_s: f64,
    pub get_gib_s: f64,
    /// Best memcpy pass of the passes that took turns with this size's gets.
    pub memcpy_gib_s: f64,
    pub get_vs_memcpy: f64,
}

/// SSD tier against dd.
#[derive(Debug, Serialize)]
pub struct SsdResult {
    pub dir: String,
    pub direct_io: bool,
    pub block_bytes: u64,
    pub bytes: u64,
    pub write_gib_s: f64,
    pub read_gib_s: f64,
    pub dd_direct: bool,
    pub dd_write_gib_s: f64,
    pub dd_read_gib_s: f64,
    pub write_vs_dd: f64,
    pub read_vs_dd: f64,
}

/// The whole report.
#[derive(Debug, Serialize)]
pub struct TierReport {
    /// Where the staging files (and socket) were.
    pub staging_dir: String,
    pub memcpy_gib_s: f64,
    pub dram: Vec<DramResult>,
    pub ssd: SsdResult,
    /// get >= 50% of memcpy for every size; SSD write and read >= 70% of dd.
    pub get_target_met: bool,
    pub ssd_write_target_met: bool,
    pub ssd_read_target_met: bool,
}

const GIB: f64 = (1u64 << 30) as f64;
const BLOCK_SIZES: [u64; 3] = [64 << 10, 1 << 20, 4 << 20];
const SSD_BLOCK: u64 = 4 << 20;

fn gib_s(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / GIB / secs.max(1e-9)
}

/// Single-thread memcpy with the access pattern of a batched get: a source as large as the
/// blocks moved (cold, beyond the caches) copied piecewise into a destination the size of one
/// staging area, which is reused.
pub struct Memcpy {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl Memcpy {
    /// Allocate both buffers and fault their pages in.
    pub fn new(src_bytes: usize, dst_bytes: usize) -> Self {
        let mut m = Self {
            src: vec![0x5au8; src_bytes],
            dst: vec![0u8; dst_bytes.min(src_bytes).max(1)],
        };
        m.copy_all();
        m
    }

    fn copy_all(&mut self) -> u64 {
        let n = self.dst.len();
        for chunk in self.src.chunks_exact(n) {
            self.dst.copy_from_slice(std::hint::black_box(chunk));
            std::hint::black_box(&mut self.dst);
        }
        (self.src.len() / n * n) as u64
    }

    /// One timed pass, in GiB/s.
    pub fn pass(&mut self) -> f64 {
        let started = Instant::now();
        let moved = self.copy_all();
        gib_s(moved, started.elapsed().as_secs_f64())
    }
}

/// Best of `repeat` memcpy passes, in GiB/s.
pub fn memcpy_gib_s(src_bytes: usize, dst_bytes: usize, repeat: u32) -> f64 {
    let mut m = Memcpy::new(src_bytes, dst_bytes);
    (0..repeat.max(1)).map(|_| m.pass()).fold(0.0, f64::max)
}

/// Run the benchmark.
/// Boxed out of line so that the benchmark's futures (an engine-API server and its client)
/// are compiled here only, not again in `kvpool-bench`, which runs it.
#[inline(never)]
pub fn run_tier<'a>(args: &'a TierArgs) -> BoxFuture<'a, Result<TierReport, BenchError>> {
    Box::pin(async move {
        let dram_total = args.dram_total.as_u64();
        let batch = args.batch.as_u64();
        if dram_total < (4 << 20) || batch < (4 << 20) {
            return Err(BenchError::Args(
                "--dram-total and --batch must be at least 4MiB".to_owned(),
            ));
        }
        let repeat = args.repeat.max(1);
        let (src_bytes, dst_bytes) = (
            usize::try_from(dram_total).unwrap_or(usize::MAX),
            usize::try_from(batch).unwrap_or(usize::MAX),
        );
        // The memcpy baseline takes turns with the engine API (one pass before every put/get pass
        // of every size), so both see the same background load on a shared machine.
        let mut memcpy = Some(
            tokio::task::spawn_blocking(move || Memcpy::new(src_bytes, dst_bytes))
                .await
                .map_err(|e| BenchError::Args(e.to_string()))?,
        );
        let mut memcpy_pass = async || -> Result<f64, BenchError> {
            let mut m = memcpy
                .take()
                .ok_or_else(|| BenchError::Args("memcpy buffers lost".to_owned()))?;
            let (m, gib) = tokio::task::spawn_blocking(move || {
                let gib = m.pass();
                (m, gib)
            })
            .await
            .map_err(|e| BenchError::Args(e.to_string()))?;
            memcpy = Some(m);
            Ok(gib)
        };
        let mut memcpy_best: f64 = 0.0;

        // An in-process agent: DRAM tier, engine API on a Unix socket.
        // Staging files belong on tmpfs (as engine_api.shm_dir should be in production): a
        // disk-backed shared mapping would write every get back to the disk.
        let shm = Path::new("/dev/shm");
        let builder = {
            let mut b = tempfile::Builder::new();
            b.prefix("kvpool-bench");
            b
        };
        let sock_dir = if shm.is_dir() {
            builder.tempdir_in(shm)
        } else {
            builder.tempdir()
        }
        .map_err(BenchError::TempDir)?;
        let plans = [SegmentPlan {
            numa_node: Some(0),
            bytes: dram_total + (64 << 20),
            hugepage_size: None,
        }];
        let (dram, _) = DramTier::new(&plans, false).map_err(BenchError::Dram)?;
        let registry = prometheus::Registry::new();
        let metrics = Arc::new(AgentMetrics::new(&registry).map_err(BenchError::Metrics)?);
        let store = Arc::new(TieredStore::new(dram, None, Arc::clone(&metrics)));
        let service = EngineService::new(
            store,
            metrics,
            sock_dir.path().to_owned(),
            ApiLimits {
                max_sessions: 4,
                max_staging_bytes: batch,
            },
        );
        let (listener, socket) = server::bind(sock_dir.path()).map_err(BenchError::Server)?;
        let stop = CancellationToken::new();
        let server_task = tokio::spawn(server::serve(listener, service, stop.clone()));
        let mut client = EngineClient::connect(&socket, batch, "bench")
            .await
            .map_err(BenchError::Client)?;

        let mut dram_results = Vec::new();
        for &size in &BLOCK_SIZES {
            let blocks = dram_total / size;
            let per_batch = (batch / size).max(1);
            let pattern: Vec<u8> = (0..batch).map(|i| (i % 251) as u8).collect();
            client
                .staging()
                .write_from(0, &pattern)
                .map_err(|e| BenchError::Client(ClientError::Staging(e)))?;
            let keys: Vec<Vec<u8>> = (0..blocks)
                .map(|i| format!("bench-{size}-{i}").into_bytes())
                .collect();

            let mut put_secs = f64::MAX;
            let mut get_secs = f64::MAX;
            let mut size_memcpy: f64 = 0.0;
            for _ in 0..repeat {
                size_memcpy = size_memcpy.max(memcpy_pass().await?);
                // A put of an existing key replaces it: every pass moves all bytes again.
                let started = Instant::now();
                for chunk in keys.chunks(per_batch as usize) {
                    let items = batch_items(chunk, size);
                    let statuses = client
                        .put_batch(&items, None)
                        .await
                        .map_err(BenchError::Client)?;
                    check_statuses(chunk, statuses.iter().copied())?;
                }
                put_secs = put_secs.min(started.elapsed().as_secs_f64());

                let started = Instant::now();
                for chunk in keys.chunks(per_batch as usize) {
                    let items = batch_items(chunk, size);
                    let out = client.get_batch(&items).await.map_err(BenchError::Client)?;
                    check_statuses(chunk, out.iter().map(|o| o.status))?;
                }
                get_secs = get_secs.min(started.elapsed().as_secs_f64());
            }
            // Spot-check the bytes of the last batch.
            let mut probe = vec![0u8; 4096];
            client
                .staging()
                .read_into(size - 4096, &mut probe)
                .map_err(|e| BenchError::Client(ClientError::Staging(e)))?;
            let start = usize::try_from(size - 4096).unwrap_or(0);
            if pattern.get(start..start + 4096) != Some(&probe[..]) {
                return Err(BenchError::BadData(format!("bench-{size}")));
            }
            let key_refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
            for chunk in key_refs.chunks(1024) {
                client.remove(chunk).await.map_err(BenchError::Client)?;
            }
            let bytes = blocks * size;
            let get = gib_s(bytes, get_secs);
            memcpy_best = memcpy_best.max(size_memcpy);
            dram_results.push(DramResult {
                block_bytes: size,
                blocks,
                put_gib_s: gib_s(bytes, put_secs),
                get_gib_s: get,
                memcpy_gib_s: size_memcpy,
                get_vs_memcpy: get / size_memcpy.max(1e-9),
            });
        }
        let _ = client.close().await;
        let staging_dir = sock_dir
            .path()
            .parent()
            .unwrap_or(Path::new("/"))
            .to_owned();
        stop.cancel();
        let _ = server_task.await;

        let dir = args.dir.clone();
        let total = args.ssd_total.as_u64();
        let ssd = tokio::task::spawn_blocking(move || ssd_bench(&dir, total, repeat))
            .await
            .map_err(|e| BenchError::Args(e.to_string()))??;

        Ok(TierReport {
            staging_dir: staging_dir.display().to_string(),
            memcpy_gib_s: memcpy_best,
            get_target_met: dram_results.iter().all(|r| r.get_vs_memcpy >= 0.5),
            ssd_write_target_met: ssd.write_vs_dd >= 0.7,
            ssd_read_target_met: ssd.read_vs_dd >= 0.7,
            dram: dram_results,
            ssd,
        })
    })
}

/// The items of one engine API batch: block `j` of `keys` lies at `j * size` of the staging
/// area.
fn batch_items(keys: &[Vec<u8>], size: u64) -> Vec<(&[u8], u64, u64)> {
    keys.iter()
        .enumerate()
        .map(|(j, k)| (k.as_slice(), j as u64 * size, size))
        .collect()
}

fn check_statuses(
    keys: &[Vec<u8>],
    statuses: impl Iterator<Item = Status>,
) -> Result<(), BenchError> {
    for (k, s) in keys.iter().zip(statuses) {
        if s != Status::Ok {
            return Err(BenchError::BadStatus {
                key: String::from_utf8_lossy(k).into_owned(),
                status: s,
            });
        }
    }
    Ok(())
}

fn ssd_bench(dir: &Path, total: u64, repeat: u32) -> Result<SsdResult, BenchError> {
    let work = tempfile::Builder::new()
        .prefix("kvpool-bench-ssd")
        .tempdir_in(dir)
        .map_err(BenchError::TempDir)?;
    let blocks = (total / SSD_BLOCK).max(1);
    let bytes = blocks * SSD_BLOCK;
    let (mut tier, _) = SsdTier::open(&SsdConfig {
        dir: work.path().join("tier"),
        capacity: bytes + (16 << 20),
        direct_io: DirectIo::Auto,
    })
    .map_err(BenchError::Ssd)?;
    let mut buf = AlignedBuf::new(SSD_BLOCK as usize);
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i % 253) as u8;
    }
    let mut dst = AlignedBuf::new(SSD_BLOCK as usize);
    let dd_file = work.path().join("dd.bin");
    let of = format!("of={}", dd_file.display());
    let iff = format!("if={}", dd_file.display());
    let bs_arg = format!("bs={}K", SSD_BLOCK / 1024);
    let count_arg = format!("count={blocks}");
    let mut dd_direct = true;
    let mut write_secs = f64::MAX;
    let mut read_secs = f64::MAX;
    let mut dd_write: Option<f64> = None;
    let mut dd_read: Option<f64> = None;
    // Tier and dd take turns inside each pass, so both see the same background load.
    for _ in 0..repeat {
        // Rewriting a key frees its old extent first: every pass writes all bytes again.
        let started = Instant::now();
        for i in 0..blocks {
            tier.put(format!("ssd-{i}").as_bytes(), &buf, SSD_BLOCK)
                .map_err(BenchError::Ssd)?;
        }
        write_secs = write_secs.min(started.elapsed().as_secs_f64());

        // conv=notrunc: like the tier's later passes, dd's later passes overwrite blocks the
        // file already has instead of allocating them again.
        let mut w = if dd_direct {
            time_dd(&[
                "if=/dev/zero",
                &of,
                &bs_arg,
                &count_arg,
                "oflag=direct",
                "conv=notrunc",
            ])?
        } else {
            None
        };
        if w.is_none() {
            dd_direct = false;
            w = time_dd(&["if=/dev/zero", &of, &bs_arg, &count_arg, "conv=notrunc"])?;
        }
        dd_write = min_opt(dd_write, w);

        // Sequential reads with each block's checksum overlapping the next block's read; the
        // last block is copied out to check its bytes below.
        let names: Vec<String> = (0..blocks).map(|i| format!("ssd-{i}")).collect();
        let keys: Vec<&[u8]> = names.iter().map(|k| k.as_bytes()).collect();
        let mut bad: Option<String> = None;
        let started = Instant::now();
        tier.read_each(&keys, &mut |i, got| match got {
            Ok(Some(bytes)) if bytes.len() as u64 == SSD_BLOCK => {
                if i + 1 == keys.len() {
                    dst.copy_from_slice(bytes);
                }
            }
            _ => {
                bad.get_or_insert_with(|| format!("ssd-{i}"));
            }
        })
        .map_err(BenchError::Ssd)?;
        read_secs = read_secs.min(started.elapsed().as_secs_f64());
        if let Some(key) = bad {
            return Err(BenchError::BadData(key));
        }

        let r = if dd_direct {
            time_dd(&[&iff, "of=/dev/null", &bs_arg, "iflag=direct"])?
        } else {
            time_dd(&[&iff, "of=/dev/null", &bs_arg])?
        };
        dd_read = min_opt(dd_read, r);
    }
    if dst[..] != buf[..] {
        return Err(BenchError::BadData("ssd".to_owned()));
    }
    let direct_io = tier.direct_io();
    drop(tier);
    let dd_write_gib_s = dd_write.map_or(0.0, |s| gib_s(bytes, s));
    let dd_read_gib_s = dd_read.map_or(0.0, |s| gib_s(bytes, s));
    let write = gib_s(bytes, write_secs);
    let read = gib_s(bytes, read_secs);
    Ok(SsdResult {
        dir: dir.display().to_string(),
        direct_io,
        block_bytes: SSD_BLOCK,
        bytes,
        write_gib_s: write,
        read_gib_s: read,
        dd_direct,
        dd_write_gib_s,
        dd_read_gib_s,
        write_vs_dd: if dd_write_gib_s > 0.0 {
            write / dd_write_gib_s
        } else {
            0.0
        },
        read_vs_dd: if dd_read_gib_s > 0.0 {
            read / dd_read_gib_s
        } else {
            0.0
        },
    })
}

fn min_opt(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, y) => x.or(y),
    }
}

/// Seconds a dd run took; None when dd refused (e.g. no O_DIRECT on this filesystem).
fn time_dd(args: &[&str]) -> Result<Option<f64>, BenchError> {
    let started = Instant::now();
    let out = Command::new("dd")
        .args(args)
        .output()
        .map_err(BenchError::Dd)?;
    let secs = started.elapsed().as_secs_f64();
    Ok(out.status.success().then_some(secs))
}

/// Human-readable rendering.
pub fn render_text(r: &TierReport) -> String {
    let mut s = format!("memcpy (1 thread): {:.2} GiB/s\n", r.memcpy_gib_s);
    for d in &r.dram {
        s += &format!(
            "engine API {:>8}: put {:.2} GiB/s, get {:.2} GiB/s ({:.0}% of memcpy)\n",
            ByteSize(d.block_bytes).to_string(),
            d.put_gib_s,
            d.get_gib_s,
            d.get_vs_memcpy * 100.0
        );
    }
    let x = &r.ssd;
    s += &format!(
        "SSD tier in {} (direct I/O: {}): write {:.2} GiB/s ({:.0}% of dd), read {:.2} GiB/s ({:.0}% of dd)\n",
        x.dir,
        x.direct_io,
        x.write_gib_s,
        x.write_vs_dd * 100.0,
        x.read_gib_s,
        x.read_vs_dd * 100.0
    );
    s
}

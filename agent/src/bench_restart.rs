//! `kvpool bench dram-restart`: what the start of an agent with a persistent DRAM tier costs.
//! A tier file of `--tier` bytes in a temporary directory under `--dir` (tmpfs, as the tier is
//! kept) is filled with `--block`-sized blocks of pseudo-random bytes and indexed as the
//! master's feed would index them (a crc32c per block), then the index is opened again the way
//! a restarted agent opens it (`PoolSsdIndex::open_at`: replay, a crc32c pass over every
//! block's bytes, the snapshot rewrite), `--repeat` times; the best pass counts. I/O boundary:
//! the files of that temporary directory.

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Instant;

use bytesize::ByteSize;
use kvpool_core::master::ObjectKey;
use serde::Serialize;

use crate::bench::BenchError;
use crate::ssd::pool::PoolSsdIndex;

/// Flags of `bench dram-restart`.
#[derive(Debug, clap::Args)]
pub struct DramRestartArgs {
    /// Print the result as JSON (otherwise one line of text).
    #[arg(long)]
    pub json: bool,
    /// Directory (tmpfs, like a persistent tier's) for the temporary tier file.
    #[arg(long, default_value = "/dev/shm")]
    pub dir: PathBuf,
    /// Bytes of the tier, all of them in blocks.
    #[arg(long, default_value = "1GiB")]
    pub tier: ByteSize,
    /// Bytes per block.
    #[arg(long, default_value = "1MiB")]
    pub block: ByteSize,
    /// Restarts timed; the best counts.
    #[arg(long, default_value_t = 3)]
    pub repeat: u32,
}

/// The measurement.
#[derive(Debug, Serialize)]
pub struct DramRestartReport {
    pub dir: String,
    pub tier_bytes: u64,
    pub block_bytes: u64,
    pub blocks: u64,
    /// Blocks that passed the check on the timed opens (all of them, or the bench failed).
    pub verified: u64,
    /// Best time to open the index and verify every block.
    pub open_secs: f64,
    pub verify_gib_s: f64,
}

/// Fill, index, and time the restarts.
pub fn run(args: &DramRestartArgs) -> Result<DramRestartReport, BenchError> {
    let (tier, block) = (args.tier.as_u64(), args.block.as_u64());
    if block == 0 || block % 4096 != 0 || tier < block {
        return Err(BenchError::Args(format!(
            "--block must be a positive multiple of 4 KiB no larger than --tier, got {} and {}",
            args.block, args.tier
        )));
    }
    if args.repeat == 0 {
        return Err(BenchError::Args("--repeat must be at least 1".into()));
    }
    let dir = tempfile::Builder::new()
        .prefix("kvpool-bench-dram-")
        .tempdir_in(&args.dir)
        .map_err(BenchError::TempDir)?;
    let (index_path, data_path) = (dir.path().join("dram0.idx"), dir.path().join("dram0.dat"));
    let blocks = tier / block;
    {
        let (mut index, _) =
            PoolSsdIndex::open_at(&index_path, &data_path, tier).map_err(BenchError::Index)?;
        let data = std::fs::OpenOptions::new()
            .write(true)
            .open(&data_path)
            .map_err(BenchError::TempDir)?;
        data.set_len(tier).map_err(BenchError::TempDir)?;
        let mut buf =
            vec![0u8; usize::try_from(block).map_err(|e| BenchError::Args(e.to_string()))?];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..blocks {
            for chunk in buf.chunks_mut(8) {
                // xorshift64: bytes no compressor or zero page can shortcut.
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
            }
            let offset = i * block;
            data.write_all_at(&buf, offset)
                .map_err(BenchError::TempDir)?;
            let key = ObjectKey::from_bytes(&i.to_le_bytes());
            index
                .record(key, offset, block, crc32c::crc32c(&buf))
                .map_err(BenchError::Index)?;
        }
        index.sync().map_err(BenchError::Index)?;
    }
    let mut best = f64::INFINITY;
    let mut verified = 0;
    for _ in 0..args.repeat {
        let started = Instant::now();
        let (index, recovery) =
            PoolSsdIndex::open_at(&index_path, &data_path, tier).map_err(BenchError::Index)?;
        best = best.min(started.elapsed().as_secs_f64());
        verified = index.len() as u64;
        if verified != blocks || !recovery.dropped.is_empty() {
            return Err(BenchError::BadData(format!(
                "{} of {blocks} blocks passed the restart check",
                verified
            )));
        }
    }
    Ok(DramRestartReport {
        dir: args.dir.display().to_string(),
        tier_bytes: tier,
        block_bytes: block,
        blocks,
        verified,
        open_secs: best,
        verify_gib_s: (blocks * block) as f64 / (1u64 << 30) as f64 / best.max(1e-9),
    })
}

/// Human-readable rendering.
pub fn render_text(r: &DramRestartReport) -> String {
    format!(
        "restart of a {} persistent DRAM tier in {} ({} blocks of {}): {:.3} s to verify every block ({:.2} GiB/s)\n",
        ByteSize(r.tier_bytes),
        r.dir,
        r.blocks,
        ByteSize(r.block_bytes),
        r.open_secs,
        r.verify_gib_s
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_tier_restarts_with_every_block_verified() {
        let dir = tempfile::tempdir().expect("tempdir");
        let args = DramRestartArgs {
            json: true,
            dir: dir.path().to_owned(),
            tier: ByteSize::mib(4),
            block: ByteSize::kib(64),
            repeat: 2,
        };
        let r = run(&args).expect("bench");
        assert_eq!((r.blocks, r.verified), (64, 64));
        assert!(render_text(&r).contains("64 blocks"));
        let bad = DramRestartArgs {
            block: ByteSize::b(1000),
            ..args
        };
        assert_eq!(run(&bad).expect_err("unaligned").category(), "args");
    }
}

//! The node's SSD, in either mode: the local-only tier ([`tier`]: blocks demoted from DRAM in
//! `blocks.dat`, located by `index.log`) and the pool-mode segment's durable index ([`pool`]:
//! which master object lives where in `pool-ssd.dat`, in `pool-ssd.idx`). The two on-disk
//! formats stay apart (restarted agents read old files); the mechanism under both (header,
//! record framing with crc32c, replay to the first damaged record, atomic snapshots, range
//! checksums) is implemented once in [`log`], and the tier's aligned direct I/O in
//! [`aligned`]. I/O boundary: the files under the tier's directory, as each module says.

pub mod aligned;
pub mod log;
pub mod pool;
pub mod tier;

pub use aligned::{ALIGN, AlignedBuf};
pub use tier::{
    BlockRead, DirectIo, INDEX_VERSION, MAX_KEY_LEN, Recovery, SsdConfig, SsdError, SsdTier,
    SsdUsage,
};

//! The node agent's SSD indexes, as a restarted agent replays them. The first input byte
//! picks which and the data file's length; the rest is the index file:
//! - even: the local tier's `index.log` (`SsdTier::recover_index`, what `SsdTier::open` does
//!   before touching the data file) for a 16 MiB tier: an index that is not one is refused
//!   with an error; what is recovered fits the tier, and every recovered block is counted.
//! - odd: the pool segment's `pool-ssd.idx` records (`ssd::pool::replay`): live blocks never
//!   overlap, and replaying only the undamaged part gives the same blocks and no damage.
#![no_main]

use kvpool_agent::ssd::pool;
use kvpool_agent::ssd::{SsdError, SsdTier};
use libfuzzer_sys::fuzz_target;

const CAPACITY: u64 = 16 << 20;

fuzz_target!(|data: &[u8]| {
    let Some((&which, bytes)) = data.split_first() else {
        return;
    };
    if which & 1 == 0 {
        let data_len = [0, 4096, 1 << 20, CAPACITY, u64::MAX][usize::from(which / 2 % 5)];
        match SsdTier::recover_index(bytes, CAPACITY, data_len) {
            Ok((recovery, usage)) => {
                assert!(usage.used <= usage.capacity && usage.capacity <= CAPACITY);
                assert_eq!(recovery.blocks, usage.blocks);
                assert!(recovery.bytes <= usage.used, "{recovery:?} {usage:?}");
            }
            Err(e) => assert!(
                matches!(
                    e,
                    SsdError::BadMagic { .. } | SsdError::UnsupportedVersion { .. }
                ),
                "{e:?}"
            ),
        }
        return;
    }
    let replayed = pool::replay(bytes);
    let mut end = 0u64;
    for (offset, b) in &replayed.blocks {
        assert_eq!(*offset, b.offset);
        assert!(b.offset >= end, "overlapping blocks at {}", b.offset);
        end = b.offset.saturating_add(b.length.max(1));
    }
    if let Some(at) = replayed.damaged_at {
        assert!(at <= bytes.len());
        let clean = pool::replay(&bytes[..at]);
        assert_eq!(clean.damaged_at, None);
        assert_eq!(clean.blocks, replayed.blocks);
    }
});

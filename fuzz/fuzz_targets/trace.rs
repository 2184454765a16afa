//! Mooncake request traces (`kvpool simulate --trace`, `kvpool up --replay`): the first input
//! byte picks the block size, the rest is the trace text. A trace that parses is sorted by
//! arrival and every request carries exactly the blocks its prompt needs.
#![no_main]

use kvpool_core::sim::trace;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&b, text)) = data.split_first() else {
        return;
    };
    let block_size = [0u32, 1, 16, 512][usize::from(b % 4)];
    if let Ok(records) = trace::parse(text, block_size) {
        assert!(!records.is_empty());
        assert!(
            records
                .windows(2)
                .all(|w| w[0].timestamp_ms <= w[1].timestamp_ms)
        );
        for r in &records {
            let blocks = r.input_length.div_ceil(u64::from(block_size.max(1)));
            assert_eq!(r.hash_ids.len() as u64, blocks);
        }
    }
});

//! The master's records in etcd, as a new HA leader loads them (`ha::parse_records`) and
//! rebuilds its state from them (`MasterState::restore`). Each input record
//! (`kvpool_fuzz::Records`) is one key-value pair: the key after the pool's prefix up to the
//! first zero byte, then the value. Records that parse write back (`ha::journal_write`) as
//! records that parse to the same; restoring them never claims more space than the segments
//! have; records that do not fit are skipped and counted, never trusted.
#![no_main]

use std::sync::Arc;

use kvpool_core::master::{FakeClock, JournalOp, MasterConfig, MasterState};
use kvpool_fuzz::Records;
use kvpool_master::ha::{journal_write, parse_records};
use libfuzzer_sys::fuzz_target;

const PREFIX: &str = "/kvpool/fuzz";

fuzz_target!(|data: &[u8]| {
    let kvs: Vec<(String, Vec<u8>)> = Records(data)
        .map(|(tag, body)| {
            let split = body.iter().position(|&b| b == 0).unwrap_or(body.len());
            let suffix = String::from_utf8_lossy(&body[..split]);
            // Odd tags: a key of another pool, which the leader must ignore.
            let prefix = if tag & 1 == 0 {
                PREFIX
            } else {
                "/kvpool/other"
            };
            let value = body.get(split + 1..).unwrap_or_default().to_vec();
            (format!("{prefix}{suffix}"), value)
        })
        .collect();
    let Ok(p) = parse_records(PREFIX, kvs) else {
        return;
    };
    let mut ops: Vec<JournalOp> = Vec::new();
    ops.extend(
        p.segments
            .iter()
            .map(|(id, s)| JournalOp::PutSegment(*id, s.clone())),
    );
    ops.extend(p.objects.iter().map(|r| JournalOp::PutObject(r.clone())));
    ops.extend(
        p.reservations
            .iter()
            .map(|&(seg, offset, length)| JournalOp::Reserve {
                seg,
                offset,
                length,
            }),
    );
    ops.push(JournalOp::SegmentIdsUsed(p.segment_ids_used));
    let written = ops.iter().map(|op| {
        let (key, value) = journal_write(PREFIX, op);
        (key, value.expect("a put writes a value"))
    });
    let again = parse_records(PREFIX, written).expect("written records parse");
    assert_eq!(again.segments, p.segments);
    assert_eq!(again.objects, p.objects);
    assert_eq!(again.reservations, p.reservations);
    assert_eq!(again.segment_ids_used, p.segment_ids_used);

    let mut st = MasterState::new(MasterConfig::default(), Arc::new(FakeClock::new(1 << 40)));
    st.reserve_segment_ids(p.segment_ids_used);
    let records = p.objects.len() + p.reservations.len();
    let skipped = st.restore(p.segments, p.objects, p.reservations);
    assert!(skipped <= records, "{skipped} of {records} skipped");
    let stats = st.stats();
    for t in 0..2 {
        assert!(
            stats.used_bytes[t] <= stats.capacity_bytes[t],
            "tier {t}: {stats:?}"
        );
    }
});

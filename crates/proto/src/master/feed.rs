//! Conversions of the segment-event feed (agent, issue 4) between the core and the wire:
//! the events a heartbeat returns and the corrupt blocks it reports. Pure.

use tonic::Status;

use super as proto;
use kvpool_core::master::ObjectKey;
use kvpool_core::master::state::{CorruptBlock, SegmentEvent, SegmentEventKind};

/// The corrupt-block reports of a heartbeat; a malformed digest fails the call.
pub fn corrupt_blocks(items: &[proto::SegmentBlock]) -> Result<Vec<CorruptBlock>, Status> {
    items
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let key = ObjectKey::from_hex(&b.key_digest).ok_or_else(|| {
                Status::invalid_argument(format!(
                    "corrupt block {i}: key digest {:?} is not 32 hex digits",
                    b.key_digest
                ))
            })?;
            Ok(CorruptBlock {
                segment_id: b.segment_id,
                key,
                offset: b.offset,
            })
        })
        .collect()
}

pub fn kind_to_proto(k: SegmentEventKind) -> proto::SegmentEventKind {
    match k {
        SegmentEventKind::Commit => proto::SegmentEventKind::Commit,
        SegmentEventKind::Free => proto::SegmentEventKind::Free,
        SegmentEventKind::Reset => proto::SegmentEventKind::Reset,
        SegmentEventKind::ResetDone => proto::SegmentEventKind::ResetDone,
    }
}

pub fn event_to_proto(e: &SegmentEvent) -> proto::SegmentEvent {
    let boundary = matches!(
        e.kind,
        SegmentEventKind::Reset | SegmentEventKind::ResetDone
    );
    proto::SegmentEvent {
        seq: e.seq,
        kind: kind_to_proto(e.kind) as i32,
        segment_id: e.segment_id,
        key_digest: if boundary {
            String::new()
        } else {
            e.key.to_hex()
        },
        offset: e.offset,
        length: e.length,
    }
}

/// Decode an event from the wire; `None` when its kind or digest is not understood.
pub fn event_from_proto(e: &proto::SegmentEvent) -> Option<SegmentEvent> {
    let kind = match proto::SegmentEventKind::try_from(e.kind).ok()? {
        proto::SegmentEventKind::Commit => SegmentEventKind::Commit,
        proto::SegmentEventKind::Free => SegmentEventKind::Free,
        proto::SegmentEventKind::Reset => SegmentEventKind::Reset,
        proto::SegmentEventKind::ResetDone => SegmentEventKind::ResetDone,
    };
    let key = match kind {
        SegmentEventKind::Reset | SegmentEventKind::ResetDone => ObjectKey { hi: 0, lo: 0 },
        _ => ObjectKey::from_hex(&e.key_digest)?,
    };
    Some(SegmentEvent {
        seq: e.seq,
        kind,
        segment_id: e.segment_id,
        key,
        offset: e.offset,
        length: e.length,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_round_trip_and_bad_input_is_refused() {
        for kind in [
            SegmentEventKind::Commit,
            SegmentEventKind::Free,
            SegmentEventKind::Reset,
            SegmentEventKind::ResetDone,
        ] {
            let boundary = matches!(kind, SegmentEventKind::Reset | SegmentEventKind::ResetDone);
            let e = SegmentEvent {
                seq: 7,
                kind,
                segment_id: 3,
                key: if boundary {
                    ObjectKey { hi: 0, lo: 0 }
                } else {
                    ObjectKey::from_bytes(b"k")
                },
                offset: 8192,
                length: 100,
            };
            assert_eq!(event_from_proto(&event_to_proto(&e)), Some(e));
        }
        let mut bad = event_to_proto(&SegmentEvent {
            seq: 1,
            kind: SegmentEventKind::Free,
            segment_id: 1,
            key: ObjectKey::from_bytes(b"k"),
            offset: 0,
            length: 0,
        });
        bad.kind = 99;
        assert_eq!(event_from_proto(&bad), None);
        bad.kind = proto::SegmentEventKind::Commit as i32;
        bad.key_digest = "zz".into();
        assert_eq!(event_from_proto(&bad), None);
        let e = corrupt_blocks(&[proto::SegmentBlock {
            segment_id: 1,
            key_digest: "nothex".into(),
            offset: 0,
        }])
        .expect_err("bad digest");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
    }
}

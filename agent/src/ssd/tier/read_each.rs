//! Batch reads of the SSD tier for the engine API's gets: the blocks of many keys read in order
//! with the next block's read overlapping the current block's checksum (a reader thread and two
//! aligned buffers). I/O boundary: `blocks.dat`, read by the reader thread.

use super::{BlockRead, Entry, SsdError, SsdTier};
use crate::ssd::aligned::{ALIGN, AlignedBuf, padded, read_fully};

impl SsdTier {
    /// Read the blocks of `keys` in order, handing each verified block to `sink` with its
    /// index in `keys`: `Ok(Some(bytes))`, `Ok(None)` for a key the tier does not hold, or
    /// `Err(Corrupt)` for a corrupt or truncated block (dropped from the tier, never handed
    /// out). A reader thread reads block N+1 into one of two aligned buffers while this thread
    /// checks block N's crc32c and runs `sink`, so the checksum overlaps the next read.
    pub fn read_each(
        &mut self,
        keys: &[&[u8]],
        sink: &mut dyn FnMut(usize, BlockRead<'_>),
    ) -> Result<(), SsdError> {
        let entries: Vec<Option<Entry>> =
            keys.iter().map(|k| self.entries.get(*k).copied()).collect();
        let largest = entries
            .iter()
            .flatten()
            .map(|e| padded(e.len))
            .max()
            .unwrap_or(ALIGN);
        let size = usize::try_from(largest).map_err(|_| SsdError::Corrupt { reason: "length" })?;
        let data = &self.data;
        let mut bad: Vec<usize> = Vec::new();
        let mut failed: Option<SsdError> = None;
        std::thread::scope(|scope| {
            let (free_tx, free_rx) = std::sync::mpsc::sync_channel::<AlignedBuf>(2);
            let (full_tx, full_rx) =
                std::sync::mpsc::sync_channel::<(usize, AlignedBuf, std::io::Result<usize>)>(2);
            for _ in 0..2 {
                let _ = free_tx.send(AlignedBuf::new(size));
            }
            let entries_ref = &entries;
            scope.spawn(move || {
                for (i, entry) in entries_ref.iter().enumerate() {
                    let Some(e) = entry else { continue };
                    let Ok(mut buf) = free_rx.recv() else { return };
                    let want = usize::try_from(padded(e.len)).unwrap_or(usize::MAX);
                    let got = read_fully(data, buf.get_mut(..want).unwrap_or_default(), e.offset);
                    if full_tx.send((i, buf, got)).is_err() {
                        return;
                    }
                }
            });
            let mut next = 0;
            for (i, buf, got) in full_rx.iter() {
                // Keys the tier does not hold come in order, between the blocks read.
                for j in next..i {
                    sink(j, Ok(None));
                }
                next = i + 1;
                let Some(e) = entries.get(i).copied().flatten() else {
                    continue;
                };
                let len = usize::try_from(e.len).unwrap_or(usize::MAX);
                match got {
                    Ok(n) if n >= len => {
                        let bytes = buf.get(..len).unwrap_or_default();
                        if crc32c::crc32c(bytes) == e.crc {
                            sink(i, Ok(Some(bytes)));
                        } else {
                            bad.push(i);
                            sink(
                                i,
                                Err(SsdError::Corrupt {
                                    reason: "checksum mismatch",
                                }),
                            );
                        }
                    }
                    Ok(_) => {
                        bad.push(i);
                        sink(
                            i,
                            Err(SsdError::Corrupt {
                                reason: "truncated",
                            }),
                        );
                    }
                    Err(err) => {
                        failed = Some(SsdError::ReadData(err));
                        break;
                    }
                }
                // Fails only once the reader is done (it dropped its end): nothing to refill.
                let _ = free_tx.send(buf);
            }
            drop(free_tx);
            if failed.is_none() {
                for j in next..keys.len() {
                    sink(j, Ok(None));
                }
            }
        });
        for i in bad {
            if let Some(k) = keys.get(i) {
                self.remove(k)?;
            }
        }
        failed.map_or(Ok(()), Err)
    }
}

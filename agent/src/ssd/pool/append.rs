//! Appending to the pool SSD index when the filesystem may be full: a record is whole in the
//! log or absent from it. A failed append cuts the log back to its last whole record and keeps
//! the record, in order, in a backlog that the next append or sync writes first; the
//! `kvpool_agent_ssd_full` gauge is 1 while records wait. I/O boundary: the index file.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

use super::{PoolIndexError, PoolSsdIndex};

/// Most bytes of records kept waiting for room (about 1.4 million records); past it an
/// append fails.
const MAX_BACKLOG: usize = 64 << 20;

impl PoolSsdIndex {
    /// Set the gauge that says whether records wait for room (`kvpool_agent_ssd_full`).
    pub fn set_full_gauge(&mut self, gauge: prometheus::IntGauge) {
        gauge.set(i64::from(!self.backlog.is_empty()));
        self.full_gauge = Some(gauge);
    }

    /// Whether records wait for room on the filesystem ([`Self::append`]).
    pub fn is_full(&self) -> bool {
        !self.backlog.is_empty()
    }

    /// Append `rec` after any records still waiting. When the filesystem has no room (or the
    /// write fails otherwise) the log is cut back to its last whole record and the record
    /// waits in the backlog, in order, for the next append or [`Self::sync`]; only a backlog
    /// past [`MAX_BACKLOG`] fails the call.
    pub(super) fn append(&mut self, rec: &[u8]) -> Result<(), PoolIndexError> {
        if self.backlog.len() + rec.len() > MAX_BACKLOG {
            return Err(PoolIndexError::Write {
                path: self.index_path.clone(),
                source: std::io::Error::new(
                    std::io::ErrorKind::StorageFull,
                    format!(
                        "{} bytes of index records wait for room",
                        self.backlog.len()
                    ),
                ),
            });
        }
        self.backlog.extend_from_slice(rec);
        self.drain();
        Ok(())
    }

    /// Write the backlog to the log; on failure cut the log back to its last whole record and
    /// keep the backlog. Sets the full gauge either way.
    pub(super) fn drain(&mut self) {
        if self.backlog.is_empty() {
            return;
        }
        match self.index.write_all(&self.backlog) {
            Ok(()) => {
                self.whole_len += self.backlog.len() as u64;
                self.backlog.clear();
                self.dirty = true;
            }
            Err(e) => {
                // A torn record would end every later replay there: cut it off. Shrinking
                // needs no room.
                if let Err(cut) = self.index.set_len(self.whole_len) {
                    tracing::error!(path = %self.index_path.display(), error = %cut,
                        "cutting a torn record off the index failed; it is rewritten at the next start");
                }
                if self.full_gauge.as_ref().is_none_or(|g| g.get() == 0) {
                    tracing::warn!(path = %self.index_path.display(), error = %e,
                        waiting = self.backlog.len(),
                        "index records wait for room on the filesystem");
                }
            }
        }
        if let Some(g) = &self.full_gauge {
            g.set(i64::from(!self.backlog.is_empty()));
        }
    }

    /// The existing log at `index_path` opened for appending, cut at byte `whole` (the end of
    /// its last whole record) when it has a damaged tail.
    pub(super) fn keep_log(
        index_path: &Path,
        whole: Option<usize>,
    ) -> Result<File, PoolIndexError> {
        let file = OpenOptions::new()
            .append(true)
            .open(index_path)
            .map_err(|source| PoolIndexError::Open {
                path: index_path.to_owned(),
                source,
            })?;
        if let Some(at) = whole {
            file.set_len(at as u64)
                .map_err(|source| PoolIndexError::Write {
                    path: index_path.to_owned(),
                    source,
                })?;
        }
        Ok(file)
    }
}

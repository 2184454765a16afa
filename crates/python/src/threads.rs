//! Calls driven by the calling Python thread itself. A lone call in flight (the usual case of
//! an engine waiting for one block) runs on a current-thread runtime of the calling thread,
//! over a fork of the direct connection with its own master connection, and its transfers run
//! on that thread too: nothing wakes another thread of this process on the way. With other
//! calls in flight the call goes to the store's shared runtime instead, where concurrent calls
//! share batched master calls and pipelined transfer lanes. I/O boundary: none here; the
//! forks' connections do the I/O.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::ThreadId;

use parking_lot::Mutex;

use crate::errors::{Failure, Kind};

/// Threads that get a fork at most; calls from more threads use the shared runtime.
const MAX_FORKS: usize = 64;

/// A thread's own runtime and connection (`L`: the link module's connection).
pub struct Fork<L> {
    pub runtime: tokio::runtime::Runtime,
    pub link: L,
}

thread_local! {
    /// Dropped when its thread ends: a fork whose thread is gone is dropped too.
    static ALIVE: Arc<()> = Arc::new(());
}

/// A thread's fork, with a token that dies with the thread.
struct Entry<L> {
    fork: Arc<Fork<L>>,
    alive: Weak<()>,
}

/// The forks of a store, by thread, and the count of its calls in flight.
pub struct Forks<L> {
    by_thread: Mutex<HashMap<ThreadId, Entry<L>>>,
    in_flight: AtomicUsize,
}

impl<L> Default for Forks<L> {
    fn default() -> Self {
        Self {
            by_thread: Mutex::default(),
            in_flight: AtomicUsize::new(0),
        }
    }
}

/// A call counted in flight until dropped.
pub struct InFlight<'a, L> {
    forks: &'a Forks<L>,
    /// No other call of the store was in flight when this one started.
    pub alone: bool,
}

impl<L> Drop for InFlight<'_, L> {
    fn drop(&mut self) {
        self.forks.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl<L> Forks<L> {
    /// Count a call in flight.
    pub fn enter(&self) -> InFlight<'_, L> {
        let before = self.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight {
            forks: self,
            alone: before == 0,
        }
    }

    /// The calling thread's fork (made on first use by `fork`, which answers `None` when the
    /// connection cannot be forked), or `None` when too many threads have one. `fork` runs
    /// under the forks' lock, so that a fork made while the store closes is dropped by
    /// [`Forks::clear`].
    pub fn get(
        &self,
        fork: impl FnOnce() -> Result<Option<L>, Failure>,
    ) -> Result<Option<Arc<Fork<L>>>, Failure> {
        let id = std::thread::current().id();
        let mut map = self.by_thread.lock();
        if let Some(e) = map.get(&id) {
            return Ok(Some(e.fork.clone()));
        }
        if map.len() >= MAX_FORKS {
            // Threads come and go (thread pools): forget the forks of the ones gone.
            map.retain(|_, e| e.alive.strong_count() > 0);
            if map.len() >= MAX_FORKS {
                return Ok(None);
            }
        }
        let Some(link) = fork()? else {
            return Ok(None);
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| {
                Failure::new(
                    Kind::Internal,
                    format!("starting the thread's runtime: {e}"),
                )
            })?;
        let fork = Arc::new(Fork { runtime, link });
        let alive = ALIVE.with(Arc::downgrade);
        map.insert(
            id,
            Entry {
                fork: fork.clone(),
                alive,
            },
        );
        Ok(Some(fork))
    }

    /// Drop every fork (when the store closes); a call still running keeps its own until it
    /// returns.
    pub fn clear(&self) {
        let forks: Vec<Entry<L>> = self.by_thread.lock().drain().map(|(_, e)| e).collect();
        drop(forks);
    }
}

//! `PendingGet`: a batch get into registered memory that runs on the store's runtime while
//! the caller goes on, collected later with `wait()`. Python starts it holding the GIL and
//! need not give the GIL up for it to progress: nothing of it runs Python.

use std::future::Future;

use parking_lot::Mutex;
use pyo3::prelude::*;
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use crate::errors::Kind;

enum State {
    Running(Handle, JoinHandle<Vec<i64>>),
    Done(Vec<i64>),
}

/// A started batch get (`Client.start_batch_get_parts`): `wait()` answers what
/// `batch_get_parts` would have, per item the length read or Mooncake's negative code.
#[pyclass(module = "kvpool._native", frozen)]
pub struct PendingGet {
    state: Mutex<State>,
    items: usize,
}

impl PendingGet {
    /// Spawn `get` (of `items` items) on `runtime`'s workers.
    pub fn start(
        runtime: Handle,
        items: usize,
        get: impl Future<Output = Vec<i64>> + Send + 'static,
    ) -> Self {
        let task = runtime.spawn(get);
        Self {
            state: Mutex::new(State::Running(runtime, task)),
            items,
        }
    }
}

#[pymethods]
impl PendingGet {
    /// Whether the get has ended (`wait()` would not block).
    fn done(&self) -> bool {
        match &*self.state.lock() {
            State::Running(_, task) => task.is_finished(),
            State::Done(_) => true,
        }
    }

    /// Wait for the get, GIL released: per item the length read or a negative code. A get
    /// whose task ended without an answer (the store closed under it) answers the internal
    /// error's code for every item. Later calls answer the same again.
    fn wait(&self, py: Python<'_>) -> Vec<i64> {
        // The lock too is taken with the GIL released: a second waiter holding the GIL must
        // not stand between the first and its return.
        py.detach(|| {
            let mut state = self.state.lock();
            let codes = match std::mem::replace(&mut *state, State::Done(Vec::new())) {
                State::Done(codes) => codes,
                State::Running(runtime, task) => runtime.block_on(task).unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "a started batch get ended without an answer");
                    vec![Kind::Internal.code(); self.items]
                }),
            };
            *state = State::Done(codes.clone());
            codes
        })
    }

    fn __len__(&self) -> usize {
        self.items
    }
}

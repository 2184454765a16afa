//! Coalescing of concurrent single-item calls into batched ones: one queue per kind of call
//! (`get`, `put_start`, `put_end`, lease releases), at most one call in flight per queue, and
//! what arrives meanwhile goes together in the next call (no timer: a lone item leaves at
//! once). The kinds themselves ([`BatchOp`] implementations) live with their calls in `reads`
//! and `puts`. I/O boundary: none here; a queue's sender task makes its calls through
//! [`BatchOp::send`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::{Notify, oneshot};

use super::MasterClient;
use super::answers::Located;
use super::error::ClientError;
use kvpool_core::master::types::{PutOptions, PutStarted};
use kvpool_proto::master::MAX_BATCH;

type ReplyTx<O> = oneshot::Sender<Result<O, ClientError>>;
pub(super) type Reply<O> = oneshot::Receiver<Result<O, ClientError>>;
/// A queued item and where its result goes (nowhere for background releases).
pub(super) type Pending<I, O> = (I, Option<ReplyTx<O>>);
/// Picks the items of the next call out of a queue.
type Take<I, O> = fn(&mut Vec<Pending<I, O>>) -> Vec<Pending<I, O>>;

/// One queue of items waiting for a batched call; at most one call per queue is in flight,
/// and items that arrive meanwhile go together in the next one (no timer: a lone item leaves
/// at once).
#[derive(Debug)]
pub(super) struct Coalescer<I, O> {
    pub(super) state: Mutex<Queue<I, O>>,
    idle: Notify,
    calls: AtomicU64,
}

#[derive(Debug)]
pub(super) struct Queue<I, O> {
    pub(super) items: Vec<Pending<I, O>>,
    /// A sender task is running (it stops only when it finds `items` empty).
    pub(super) running: bool,
}

impl<I, O> Default for Coalescer<I, O> {
    fn default() -> Self {
        Self {
            state: Mutex::new(Queue {
                items: Vec::new(),
                running: false,
            }),
            idle: Notify::new(),
            calls: AtomicU64::new(0),
        }
    }
}

impl<I, O> Coalescer<I, O> {
    /// Queue an item; true when the caller must start the sender task.
    pub(super) fn push(&self, item: I, reply: Option<ReplyTx<O>>) -> bool {
        let mut q = self.state.lock();
        q.items.push((item, reply));
        !std::mem::replace(&mut q.running, true)
    }

    /// The next batch, or `None` (and the queue marked idle) when nothing waits.
    pub(super) fn next(&self, take: Take<I, O>) -> Option<Vec<Pending<I, O>>> {
        let mut q = self.state.lock();
        if q.items.is_empty() {
            q.running = false;
            drop(q);
            self.idle.notify_waiters();
            return None;
        }
        Some(take(&mut q.items))
    }

    /// Wait until no item waits and no call is in flight.
    pub(super) async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !self.state.lock().running {
                return;
            }
            notified.await;
        }
    }
}

/// The first `MAX_BATCH` items (the master refuses larger batches).
pub(super) fn take_front<T>(items: &mut Vec<T>) -> Vec<T> {
    if items.len() <= MAX_BATCH {
        std::mem::take(items)
    } else {
        let rest = items.split_off(MAX_BATCH);
        std::mem::replace(items, rest)
    }
}

/// The queues of a client (shared by its clones).
#[derive(Debug, Default)]
pub(super) struct Batchers {
    pub(super) get: Coalescer<Vec<u8>, Located>,
    pub(super) put_start: Coalescer<(Vec<u8>, u64, PutOptions), PutStarted>,
    pub(super) put_end: Coalescer<(Vec<u8>, u64), ()>,
    pub(super) release: Coalescer<u64, ()>,
    /// The fast lanes of the client's forks, whose deferred releases a flush sends too.
    pub(super) lanes: parking_lot::Mutex<Vec<std::sync::Weak<super::fast::FastLane>>>,
}

/// A kind of call that concurrent single-item calls share.
pub(super) trait BatchOp: Send + Sync + 'static {
    type Item: Send + 'static;
    type Out: Send + 'static;
    const METHOD: &'static str;
    fn queue(b: &Batchers) -> &Coalescer<Self::Item, Self::Out>;
    /// Send `items` as one call; one result per item, in order.
    fn send(
        client: &MasterClient,
        items: Vec<Self::Item>,
    ) -> impl Future<Output = Result<Vec<Result<Self::Out, ClientError>>, ClientError>> + Send;
    /// Which queued items go in the next call.
    fn take(
        items: &mut Vec<Pending<Self::Item, Self::Out>>,
    ) -> Vec<Pending<Self::Item, Self::Out>> {
        take_front(items)
    }
    /// A result whose caller went away.
    fn orphaned(_client: &MasterClient, _out: Self::Out) {}
}

/// Counts of batched calls, see [`MasterClient::batched_calls`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchedCalls {
    pub get: u64,
    pub put_start: u64,
    pub put_end: u64,
    pub release_leases: u64,
}

impl MasterClient {
    /// Queue `item` for the next batched call of kind `B` and wait for its own result.
    pub(super) async fn coalesced<B: BatchOp>(&self, item: B::Item) -> Result<B::Out, ClientError> {
        if let Some(root) = &self.parent {
            // A fork sends at once: there is no one to share the call with. The call is
            // counted with its root's, so that the root's `batched_calls` covers its forks.
            B::queue(&root.0.batch)
                .calls
                .fetch_add(1, Ordering::Relaxed);
            let mut results = B::send(self, vec![item]).await?;
            return results.pop().unwrap_or_else(|| {
                Err(ClientError::Malformed(format!(
                    "{} answered no item",
                    B::METHOD
                )))
            });
        }
        let Some(rx) = self.enqueue::<B>(item, true) else {
            return Err(ClientError::Malformed("no reply channel".into()));
        };
        rx.await.unwrap_or_else(|_| {
            Err(ClientError::Batch {
                method: B::METHOD,
                source: Arc::new(ClientError::Malformed("the batch task was dropped".into())),
            })
        })
    }

    /// Put `item` in the queue of `B`; start the queue's sender task unless one is running.
    pub(super) fn enqueue<B: BatchOp>(&self, item: B::Item, reply: bool) -> Option<Reply<B::Out>> {
        let (tx, rx) = if reply {
            let (tx, rx) = oneshot::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let q = B::queue(&self.batch);
        if q.push(item, tx) {
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    let this = self.clone();
                    rt.spawn(async move { this.drain::<B>().await });
                }
                // Outside a runtime (only `release_lease_later` can be called there): the item
                // waits for the next call made from one.
                Err(_) => q.state.lock().running = false,
            }
        }
        rx
    }

    /// The sender task of queue `B`: while items wait, send them as one call (at most
    /// `MAX_BATCH` items, `B::take` decides which) and hand each caller its result.
    async fn drain<B: BatchOp>(self) {
        let q = B::queue(&self.batch);
        while let Some(batch) = q.next(B::take) {
            let (items, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
            q.calls.fetch_add(1, Ordering::Relaxed);
            match B::send(&self, items).await {
                Ok(results) => {
                    for (r, tx) in results.into_iter().zip(replies) {
                        match tx {
                            Some(tx) => {
                                if let Err(Ok(out)) = tx.send(r) {
                                    B::orphaned(&self, out);
                                }
                            }
                            None => {
                                if let Err(e) = r {
                                    tracing::debug!(error = %e, method = B::METHOD,
                                        "background call refused an item");
                                }
                            }
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, method = B::METHOD, "batched master call failed");
                    // Every caller sees the call's own error where it can be copied (an RPC
                    // status, a refusal); a transport error is shared behind `Batch`.
                    let shared = Arc::new(e);
                    for tx in replies.into_iter().flatten() {
                        let _ = tx.send(Err(shared.try_clone().unwrap_or_else(|| {
                            ClientError::Batch {
                                method: B::METHOD,
                                source: shared.clone(),
                            }
                        })));
                    }
                }
            }
        }
    }

    /// Batched calls this client sent so far, by kind (`get`, `put_start`, `put_end`,
    /// `release_leases`): with concurrent callers, fewer than the operations they carried.
    pub fn batched_calls(&self) -> BatchedCalls {
        let n = |q: &AtomicU64| q.load(Ordering::Relaxed);
        BatchedCalls {
            get: n(&self.batch.get.calls),
            put_start: n(&self.batch.put_start.calls),
            put_end: n(&self.batch.put_end.calls),
            release_leases: n(&self.batch.release.calls),
        }
    }
}

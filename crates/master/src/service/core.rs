//! What the service and the master's background loops share: the [`MasterState`] behind a
//! mutex, the metrics, this master's [`Role`] (leader or standby, and where the leader is),
//! and the route of journal batches to persistence. Every state access goes through the
//! leader gate here. I/O boundary: the bounded channel to `ha` that persists journal batches.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use crate::metrics::MasterMetrics;
use kvpool_core::master::state::{JournalOp, MasterState};
use kvpool_proto::master::LEADER_HEADER;

/// Changes of one call on their way to etcd; `done` is answered once they are durable.
#[derive(Debug)]
pub struct PersistBatch {
    pub ops: Vec<JournalOp>,
    pub done: Option<oneshot::Sender<Result<(), String>>>,
}

/// Leadership as the service sees it.
#[derive(Debug, Default)]
pub struct Role {
    leader: AtomicBool,
    leader_addr: Mutex<Option<String>>,
    /// Wall-clock milliseconds at which this master last became the leader (0: leader from
    /// the start, no other master). Credentials made before it are refused.
    leader_since_ms: AtomicU64,
}

impl Role {
    pub fn is_leader(&self) -> bool {
        self.leader.load(Ordering::SeqCst)
    }
    pub fn set_leader(&self, leader: bool) {
        let was = self.leader.swap(leader, Ordering::SeqCst);
        if leader && !was {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            self.leader_since_ms.store(now, Ordering::SeqCst);
        }
    }
    /// When this master became the leader (see the field); 0 for a standalone master.
    pub fn leader_since_ms(&self) -> u64 {
        self.leader_since_ms.load(Ordering::SeqCst)
    }
    pub fn set_leader_addr(&self, addr: Option<String>) {
        *self.leader_addr.lock() = addr;
    }
    pub fn leader_addr(&self) -> Option<String> {
        self.leader_addr.lock().clone()
    }
}

/// Everything the service and the background loops share.
#[derive(Debug)]
pub struct Core {
    pub state: Mutex<MasterState>,
    pub metrics: MasterMetrics,
    pub role: Role,
    /// The conductor replicas' last load reports (`ShareLoad`): the leader's memory only.
    pub conductors: Mutex<crate::conductor_loads::ConductorLoads>,
    persist: Mutex<Option<mpsc::Sender<PersistBatch>>>,
}

impl Core {
    /// A core that is leader from the start (the embedded, single-master mode).
    pub fn standalone(state: MasterState, metrics: MasterMetrics) -> Arc<Self> {
        let core = Self::new(state, metrics);
        core.role.set_leader(true);
        // No other master can have seen this pool's calls.
        core.role.leader_since_ms.store(0, Ordering::SeqCst);
        core.metrics.set_leader(true);
        core
    }

    pub fn new(state: MasterState, metrics: MasterMetrics) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(state),
            metrics,
            role: Role::default(),
            conductors: Mutex::default(),
            persist: Mutex::new(None),
        })
    }

    /// Route journal batches to `tx` from now on (HA leader).
    pub fn set_persist(&self, tx: Option<mpsc::Sender<PersistBatch>>) {
        *self.persist.lock() = tx;
    }

    fn persist_tx(&self) -> Option<mpsc::Sender<PersistBatch>> {
        self.persist.lock().clone()
    }

    fn not_leader(&self) -> Status {
        let mut status = Status::unavailable("this master is not the leader");
        if let Some(addr) = self.role.leader_addr()
            && let Ok(v) = addr.parse()
        {
            status.metadata_mut().insert(LEADER_HEADER, v);
        }
        status
    }

    /// Apply `f` to the state; with persistence on, wait until its changes are durable.
    pub async fn mutate<T>(&self, f: impl FnOnce(&mut MasterState) -> T) -> Result<T, Status> {
        self.ensure_leader()?;
        let permit = match self.persist_tx() {
            Some(tx) => Some(
                tx.reserve_owned()
                    .await
                    .map_err(|_| Status::unavailable("persistence stopped"))?,
            ),
            None => None,
        };
        let (out, rx) = {
            let mut st = self.state.lock();
            self.ensure_leader()?;
            let out = f(&mut st);
            let rx = permit.map(|p| {
                let (tx, rx) = oneshot::channel();
                p.send(PersistBatch {
                    ops: st.take_journal(),
                    done: Some(tx),
                });
                rx
            });
            (out, rx)
        };
        if let Some(rx) = rx {
            rx.await
                .map_err(|_| Status::unavailable("persistence stopped"))?
                .map_err(|e| Status::unavailable(format!("persisting failed: {e}")))?;
        }
        Ok(out)
    }

    pub fn ensure_leader(&self) -> Result<(), Status> {
        if self.role.is_leader() {
            Ok(())
        } else {
            Err(self.not_leader())
        }
    }

    /// Apply `f` to the state without waiting for persistence: for changes the journal does
    /// not carry (read leases, recency). Leader-only, like every access.
    pub fn mutate_unjournaled<T>(
        &self,
        f: impl FnOnce(&mut MasterState) -> T,
    ) -> Result<T, Status> {
        self.ensure_leader()?;
        Ok(f(&mut self.state.lock()))
    }

    /// Read-only access (still leader-only: a standby's state is stale).
    pub fn read<T>(&self, f: impl FnOnce(&MasterState) -> T) -> Result<T, Status> {
        self.ensure_leader()?;
        Ok(f(&self.state.lock()))
    }

    /// One tick of the background loop: expiries, deaths, repairs, watermarks, metrics.
    pub async fn tick(&self) {
        if !self.role.is_leader() {
            return;
        }
        let permit = match self.persist_tx() {
            Some(tx) => match tx.reserve_owned().await {
                Ok(p) => Some(p),
                Err(_) => return,
            },
            None => None,
        };
        let mut st = self.state.lock();
        let report = st.tick();
        self.metrics
            .lease_holds(report.expired_lease_holds_ms.iter().copied(), true);
        if !report.dead_nodes.is_empty() {
            tracing::warn!(
                nodes = ?report.dead_nodes,
                objects_lost = report.objects_lost,
                "agents stopped heartbeating and were declared dead"
            );
        }
        if let Some(p) = permit {
            let ops = st.take_journal();
            p.send(PersistBatch { ops, done: None });
        }
        self.metrics.refresh(&st.stats(), st.counters());
        self.metrics.refresh_nodes(&st.node_usage());
        self.metrics.refresh_node_hits(&st.node_reports());
    }
}

//! The engine's directory of peers: one [`Peer`] (the TCP lanes to one address) per remote
//! address, created on first use and shared by every segment opened there, closed together.
//! In-memory table; the lanes own the sockets.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::tcp::{LaneConfig, Peer};

/// Initiator connections of an engine, by peer address.
pub(super) struct Peers {
    /// Lanes per peer.
    lanes: usize,
    cfg: LaneConfig,
    table: Mutex<HashMap<SocketAddr, Arc<Peer>>>,
}

impl Peers {
    pub(super) fn new(lanes: usize, cfg: LaneConfig) -> Self {
        Peers {
            lanes,
            cfg,
            table: Mutex::new(HashMap::new()),
        }
    }

    /// The peer at `addr`, created (not yet connected) on first use.
    pub(super) fn get(&self, addr: SocketAddr) -> Arc<Peer> {
        self.table
            .lock()
            .entry(addr)
            .or_insert_with(|| Arc::new(Peer::new(addr, self.lanes, self.cfg.clone())))
            .clone()
    }

    /// Forget every peer and close its lanes (they reopen on next use).
    pub(super) fn close_all(&self) {
        let peers: Vec<_> = self.table.lock().drain().map(|(_, p)| p).collect();
        for p in peers {
            p.close();
        }
    }
}

//! Memory this process gives the pool (Mooncake's `global_segment_size`): one DRAM segment,
//! registered with the transfer engine and served on its TCP target, mounted with the master
//! under this process's node name and kept alive by heartbeats. The master allocates in it
//! like in an agent's tier; the process must stay up while it holds objects, as Mooncake's
//! holder processes do. Holders do not run the master's copy tasks (repairs, demotions): they
//! answer them as failed, so the master picks another node. I/O boundary: the master's gRPC
//! channel (mount, heartbeats, unmount).

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use kvpool_client::master::{ClientError, MasterClient};
use kvpool_client::pool::{LocalSegments, transfer_name};
use kvpool_core::master::{SegmentSpec, Tier};
use kvpool_proto::master::ErrorCode;
use kvpool_transfer::{HostOptions, LocalSegment, Segment, TransferEngine};

use crate::errors::{Failure, Kind};

/// Master-side name of the segment a process contributes.
pub const SEGMENT: &str = "dram0";

/// How often a holder heartbeats.
const HEARTBEAT: Duration = Duration::from_secs(1);

/// A contributed segment, mounted until [`Holder::stop`].
pub struct Holder {
    master: MasterClient,
    node: String,
    segment_id: Arc<Mutex<u32>>,
    stop: watch::Sender<bool>,
    beat: JoinHandle<()>,
    /// Keeps the engine registration (and so the memory) alive.
    _local: LocalSegment,
}

impl Holder {
    /// Allocate `bytes` of host memory, register it as this node's segment, add it to `local`
    /// (so this process's own puts and gets copy instead of looping back over TCP) and mount
    /// it with the master, reachable at `endpoint`.
    pub async fn start(
        engine: &TransferEngine,
        master: MasterClient,
        node: &str,
        endpoint: &str,
        bytes: u64,
        local: &LocalSegments,
    ) -> Result<Self, Failure> {
        let size = usize::try_from(bytes)
            .map_err(|_| Failure::invalid(format!("global_segment_size {bytes} is too large")))?;
        let memory = Segment::host(size, HostOptions::default()).map_err(|e| {
            Failure::new(
                Kind::NoSpace,
                format!("allocating a {bytes}-byte global segment: {e}"),
            )
        })?;
        let name = transfer_name(node, SEGMENT);
        let registered = engine
            .register(&name, Arc::new(memory))
            .map_err(|e| Failure::new(Kind::Internal, format!("registering {name}: {e}")))?;
        local.insert(&name, Arc::clone(registered.segment()));
        let spec = SegmentSpec {
            node: node.to_owned(),
            name: SEGMENT.to_owned(),
            tier: Tier::Dram,
            capacity_bytes: bytes,
            numa_node: 0,
            failure_domain: String::new(),
            endpoints: vec![endpoint.to_owned()],
            persistent: false,
        };
        let id = master.mount_segment(&spec).await.map_err(Failure::from)?;
        let segment_id = Arc::new(Mutex::new(id));
        let (stop, stopped) = watch::channel(false);
        let beat = tokio::spawn(heartbeats(
            master.clone(),
            spec,
            Arc::clone(&segment_id),
            stopped,
        ));
        tracing::info!(node, bytes, segment_id = id, "global segment mounted");
        Ok(Self {
            master,
            node: node.to_owned(),
            segment_id,
            stop,
            beat,
            _local: registered,
        })
    }

    /// Stop heartbeating and unmount the segment: the master drops the objects it held.
    pub async fn stop(self) -> Result<(), Failure> {
        let _ = self.stop.send(true);
        let _ = self.beat.await;
        let id = *self.segment_id.lock();
        self.master
            .unmount_segment(&self.node, id)
            .await
            .map_err(Failure::from)
    }
}

/// Whether the master no longer knows this node or its segment (it restarted, or declared
/// the node dead): the segment must be mounted again.
fn forgotten(e: &ClientError) -> bool {
    match e {
        // The master answers a heartbeat of a node it does not know with NOT_FOUND.
        ClientError::Rpc { source, .. } => source.code() == tonic::Code::NotFound,
        _ => matches!(
            e.code(),
            Some(ErrorCode::UnknownNode | ErrorCode::UnknownSegment)
        ),
    }
}

async fn heartbeats(
    master: MasterClient,
    spec: SegmentSpec,
    segment_id: Arc<Mutex<u32>>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(HEARTBEAT);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopped.changed() => return,
        }
        match master.heartbeat(&spec.node).await {
            Ok(tasks) => {
                for t in tasks {
                    if let Err(e) = master.complete_task(&spec.node, t.id, false).await {
                        tracing::warn!(task = t.id, error = %e, "declining a copy task failed");
                    }
                }
            }
            Err(e) if forgotten(&e) => match master.mount_segment(&spec).await {
                Ok(id) => {
                    *segment_id.lock() = id;
                    tracing::info!(node = %spec.node, segment_id = id, "global segment mounted again");
                }
                Err(e) => tracing::warn!(error = %e, "mounting the global segment again failed"),
            },
            Err(e) => tracing::warn!(error = %e, "heartbeat to the master failed"),
        }
    }
}

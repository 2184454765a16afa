//! The segments this agent gives the pool: [`PoolRegistrar`] registers them with the transfer
//! engine (peers read and write them), lists them for in-process copies (`LocalSegments`) and
//! describes them for the master ([`spec_for`], with the node's failure domain), and keeps
//! which of them the master has mounted; it also holds the durable indexes of the persistent
//! segments (the SSD segment, and DRAM segments kept in a tmpfs or hugetlbfs file) and the SSD
//! segment's read guard once the runtime set them. The master-side names of the segments are here too. I/O boundary: the transfer
//! engine's registrations; the bookkeeping is pure.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use kvpool_client::pool::{LocalSegments, transfer_name};
use kvpool_core::master::{SegmentSpec, Tier};
use kvpool_transfer::{LocalSegment, Segment, TransferEngine};
use parking_lot::Mutex;

use super::feed::SsdGuard;
use crate::registrar::RegistrarError;
use crate::ssd::pool::{PoolSsdIndex, SharedIndex};

/// Master-side name of DRAM-tier segment `index`.
pub fn segment_name(index: u32) -> String {
    format!("dram{index}")
}

/// Master-side name of the pool-mode SSD segment.
pub const SSD_SEGMENT: &str = "ssd0";

/// The spec the master gets for segment `name` of `node`.
pub fn spec_for(
    node: &str,
    endpoint: &str,
    name: &str,
    tier: Tier,
    numa_node: u32,
    bytes: u64,
) -> SegmentSpec {
    SegmentSpec {
        node: node.to_owned(),
        name: name.to_owned(),
        tier,
        capacity_bytes: bytes,
        numa_node,
        failure_domain: String::new(),
        endpoints: vec![endpoint.to_owned()],
        persistent: false,
    }
}

#[derive(Debug)]
struct Entry {
    /// Keeps the engine registration alive; dropping it unregisters the segment.
    local: LocalSegment,
    spec: SegmentSpec,
}

#[derive(Debug, Default)]
struct Book {
    /// Registered with the transfer engine, by master-side segment name.
    segments: BTreeMap<String, Entry>,
    /// Master segment ids of mounted segments, by segment name. Kept apart from `segments` so
    /// that a segment deregistered during shutdown is still unmounted.
    mounted: BTreeMap<String, u32>,
}

/// The segments this agent gives the pool: registered with the transfer engine (peers read and
/// write them), listed in [`LocalSegments`] (this process copies into them without a
/// transport), and described for the master.
#[derive(Debug)]
pub struct PoolRegistrar {
    engine: TransferEngine,
    node: String,
    endpoint: String,
    /// `shm://socket`: announced beside `endpoint` for DRAM segments with a shareable file.
    shm_endpoint: Option<String>,
    book: Mutex<Book>,
    local: LocalSegments,
    /// Durable indexes of the persistent segments (`ssd0`, and DRAM segments kept in a file),
    /// by segment name.
    indexes: Mutex<BTreeMap<String, SharedIndex>>,
    /// Read checks of the SSD segment, when it has an index.
    ssd_guard: OnceLock<Arc<SsdGuard>>,
    /// Failure domain announced with every segment (empty: none).
    failure_domain: Mutex<String>,
}

impl PoolRegistrar {
    /// `endpoint` is the transfer target peers reach this node's segments at.
    pub fn new(engine: TransferEngine, node: String, endpoint: String) -> Self {
        Self {
            engine,
            node,
            endpoint,
            shm_endpoint: None,
            book: Mutex::default(),
            local: LocalSegments::default(),
            indexes: Mutex::default(),
            ssd_guard: OnceLock::new(),
            failure_domain: Mutex::default(),
        }
    }

    /// Announce `endpoint` (`shm://socket`, the agent's shared-memory target) with every DRAM
    /// segment whose memory has a shareable file, so that engines on this node map it.
    pub fn with_shm_endpoint(mut self, endpoint: Option<String>) -> Self {
        self.shm_endpoint = endpoint;
        self
    }

    /// Announce `domain` (the node's value of the pool's spread label) with every segment
    /// mounted from now on.
    pub fn set_failure_domain(&self, domain: String) {
        *self.failure_domain.lock() = domain;
    }

    /// The failure domain segments are announced with.
    pub fn failure_domain(&self) -> String {
        self.failure_domain.lock().clone()
    }

    /// Check every read of the SSD segment with `guard`: reads by peers through the transfer
    /// engine (its read check) and this agent's own tasks. Call after registering the segment.
    pub fn set_ssd_guard(&self, guard: SsdGuard) -> Result<(), RegistrarError> {
        let guard = Arc::new(guard);
        let local = self
            .local(SSD_SEGMENT)
            .ok_or_else(|| RegistrarError::Unknown(SSD_SEGMENT.to_owned()))?;
        let check = Arc::clone(&guard);
        self.engine.set_read_check(
            &local,
            Arc::new(move |offset, len| check.check_read(offset, len)),
        );
        let _ = self.ssd_guard.set(guard);
        Ok(())
    }

    /// The SSD segment's read checks, if it has them.
    pub fn ssd_guard(&self) -> Option<Arc<SsdGuard>> {
        self.ssd_guard.get().cloned()
    }

    /// Master id of the mounted segment `name`.
    pub fn mounted_id(&self, name: &str) -> Option<u32> {
        self.book.lock().mounted.get(name).copied()
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    /// Give the SSD segment its durable index (once, before the link runs).
    pub fn set_ssd_index(&self, index: PoolSsdIndex) {
        self.set_index(SSD_SEGMENT, index);
    }

    /// The SSD segment's durable index, if the agent has one.
    pub fn ssd_index(&self) -> Option<SharedIndex> {
        self.index(SSD_SEGMENT)
    }

    /// Give segment `name` a durable index (before it is registered, and before the link
    /// runs): the segment is announced as persistent, gets the master's segment-event feed,
    /// and its indexed blocks are announced for adoption after each mount.
    pub fn set_index(&self, name: &str, index: PoolSsdIndex) {
        self.indexes
            .lock()
            .insert(name.to_owned(), Arc::new(Mutex::new(index)));
    }

    /// The durable index of segment `name`, if it has one.
    pub fn index(&self, name: &str) -> Option<SharedIndex> {
        self.indexes.lock().get(name).cloned()
    }

    /// Every durable index, by segment name.
    pub fn indexes(&self) -> Vec<(String, SharedIndex)> {
        self.indexes
            .lock()
            .iter()
            .map(|(n, i)| (n.clone(), Arc::clone(i)))
            .collect()
    }

    /// The in-process view of the registered segments (for [`PoolClient`]).
    pub fn local_segments(&self) -> LocalSegments {
        self.local.clone()
    }

    /// Register `memory` as master segment `name` of `tier` on `numa_node`. The master will
    /// allocate inside all of it, so nothing else may use these bytes.
    pub fn register(
        &self,
        name: &str,
        tier: Tier,
        numa_node: u32,
        memory: Segment,
    ) -> Result<(), RegistrarError> {
        let mut book = self.book.lock();
        if book.segments.contains_key(name) {
            return Err(RegistrarError::Duplicate(name.to_owned()));
        }
        let bytes = memory.len() as u64;
        let full = transfer_name(&self.node, name);
        // Same-node engines may map DRAM segments; the SSD segment is read only through the
        // transfer engine, whose read check verifies each block.
        let shared = tier == Tier::Dram && memory.shared_fd().is_some();
        let mut endpoints = vec![self.endpoint.clone()];
        endpoints.extend(self.shm_endpoint.clone().filter(|_| shared));
        let local = self
            .engine
            .register(&full, Arc::new(memory))
            .map_err(|source| RegistrarError::Transfer {
                name: name.to_owned(),
                source,
            })?;
        // The SSD segment is read only through the transfer engine, whose read check verifies
        // each block; in-process readers would bypass it.
        if tier != Tier::Ssd {
            self.local.insert(&full, Arc::clone(local.segment()));
        }
        let persistent = self.indexes.lock().contains_key(name);
        tracing::info!(segment = %full, bytes, tier = tier.as_str(), persistent,
            same_node_shm = endpoints.len() > 1, "pool segment registered");
        let spec = SegmentSpec {
            persistent,
            endpoints,
            ..spec_for(&self.node, &self.endpoint, name, tier, numa_node, bytes)
        };
        book.segments.insert(name.to_owned(), Entry { local, spec });
        Ok(())
    }

    /// Withdraw segment `name` from the transfer engine and the in-process view. The memory
    /// lives on until transfers still using it finish.
    pub fn deregister(&self, name: &str) -> Result<(), RegistrarError> {
        let removed = self.book.lock().segments.remove(name);
        match removed {
            Some(_) => {
                self.local.remove(&transfer_name(&self.node, name));
                Ok(())
            }
            None => Err(RegistrarError::Unknown(name.to_owned())),
        }
    }

    /// Names of the registered segments.
    pub fn registered(&self) -> Vec<String> {
        self.book.lock().segments.keys().cloned().collect()
    }

    /// The registration of segment `name` (for tasks that copy into it).
    pub fn local(&self, name: &str) -> Option<LocalSegment> {
        self.book.lock().segments.get(name).map(|e| e.local.clone())
    }

    /// Registered segments not mounted with the master yet, with the node's failure domain.
    pub fn unmounted(&self) -> Vec<SegmentSpec> {
        let domain = self.failure_domain();
        let book = self.book.lock();
        book.segments
            .iter()
            .filter(|(n, _)| !book.mounted.contains_key(*n))
            .map(|(_, e)| SegmentSpec {
                failure_domain: domain.clone(),
                ..e.spec.clone()
            })
            .collect()
    }

    /// Record that segment `name` is mounted as master segment `id`.
    pub fn set_mounted(&self, name: &str, id: u32) {
        self.book.lock().mounted.insert(name.to_owned(), id);
    }

    /// Master segment ids currently mounted.
    pub fn mounted(&self) -> Vec<u32> {
        self.book.lock().mounted.values().copied().collect()
    }

    /// True when at least one segment is registered and every registered one is mounted.
    pub fn all_mounted(&self) -> bool {
        let book = self.book.lock();
        !book.segments.is_empty() && book.segments.keys().all(|n| book.mounted.contains_key(n))
    }

    /// Forget every mount (the master no longer knows this node): the next pass remounts.
    pub fn clear_mounted(&self) -> Vec<u32> {
        std::mem::take(&mut self.book.lock().mounted)
            .into_values()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_fixtures::{engine, memory};
    use super::*;

    #[test]
    fn specs_name_node_numa_capacity_and_endpoint() {
        let spec = spec_for("n1", "tcp://10.0.0.1:7000", "dram2", Tier::Dram, 1, 1 << 20);
        assert_eq!(spec.node, "n1");
        assert_eq!(spec.name, "dram2");
        assert_eq!(spec.tier, Tier::Dram);
        assert_eq!(spec.capacity_bytes, 1 << 20);
        assert_eq!(spec.numa_node, 1);
        assert_eq!(spec.endpoints, vec!["tcp://10.0.0.1:7000".to_owned()]);
        assert_eq!(segment_name(3), "dram3");
    }

    #[test]
    fn only_dram_segments_with_a_shareable_file_announce_the_shm_endpoint() {
        let e = engine("n1");
        let r = PoolRegistrar::new(e, "n1".into(), "tcp://127.0.0.1:1".into())
            .with_shm_endpoint(Some("shm:///run/kvpool/pool-shm.sock".into()));
        let shared = || {
            kvpool_transfer::Segment::memfd("t", 1 << 16, kvpool_transfer::HostOptions::default())
                .expect("memfd")
        };
        r.register("dram0", Tier::Dram, 0, shared()).expect("dram0");
        r.register("dram1", Tier::Dram, 0, memory(1 << 16))
            .expect("dram1");
        r.register(SSD_SEGMENT, Tier::Ssd, 0, shared())
            .expect("ssd");
        let endpoints: BTreeMap<String, Vec<String>> = r
            .unmounted()
            .into_iter()
            .map(|s| (s.name, s.endpoints))
            .collect();
        let tcp = "tcp://127.0.0.1:1".to_owned();
        assert_eq!(
            endpoints["dram0"],
            [tcp.clone(), "shm:///run/kvpool/pool-shm.sock".to_owned()]
        );
        assert_eq!(
            endpoints["dram1"],
            std::slice::from_ref(&tcp),
            "heap memory has no file to share"
        );
        assert_eq!(
            endpoints[SSD_SEGMENT],
            [tcp],
            "SSD reads go through the read check"
        );
    }

    #[test]
    fn registrar_tracks_registration_and_mounts() {
        let e = engine("n1");
        let r = PoolRegistrar::new(e.clone(), "n1".into(), "tcp://127.0.0.1:1".into());
        assert!(!r.all_mounted(), "nothing registered is not healthy");
        r.register("dram0", Tier::Dram, 0, memory(1 << 16))
            .expect("register 0");
        r.register(SSD_SEGMENT, Tier::Ssd, 0, memory(1 << 16))
            .expect("register ssd");
        assert_eq!(
            r.register("dram0", Tier::Dram, 0, memory(4096))
                .expect_err("dup")
                .category(),
            "duplicate"
        );
        // The engine refuses a second registration under the same name: proof it holds ours.
        assert!(e.register("n1/dram0", Arc::new(memory(4096))).is_err());
        // The in-process view holds the very same memory.
        let seg = r.local_segments().get("n1/dram0").expect("local view");
        assert!(Arc::ptr_eq(
            &seg,
            r.local("dram0").expect("registration").segment()
        ));
        r.set_failure_domain("rack-7".into());
        let specs: Vec<_> = r
            .unmounted()
            .into_iter()
            .map(|s| (s.name, s.tier, s.failure_domain))
            .collect();
        assert_eq!(
            specs,
            [
                ("dram0".into(), Tier::Dram, "rack-7".into()),
                ("ssd0".into(), Tier::Ssd, "rack-7".into())
            ]
        );
        r.set_mounted("dram0", 17);
        assert_eq!(r.unmounted().len(), 1);
        assert!(!r.all_mounted());
        r.set_mounted(SSD_SEGMENT, 18);
        assert!(r.all_mounted());
        assert_eq!(r.mounted(), vec![17, 18]);
        // Deregistering releases the engine name but keeps the mount for the unmount pass.
        r.deregister("dram0").expect("deregister");
        assert_eq!(
            r.deregister("dram0").expect_err("gone").category(),
            "unknown"
        );
        assert!(r.local_segments().get("n1/dram0").is_none());
        e.register("n1/dram0", Arc::new(memory(4096)))
            .expect("name free again");
        assert_eq!(r.clear_mounted(), vec![17, 18]);
        assert!(r.mounted().is_empty());
        assert_eq!(r.registered(), vec![SSD_SEGMENT.to_owned()]);
    }
}

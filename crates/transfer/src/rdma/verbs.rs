//! libibverbs binding of the RDMA transport (cargo feature `rdma`): device list, per-device
//! context and protection domain, memory registration of engine segments, completion queues,
//! RC queue pairs (INIT -> RTR -> RTS from the peer's endpoint exchanged over the authenticated
//! TCP control connection), one-sided RDMA WRITE/READ and completion polling.
//! I/O boundary: every function here calls into libibverbs. Each raw object is owned by an RAII
//! type that frees it in Drop; `unsafe` in this module is limited to those FFI calls.

use std::ffi::CStr;
use std::ops::ControlFlow;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use rdma_sys::*;

use super::address::{AddressVector, LinkLayer, PortAttr};
use crate::memory::Segment;

/// Errors of verbs calls.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum VerbsError {
    #[error("no RDMA device named {0:?}")]
    NoDevice(String),
    #[error("{call} failed")]
    #[strum(serialize = "verbs_call")]
    Call {
        call: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("work request {wr_id} completed with status {status} ({reason})")]
    Completion {
        wr_id: u64,
        status: u32,
        reason: String,
    },
    #[error("range offset {offset} + length {len} is outside the registered region")]
    OutOfBounds { offset: u64, len: u64 },
}

impl VerbsError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

fn last(call: &'static str) -> VerbsError {
    VerbsError::Call {
        call,
        source: std::io::Error::last_os_error(),
    }
}

fn check(call: &'static str, rc: i32) -> Result<(), VerbsError> {
    if rc == 0 {
        Ok(())
    } else {
        // Verbs calls return an errno value (or -1 with errno set).
        let code = if rc > 0 {
            rc
        } else {
            std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
        };
        Err(VerbsError::Call {
            call,
            source: std::io::Error::from_raw_os_error(code),
        })
    }
}

/// The verbs name of a work completion status (e.g. "transport retry counter exceeded").
pub fn status_str(status: u32) -> String {
    // SAFETY: ibv_wc_status_str accepts any value and returns a static NUL-terminated string
    // (or NULL, checked).
    let p = unsafe { ibv_wc_status_str(status) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: p is a non-null static C string owned by libibverbs.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Walk the device list of libibverbs (nothing without RDMA support in the kernel): `visit`
/// sees each device, valid while it runs, and its name, and returns `Break` to stop early.
fn for_each_device(mut visit: impl FnMut(*mut ibv_device, &CStr) -> ControlFlow<()>) {
    let mut n = 0i32;
    // SAFETY: ibv_get_device_list writes the count and returns a NULL-terminated array (or NULL).
    let list = unsafe { ibv_get_device_list(&mut n) };
    if list.is_null() {
        return;
    }
    for i in 0..usize::try_from(n).unwrap_or(0) {
        // SAFETY: i < n entries of the array returned above.
        let dev = unsafe { *list.add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: dev is a valid device; the name is a NUL-terminated string owned by it.
        let name = unsafe { CStr::from_ptr(ibv_get_device_name(dev)) };
        if visit(dev, name).is_break() {
            break;
        }
    }
    // SAFETY: list came from ibv_get_device_list and is freed once; a context opened from one
    // of its devices stays valid after the list is freed.
    unsafe { ibv_free_device_list(list) };
}

/// Names of the RDMA devices libibverbs sees (empty without RDMA support in the kernel).
pub fn device_names() -> Vec<String> {
    let mut names = Vec::new();
    for_each_device(|_, name| {
        names.push(name.to_string_lossy().into_owned());
        ControlFlow::Continue(())
    });
    names
}

/// Number of RDMA devices visible to this process.
pub fn device_count() -> usize {
    device_names().len()
}

/// An opened device with one protection domain.
pub struct Device {
    name: String,
    ctx: NonNull<ibv_context>,
    pd: NonNull<ibv_pd>,
}

// SAFETY: ibv_context and ibv_pd are thread-safe per the libibverbs documentation.
unsafe impl Send for Device {}
// SAFETY: see Send.
unsafe impl Sync for Device {}

impl Device {
    /// Open device `name` and allocate its protection domain.
    pub fn open(name: &str) -> Result<Arc<Device>, VerbsError> {
        let mut ctx = ptr::null_mut();
        for_each_device(|dev, dn| {
            if dn.to_string_lossy() != name {
                return ControlFlow::Continue(());
            }
            // SAFETY: a valid device of the live list.
            ctx = unsafe { ibv_open_device(dev) };
            ControlFlow::Break(())
        });
        let ctx = NonNull::new(ctx).ok_or_else(|| VerbsError::NoDevice(name.to_owned()))?;
        // SAFETY: ctx is an open context.
        let pd = unsafe { ibv_alloc_pd(ctx.as_ptr()) };
        let Some(pd) = NonNull::new(pd) else {
            let e = last("ibv_alloc_pd");
            // SAFETY: ctx is open and owned here.
            unsafe { ibv_close_device(ctx.as_ptr()) };
            return Err(e);
        };
        Ok(Arc::new(Device {
            name: name.to_owned(),
            ctx,
            pd,
        }))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The 16 raw bytes of GID `index` on `port`.
    pub fn gid(&self, port: u8, index: u32) -> Result<[u8; 16], VerbsError> {
        let mut gid = ibv_gid { raw: [0; 16] };
        let idx = i32::try_from(index).map_err(|_| VerbsError::OutOfBounds {
            offset: index.into(),
            len: 0,
        })?;
        // SAFETY: ctx is open; gid is a valid out pointer.
        check("ibv_query_gid", unsafe {
            ibv_query_gid(self.ctx.as_ptr(), port, idx, &mut gid)
        })?;
        // SAFETY: every bit pattern is a valid [u8; 16].
        Ok(unsafe { gid.raw })
    }
}

impl Device {
    /// Link layer, LID and the GID at `gid_index` of `port` (`ibv_query_port`, `ibv_query_gid`).
    pub fn port_attr(&self, port: u8, gid_index: u32) -> Result<PortAttr, VerbsError> {
        // SAFETY: all-zero is a valid ibv_port_attr (plain integers).
        let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: ctx is open; attr is a valid out pointer of the size the provider expects
        // (the wrapper passes size_of_val).
        check("ibv_query_port", unsafe {
            ___ibv_query_port(self.ctx.as_ptr(), port, &mut attr)
        })?;
        Ok(PortAttr {
            link_layer: LinkLayer::from_verbs(attr.link_layer),
            lid: attr.lid,
            gid: self.gid(port, gid_index)?,
            gid_index,
        })
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: MRs, CQs and QPs hold an Arc<Device>, so none is alive any more.
        unsafe {
            ibv_dealloc_pd(self.pd.as_ptr());
            ibv_close_device(self.ctx.as_ptr());
        }
    }
}

/// A segment registered with one device (remote-readable and -writable).
pub struct MemoryRegion {
    mr: NonNull<ibv_mr>,
    segment: Arc<Segment>,
    _device: Arc<Device>,
}

// SAFETY: an ibv_mr is immutable after registration; the segment is Send + Sync.
unsafe impl Send for MemoryRegion {}
// SAFETY: see Send.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    pub fn register(device: &Arc<Device>, segment: Arc<Segment>) -> Result<Self, VerbsError> {
        let access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_READ;
        // SAFETY: the segment's memory stays valid while this region (holding the Arc) lives.
        let mr = unsafe {
            ibv_reg_mr(
                device.pd.as_ptr(),
                segment.addr() as *mut _,
                segment.len(),
                access.0 as i32,
            )
        };
        let mr = NonNull::new(mr).ok_or_else(|| last("ibv_reg_mr"))?;
        Ok(MemoryRegion {
            mr,
            segment,
            _device: device.clone(),
        })
    }

    pub fn lkey(&self) -> u32 {
        // SAFETY: mr is a live registration.
        unsafe { self.mr.as_ref().lkey }
    }

    pub fn rkey(&self) -> u32 {
        // SAFETY: mr is a live registration.
        unsafe { self.mr.as_ref().rkey }
    }

    pub fn addr(&self) -> u64 {
        self.segment.addr() as u64
    }

    pub fn len(&self) -> u64 {
        self.segment.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.segment.is_empty()
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once; no work request uses it any more
        // (queue pairs hold Arcs of the regions they post from).
        unsafe { ibv_dereg_mr(self.mr.as_ptr()) };
    }
}

/// What a peer needs to connect its RC queue pair to ours (exchanged over the control
/// connection): the LID matters on InfiniBand, the GID on RoCE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QpEndpoint {
    pub qp_num: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
}

/// Direction of a one-sided operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RdmaOp {
    Write,
    Read,
}

/// Address and key of the peer's memory (from its segment registration).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteAddr {
    pub addr: u64,
    pub rkey: u32,
}

/// A polled completion: the work request id and its outcome.
pub type Completion = (u64, Result<(), VerbsError>);

/// An RC queue pair with its own completion queue.
pub struct QueuePair {
    qp: NonNull<ibv_qp>,
    cq: NonNull<ibv_cq>,
    device: Arc<Device>,
    port: u8,
    gid_index: u32,
}

// SAFETY: posting and polling are thread-safe in libibverbs; QueuePair is used behind &self.
unsafe impl Send for QueuePair {}
// SAFETY: see Send.
unsafe impl Sync for QueuePair {}

const QP_DEPTH: u32 = 256;

impl QueuePair {
    /// Create an RC queue pair on `port` and move it to INIT.
    pub fn create(device: &Arc<Device>, port: u8, gid_index: u32) -> Result<Self, VerbsError> {
        // SAFETY: ctx is open; no completion channel.
        let cq = unsafe {
            ibv_create_cq(
                device.ctx.as_ptr(),
                QP_DEPTH as i32,
                ptr::null_mut(),
                ptr::null_mut(),
                0,
            )
        };
        let cq = NonNull::new(cq).ok_or_else(|| last("ibv_create_cq"))?;
        // SAFETY: all-zero is a valid ibv_qp_init_attr (null pointers, zero caps).
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.as_ptr();
        init.recv_cq = cq.as_ptr();
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.cap.max_send_wr = QP_DEPTH;
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        // SAFETY: pd is live; init is fully initialised.
        let qp = unsafe { ibv_create_qp(device.pd.as_ptr(), &mut init) };
        let Some(qp) = NonNull::new(qp) else {
            let e = last("ibv_create_qp");
            // SAFETY: cq was created above and is unused.
            unsafe { ibv_destroy_cq(cq.as_ptr()) };
            return Err(e);
        };
        let qp = QueuePair {
            qp,
            cq,
            device: device.clone(),
            port,
            gid_index,
        };
        // SAFETY: zeroed attr is valid; only masked fields are read.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = port;
        attr.qp_access_flags = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_READ)
            .0;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ibv_qp_attr_mask::IBV_QP_PORT
            | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        qp.modify(&mut attr, mask)?;
        Ok(qp)
    }

    fn modify(&self, attr: &mut ibv_qp_attr, mask: ibv_qp_attr_mask) -> Result<(), VerbsError> {
        // SAFETY: qp is live; attr is a valid, initialised struct.
        check("ibv_modify_qp", unsafe {
            ibv_modify_qp(self.qp.as_ptr(), attr, mask.0 as i32)
        })
    }

    /// Our endpoint, to send to the peer: QPN, PSN, and the port's LID and GID.
    pub fn endpoint(&self, psn: u32) -> Result<QpEndpoint, VerbsError> {
        let port = self.device.port_attr(self.port, self.gid_index)?;
        Ok(QpEndpoint {
            // SAFETY: qp is live.
            qp_num: unsafe { self.qp.as_ref().qp_num },
            psn,
            lid: port.lid,
            gid: port.gid,
        })
    }

    /// Connect to the peer's endpoint: INIT -> RTR -> RTS, reaching it through `av` (from
    /// `address::address_for`: a LID on InfiniBand, a GID with a GRH on RoCE), with path MTU
    /// code `mtu` (1 = 256 ... 5 = 4096 bytes; anything else means 1024).
    pub fn connect(
        &self,
        remote: &QpEndpoint,
        av: &AddressVector,
        local_psn: u32,
        mtu: u8,
    ) -> Result<(), VerbsError> {
        // SAFETY: zeroed attr is valid; only masked fields are read.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = match mtu {
            1 => ibv_mtu::IBV_MTU_256,
            2 => ibv_mtu::IBV_MTU_512,
            4 => ibv_mtu::IBV_MTU_2048,
            5 => ibv_mtu::IBV_MTU_4096,
            _ => ibv_mtu::IBV_MTU_1024,
        };
        attr.dest_qp_num = remote.qp_num;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = 16;
        attr.min_rnr_timer = 12;
        attr.ah_attr.dlid = av.dlid;
        attr.ah_attr.port_num = self.port;
        if let Some(grh) = &av.grh {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = ibv_gid { raw: grh.dgid };
            attr.ah_attr.grh.sgid_index = grh.sgid_index;
            attr.ah_attr.grh.hop_limit = grh.hop_limit;
        }
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_AV
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut attr, mask)?;
        // SAFETY: as above.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_RTS;
        attr.timeout = 14;
        attr.retry_cnt = 7;
        attr.rnr_retry = 7;
        attr.sq_psn = local_psn;
        attr.max_rd_atomic = 16;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut attr, mask)
    }

    /// Post one signalled one-sided operation between `local[offset..offset+len]` and the
    /// peer's memory at `remote`.
    pub fn post(
        &self,
        op: RdmaOp,
        local: &MemoryRegion,
        offset: u64,
        len: u32,
        remote: RemoteAddr,
        wr_id: u64,
    ) -> Result<(), VerbsError> {
        if offset
            .checked_add(u64::from(len))
            .is_none_or(|e| e > local.len())
        {
            return Err(VerbsError::OutOfBounds {
                offset,
                len: len.into(),
            });
        }
        self.post_raw(op, local.addr() + offset, local.lkey(), len, remote, wr_id)
    }

    /// Post one signalled one-sided operation from `local_addr` (inside a region registered on
    /// this device under `lkey`, which the caller has bounds-checked).
    pub fn post_raw(
        &self,
        op: RdmaOp,
        local_addr: u64,
        lkey: u32,
        len: u32,
        remote: RemoteAddr,
        wr_id: u64,
    ) -> Result<(), VerbsError> {
        let mut sge = ibv_sge {
            addr: local_addr,
            length: len,
            lkey,
        };
        // SAFETY: an all-zero ibv_send_wr is valid (null next, no inline data).
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = match op {
            RdmaOp::Write => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            RdmaOp::Read => ibv_wr_opcode::IBV_WR_RDMA_READ,
        };
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.rdma = rdma_t {
            remote_addr: remote.addr,
            rkey: remote.rkey,
        };
        let mut bad = ptr::null_mut();
        // SAFETY: qp is live; wr and sge outlive the call (the provider copies them). The
        // hardware checks lkey/rkey against the registrations, so a wrong address fails the
        // completion instead of touching unregistered memory.
        check("ibv_post_send", unsafe {
            ibv_post_send(self.qp.as_ptr(), &mut wr, &mut bad)
        })
    }

    /// Poll up to `max` completions: (wr_id, Ok or the failed status).
    pub fn poll(&self, max: usize) -> Result<Vec<Completion>, VerbsError> {
        let max = max.clamp(1, 64);
        // SAFETY: all-zero ibv_wc values are valid; the provider overwrites up to `max`.
        let mut wcs: Vec<ibv_wc> = (0..max).map(|_| unsafe { std::mem::zeroed() }).collect();
        // SAFETY: cq is live; wcs has room for `max` entries.
        let n = unsafe { ibv_poll_cq(self.cq.as_ptr(), max as i32, wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(last("ibv_poll_cq"));
        }
        Ok(wcs
            .iter()
            .take(n as usize)
            .map(|wc| {
                let r = if wc.status == ibv_wc_status::IBV_WC_SUCCESS {
                    Ok(())
                } else {
                    Err(VerbsError::Completion {
                        wr_id: wc.wr_id,
                        status: wc.status,
                        reason: status_str(wc.status),
                    })
                };
                (wc.wr_id, r)
            })
            .collect())
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once, QP before its CQ.
        unsafe {
            ibv_destroy_qp(self.qp.as_ptr());
            ibv_destroy_cq(self.cq.as_ptr());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::HostOptions;
    use crate::rdma::topology;

    /// Loopback RC: one QP connected to itself; RDMA WRITE then READ between two regions.
    #[test]
    fn rdma_loopback_write_and_read_or_skip() {
        let names = device_names();
        let devices = topology::scan(std::path::Path::new("/sys")).unwrap_or_default();
        let nics = topology::rank_nics(&devices, None, &names, None);
        let Some(nic) = nics.first() else {
            eprintln!(
                "SKIP: no RDMA device (libibverbs lists {names:?}; none active with a usable GID under /sys/class/infiniband)"
            );
            return;
        };
        let dev = Device::open(&nic.device).unwrap();
        let a = Arc::new(Segment::host(1 << 20, HostOptions::default()).unwrap());
        let b = Arc::new(Segment::host(1 << 20, HostOptions::default()).unwrap());
        a.write_at(0, b"over the wire").unwrap();
        let ma = MemoryRegion::register(&dev, a).unwrap();
        let mb = MemoryRegion::register(&dev, b.clone()).unwrap();
        let qp = QueuePair::create(&dev, nic.port, nic.gid_index).unwrap();
        let ep = qp.endpoint(100).unwrap();
        let port = dev.port_attr(nic.port, nic.gid_index).unwrap();
        eprintln!("{}: port {} {port:?}", nic.device, nic.port);
        let me = crate::rdma::handshake::QpInfo {
            device: nic.device.clone(),
            qp_num: ep.qp_num,
            psn: ep.psn,
            lid: ep.lid,
            gid: ep.gid,
            mtu: 3,
        };
        let av = crate::rdma::address::address_for(&port, &me).unwrap();
        qp.connect(&ep, &av, 100, 3).unwrap();
        let remote = RemoteAddr {
            addr: mb.addr() + 4096,
            rkey: mb.rkey(),
        };
        let wait = |id: u64| {
            for _ in 0..10_000_000 {
                if let Some((got, r)) = qp.poll(4).unwrap().into_iter().next() {
                    assert_eq!(got, id);
                    r.unwrap();
                    return;
                }
            }
            panic!("no completion for work request {id}");
        };
        qp.post(RdmaOp::Write, &ma, 0, 13, remote, 1).unwrap();
        wait(1);
        let mut got = [0u8; 13];
        b.read_at(4096, &mut got).unwrap();
        assert_eq!(&got, b"over the wire");
        qp.post(RdmaOp::Read, &ma, 8192, 13, remote, 2).unwrap();
        wait(2);
        let mut back = [0u8; 13];
        ma.segment.read_at(8192, &mut back).unwrap();
        assert_eq!(&back, b"over the wire");
    }
}

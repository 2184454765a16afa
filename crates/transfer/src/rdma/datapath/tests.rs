//! Tests of the RDMA data path against the fake fabric: the target side of the handshake, and
//! the fake queue pairs' copies, completions and addressing.

use std::sync::Arc;

use super::*;
use crate::error::error_chain;
use crate::memory::{HostOptions, Segment};
use crate::rdma::fake::{FakeFabric, Faults};
use crate::rdma::handshake::{ConnectRequest, QpInfo};

fn qp_pair(fabric: &FakeFabric) -> (Arc<dyn QueuePairOps>, Arc<dyn QueuePairOps>) {
    let devs = fabric.provider(&["a", "b"]).devices();
    let a = devs[0].create_qp().unwrap();
    let b = devs[1].create_qp().unwrap();
    a.connect(&b.info()).unwrap();
    b.connect(&a.info()).unwrap();
    (a, b)
}

#[test]
fn accept_connects_one_queue_pair_per_request_round_robin_over_devices() {
    let fabric = FakeFabric::new();
    let seg = Arc::new(Segment::host(1 << 16, HostOptions::default()).unwrap());
    let initiator = fabric.provider(&["i0", "i1", "i2"]).devices();
    let qps: Vec<_> = initiator.iter().map(|d| d.create_qp().unwrap()).collect();
    let req = ConnectRequest {
        segment: "s".into(),
        qps: qps.iter().map(|q| q.info()).collect(),
    };
    let target = fabric.provider(&["t0", "t1"]);
    let (reply, kept) = accept(target.as_ref(), &seg, &req).unwrap();
    let devices: Vec<_> = reply.paths.iter().map(|(q, _)| q.device.as_str()).collect();
    assert_eq!(devices, ["t0", "t1", "t0"]);
    // One registration per target device used, covering the whole segment.
    assert_eq!(fabric.registered_regions(), 2);
    assert!(
        reply
            .paths
            .iter()
            .all(|(_, r)| r.len == 1 << 16 && r.addr == seg.addr() as u64)
    );
    drop(kept);
    assert_eq!(fabric.registered_regions(), 0);
    let none = FakeFabric::new().provider(&[]);
    assert!(matches!(
        accept(none.as_ref(), &seg, &req),
        Err(RdmaError::NoDevice)
    ));
}

#[test]
fn fake_queue_pairs_copy_bounds_check_and_complete_out_of_order() {
    let fabric = FakeFabric::new();
    fabric.set_faults(Faults {
        reverse_completions: true,
        ..Faults::default()
    });
    let (a, _b) = qp_pair(&fabric);
    let dev = &fabric.provider(&["a"]).devices()[0];
    let src = Arc::new(Segment::host(8192, HostOptions::default()).unwrap());
    let dst = Arc::new(Segment::host(8192, HostOptions::default()).unwrap());
    src.write_at(0, b"0123456789").unwrap();
    let (ms, md) = (dev.register(&src).unwrap(), dev.register(&dst).unwrap());
    let wr = |wr_id, off: u64, len| WorkRequest {
        wr_id,
        op: RdmaOp::Write,
        local_addr: ms.addr() + off,
        lkey: ms.lkey(),
        len,
        remote_addr: md.addr() + off,
        rkey: md.rkey(),
    };
    a.post(&wr(1, 0, 5)).unwrap();
    a.post(&wr(2, 5, 5)).unwrap();
    a.post(&wr(3, 8190, 5)).unwrap(); // crosses the end of the region
    let mut out = Vec::new();
    a.poll(16, &mut out).unwrap();
    let ids: Vec<_> = out.iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, [3, 2, 1], "completions come back out of order");
    assert!(
        out[0]
            .result
            .as_ref()
            .is_err_and(|e| e.contains("REM_ACCESS"))
    );
    assert!(out[1].result.is_ok() && out[2].result.is_ok());
    let mut got = [0u8; 10];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"0123456789");
}

#[test]
fn a_failing_nic_errors_its_queue_pair_and_flushes_what_follows() {
    let fabric = FakeFabric::new();
    fabric.set_faults(Faults {
        failing_completions: ["a".to_owned()].into(),
        ..Faults::default()
    });
    let (a, _b) = qp_pair(&fabric);
    let dev = &fabric.provider(&["a"]).devices()[0];
    let seg = Arc::new(Segment::host(4096, HostOptions::default()).unwrap());
    let m = dev.register(&seg).unwrap();
    let wr = WorkRequest {
        wr_id: 1,
        op: RdmaOp::Read,
        local_addr: m.addr(),
        lkey: m.lkey(),
        len: 16,
        remote_addr: m.addr() + 64,
        rkey: m.rkey(),
    };
    a.post(&wr).unwrap();
    a.post(&WorkRequest { wr_id: 2, ..wr }).unwrap();
    let mut out = Vec::new();
    a.poll(16, &mut out).unwrap();
    assert!(
        out[0]
            .result
            .as_ref()
            .is_err_and(|e| e.contains("RETRY_EXC"))
    );
    assert!(out[1].result.as_ref().is_err_and(|e| e.contains("FLUSH")));
    let e = a.post(&wr).unwrap_err();
    assert!(e.to_string().contains("ibv_post_send"), "{e}");
}

#[test]
fn fake_ports_connect_by_lid_on_infiniband_and_by_gid_on_roce() {
    use crate::rdma::address::LinkLayer;
    let fabric = FakeFabric::new();
    let ib = fabric.provider_ib(&[("ib0", 5), ("ib1", 6)]).devices();
    let port = ib[0].port().unwrap();
    assert_eq!((port.link_layer, port.lid), (LinkLayer::InfiniBand, 5));
    let (a, b) = (ib[0].create_qp().unwrap(), ib[1].create_qp().unwrap());
    assert_eq!(
        (a.info().lid, b.info().lid),
        (5, 6),
        "the handshake carries the LID"
    );
    a.connect(&b.info()).unwrap();
    b.connect(&a.info()).unwrap();

    // A LID that names another port does not reach the queue pair.
    let c = ib[1].create_qp().unwrap();
    let wrong = QpInfo { lid: 5, ..c.info() };
    let e = a.connect(&wrong).unwrap_err();
    assert!(e.to_string().contains("ibv_modify_qp"), "{e}");
    // An InfiniBand peer that sent LID 0 is refused with the reason.
    let e = a.connect(&QpInfo { lid: 0, ..c.info() }).unwrap_err();
    assert_eq!(e.category(), "address");
    assert!(
        error_chain(&e).contains("sent LID 0"),
        "{}",
        error_chain(&e)
    );

    // RoCE: no LID, routed by GID; a RoCE port cannot reach an InfiniBand one.
    let roce = fabric.provider(&["r0", "r1"]).devices();
    assert_eq!(roce[0].port().unwrap().link_layer, LinkLayer::Ethernet);
    let (x, y) = (roce[0].create_qp().unwrap(), roce[1].create_qp().unwrap());
    assert_eq!(x.info().lid, 0);
    x.connect(&y.info()).unwrap();
    let e = x.connect(&c.info()).unwrap_err();
    assert!(
        error_chain(&e).contains("another link layer"),
        "{}",
        error_chain(&e)
    );
    let e = x
        .connect(&QpInfo {
            gid: [0; 16],
            ..y.info()
        })
        .unwrap_err();
    assert!(
        error_chain(&e).contains("all-zero GID"),
        "{}",
        error_chain(&e)
    );
}

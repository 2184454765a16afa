//! Transfer engine between two network namespaces joined by a veth pair that this test creates
//! (needs root and iproute2): the target runs as a child process in namespace A, the initiator
//! in a thread moved into namespace B. The link is cut mid-transfer (pending requests must fail
//! within the timeout), then restored (transfers must work again). Namespaces are removed even
//! when the test fails.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod netns_support;
mod skip_support;
mod transfer_util;

use std::fs::File;
use std::time::{Duration, Instant};

use kvpool_transfer::*;
use netns_support::{ip, running_as_root};
use transfer_util::*;

struct Netns {
    a: String,
    b: String,
    veth_a: String,
}

impl Netns {
    /// Create namespaces A and B joined by a veth pair with 10.200.<n>.1/30 and .2/30.
    fn create(n: u32) -> Result<(Netns, String, String), String> {
        let pid = std::process::id();
        let ns = Netns {
            a: format!("kvxa{pid}"),
            b: format!("kvxb{pid}"),
            veth_a: format!("kva{}", pid % 100_000),
        };
        let veth_b = format!("kvb{}", pid % 100_000);
        ip(&["netns", "add", &ns.a])?;
        // From here on Drop cleans up whatever was created.
        ip(&["netns", "add", &ns.b])?;
        ip(&[
            "link", "add", &ns.veth_a, "netns", &ns.a, "type", "veth", "peer", "name", &veth_b,
            "netns", &ns.b,
        ])?;
        let addr_a = format!("10.200.{n}.1");
        let addr_b = format!("10.200.{n}.2");
        ip(&[
            "-n",
            &ns.a,
            "addr",
            "add",
            &format!("{addr_a}/30"),
            "dev",
            &ns.veth_a,
        ])?;
        ip(&[
            "-n",
            &ns.b,
            "addr",
            "add",
            &format!("{addr_b}/30"),
            "dev",
            &veth_b,
        ])?;
        for (space, dev) in [(&ns.a, ns.veth_a.as_str()), (&ns.b, veth_b.as_str())] {
            ip(&["-n", space, "link", "set", "lo", "up"])?;
            ip(&["-n", space, "link", "set", dev, "up"])?;
        }
        Ok((ns, addr_a, addr_b))
    }

    fn link(&self, up: bool) {
        ip(&[
            "-n",
            &self.a,
            "link",
            "set",
            &self.veth_a,
            if up { "up" } else { "down" },
        ])
        .expect("toggle link");
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting a namespace also deletes the veth end inside it (and so its peer).
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
    }
}

#[test]
fn transfer_between_namespaces_survives_a_link_cut() {
    if !running_as_root() {
        skip_support::skip("needs root to create network namespaces");
        return;
    }
    let n = std::process::id() % 250 + 1;
    let (ns, addr_a, _addr_b) = match Netns::create(n) {
        Ok(v) => v,
        Err(e) => {
            skip_support::skip(&format!("cannot create network namespaces: {e}"));
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let target = match TargetProcess::try_spawn(
        &["ip", "netns", "exec", &ns.a],
        &format!("{addr_a}:0"),
        &dir.path().join("t.sock"),
    ) {
        Ok(t) => t,
        Err(e) => {
            skip_support::skip(&format!("`ip netns exec` could not run the target: {e}"));
            return;
        }
    };
    assert_eq!(target.tcp.ip().to_string(), addr_a);
    let desc = target.descriptor("node-a");
    let b_path = format!("/var/run/netns/{}", ns.b);

    // The initiator lives in a thread that joined namespace B: its sockets are created there.
    let result = std::thread::scope(|s| {
        s.spawn(|| {
            let joined = File::open(&b_path)
                .map_err(|e| e.to_string())
                .and_then(|fd| {
                    nix::sched::setns(&fd, nix::sched::CloneFlags::CLONE_NEWNET)
                        .map_err(|e| e.to_string())
                });
            if let Err(e) = joined {
                eprintln!("SKIP: cannot join namespace {}: {e}", ns.b);
                return;
            }
            let timeout = Duration::from_secs(2);
            let (engine, local) = initiator(timeout);
            let remote = engine
                .open_descriptor(&desc, None)
                .expect("open across namespaces");
            assert_eq!(remote.protocol(), Protocol::Tcp);
            round_trip(&engine, &local, &remote, 5);

            // Cut the link under a large in-flight batch (whatever already completed, did).
            let in_flight = engine
                .submit(requests(&local, &remote, TransferOp::Read, 128, MIB))
                .unwrap();
            let t0 = Instant::now();
            ns.link(false);
            // And submit more on the now dead path: these are certainly pending at the cut.
            let after_cut = engine
                .submit(requests(&local, &remote, TransferOp::Write, 16, MIB))
                .unwrap();
            for (name, batch, must_fail) in [
                ("in-flight", &in_flight, false),
                ("after-cut", &after_cut, true),
            ] {
                let statuses = batch.wait(Duration::from_secs(120)).expect("batch settles");
                let failed: Vec<_> = statuses
                    .iter()
                    .filter_map(|s| match s {
                        RequestStatus::Failed(f) => Some(f.clone()),
                        RequestStatus::Done => None,
                        RequestStatus::Pending => panic!("pending after wait"),
                    })
                    .collect();
                eprintln!(
                    "{name}: {} of {} requests failed, settled {:?} after the cut",
                    failed.len(),
                    statuses.len(),
                    t0.elapsed()
                );
                if must_fail {
                    assert_eq!(failed.len(), statuses.len());
                }
                for f in &failed {
                    assert!(
                        ["timeout", "lane_closed", "io", "connect", "handshake"]
                            .contains(&f.category),
                        "{f}"
                    );
                }
            }
            assert_eq!(
                engine.metrics().connections.get(),
                0,
                "dead lanes are closed"
            );

            // Nothing the failed lanes had queued may still be on its way: those WRITEs would
            // land on the target when the link comes back, over whatever was written since.
            let unsent = netns_support::unsent_to(&ns.b, &addr_a).expect("list sockets");
            assert!(
                unsent.is_empty(),
                "failed connections still hold unsent bytes for the target: {unsent:?}"
            );

            let t1 = Instant::now();
            ns.link(true);
            // The engine reconnects on next use once the link is back.
            let mut ok = false;
            for _ in 0..50 {
                let batch = engine
                    .submit(requests(&local, &remote, TransferOp::Read, 4, MIB))
                    .unwrap();
                if batch.wait_ok(Duration::from_secs(120)).is_ok() {
                    ok = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            assert!(ok, "transfers did not recover after the link came back");
            eprintln!("recovered {:?} after the link came back", t1.elapsed());
            round_trip(&engine, &local, &remote, 6);
            // Give a late retransmission of the cut's WRITEs time to arrive (the kernel backs
            // off to seconds); the bytes written after the cut must still be there.
            std::thread::sleep(Duration::from_secs(3));
            let written: Vec<u8> = (0..3 * MIB as usize + 7).map(|i| (i as u8) ^ 6).collect();
            let mut read = requests(&local, &remote, TransferOp::Read, 1, written.len() as u64);
            read[0].remote_offset = 1000;
            read[0].local_offset = 40 * MIB;
            engine.transfer(read).unwrap();
            let mut back = vec![0u8; written.len()];
            local.segment().read_at(40 * MIB, &mut back).unwrap();
            assert!(
                back == written,
                "bytes written after the cut were overwritten later"
            );
        })
        .join()
    });
    drop(target);
    drop(ns);
    if let Err(panic) = result {
        std::panic::resume_unwind(panic);
    }
}

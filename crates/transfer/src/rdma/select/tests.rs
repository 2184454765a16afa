//! NIC selection against the agent's sysfs fixture trees of real machines (a DGX-class RoCE
//! node with SR-IOV VFs, and a malformed one), plus properties of the per-transfer choice.

use std::path::PathBuf;

use proptest::prelude::*;

use super::*;
use crate::rdma::topology::scan;

fn agent_fixture(name: &str) -> Vec<RdmaDevice> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../agent/tests/fixtures")
        .join(name)
        .join("sys");
    scan(&root).expect("scan")
}

fn names(sel: &Selection) -> Vec<&str> {
    sel.nics.iter().map(|n| n.device.as_str()).collect()
}

#[test]
fn scan_resolves_pci_addresses_and_virtual_functions() {
    let devs = agent_fixture("dgx-roce");
    assert_eq!(devs.len(), 12);
    let vf = devs.iter().find(|d| d.name == "mlx5_8").expect("mlx5_8");
    assert_eq!(vf.pci_bus_id.as_deref(), Some("0000:19:00.2"));
    assert!(vf.is_vf);
    let pf = devs.iter().find(|d| d.name == "mlx5_0").expect("mlx5_0");
    assert_eq!(pf.pci_bus_id.as_deref(), Some("0000:19:00.0"));
    assert!(!pf.is_vf);
}

#[test]
fn without_settings_the_physical_functions_are_used_numa_local_first() {
    let devs = agent_fixture("dgx-roce");
    let sel = select(&devs, &NicPolicy::default()).expect("select");
    let mut got = names(&sel);
    got.sort_unstable();
    let pfs: Vec<&str> = devs
        .iter()
        .filter(|d| !d.is_vf)
        .map(|d| d.name.as_str())
        .collect();
    assert_eq!(pfs.len(), 8);
    assert_eq!(got, pfs, "VFs not given to the pod are skipped");
    assert_eq!(
        sel.notes
            .iter()
            .filter(|n| n.contains("a VF not given to this pod"))
            .count(),
        4
    );
    // Memory on node 1: the node-1 NICs lead, in name order, then node 0's.
    let sel = select(
        &devs,
        &NicPolicy {
            numa_node: Some(1),
            ..NicPolicy::default()
        },
    )
    .expect("select");
    let numas: Vec<Option<u32>> = sel.nics.iter().map(|n| n.numa_node).collect();
    let first_remote = numas.iter().position(|n| *n != Some(1)).expect("a remote");
    assert!(first_remote > 0, "{numas:?}");
    assert!(
        numas[first_remote..].iter().all(|n| *n == Some(0)),
        "{numas:?}"
    );
    // The automatic GID is the IPv4-mapped RoCE v2 entry.
    assert!(sel.nics.iter().all(|n| n.gid_index == 3));
}

#[test]
fn the_allow_list_is_honoured_and_unknown_names_are_named() {
    let devs = agent_fixture("dgx-roce");
    let policy = |allow: &[&str]| NicPolicy {
        allow: allow.iter().map(|s| (*s).to_owned()).collect(),
        ..NicPolicy::default()
    };
    let sel = select(&devs, &policy(&["mlx5_5", "mlx5_0"])).expect("select");
    let mut got = names(&sel);
    got.sort_unstable();
    assert_eq!(got, ["mlx5_0", "mlx5_5"]);
    let sel = select(&devs, &policy(&["mlx5_0", "mlx5_99"])).expect("select");
    assert_eq!(names(&sel), ["mlx5_0"]);
    assert!(
        sel.notes.iter().any(|n| n.contains("mlx5_99")),
        "{:?}",
        sel.notes
    );
    let err = select(&devs, &policy(&["mlx5_99"])).expect_err("nothing allowed exists");
    assert_eq!(err.category(), "not_allowed");
    let text = err.to_string();
    assert!(
        text.contains("transport.devices") && text.contains("mlx5_99") && text.contains("mlx5_0"),
        "{text}"
    );
    // A VF named on purpose is used even without the device plugin.
    let sel = select(&devs, &policy(&["mlx5_9"])).expect("select");
    assert_eq!(names(&sel), ["mlx5_9"]);
}

#[test]
fn the_pods_vfs_are_preferred_when_it_has_any() {
    let devs = agent_fixture("dgx-roce");
    let (vfs, notes) =
        pod_vfs_from_env([("PCIDEVICE_NVIDIA_COM_MLX5_VF", "0000:19:00.2, 0000:9B:00.3")]);
    assert!(notes.is_empty(), "{notes:?}");
    let sel = select(
        &devs,
        &NicPolicy {
            pod_vfs: vfs.clone(),
            ..NicPolicy::default()
        },
    )
    .expect("select");
    assert_eq!(names(&sel), ["mlx5_11", "mlx5_8"]);
    // The allow-list still applies to the VFs.
    let sel = select(
        &devs,
        &NicPolicy {
            pod_vfs: vfs,
            allow: vec!["mlx5_8".into(), "mlx5_0".into()],
            ..NicPolicy::default()
        },
    )
    .expect("select");
    assert_eq!(names(&sel), ["mlx5_8"]);
    // VFs that are no RDMA device of this host: physical functions, with a note.
    let sel = select(
        &devs,
        &NicPolicy {
            pod_vfs: vec!["0000:aa:00.1".into()],
            ..NicPolicy::default()
        },
    )
    .expect("select");
    assert_eq!(sel.nics.len(), 8);
    assert!(sel.notes.iter().any(|n| n.contains("0000:aa:00.1")));
}

#[test]
fn the_gid_override_is_used_or_the_error_names_it() {
    let devs = agent_fixture("dgx-roce");
    let policy = |gid| NicPolicy {
        gid_index: Some(gid),
        ..NicPolicy::default()
    };
    let sel = select(&devs, &policy(1)).expect("select");
    assert!(sel.nics.iter().all(|n| n.gid_index == 1));
    let err = select(&devs, &policy(9)).expect_err("no entry 9");
    assert_eq!(err.category(), "none_usable");
    assert!(
        err.to_string()
            .contains("mlx5_0 port 1: transport.gidIndex 9 is not a populated GID entry"),
        "{err}"
    );
}

#[test]
fn a_malformed_host_gives_reasons_not_a_panic() {
    let devs = agent_fixture("malformed");
    let names: Vec<&str> = devs.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["mlx5_0", "rxe0"]);
    assert_eq!(devs[1].pci_bus_id, None, "rxe0 has no device link");
    let err = select(&devs, &NicPolicy::default()).expect_err("nothing usable");
    let text = err.to_string();
    assert!(
        text.contains("mlx5_0 port 1: not ACTIVE") && text.contains("rxe0: no ports"),
        "{text}"
    );
    let err = select(&[], &NicPolicy::default()).expect_err("no devices");
    assert!(err.to_string().contains("no RDMA device"), "{err}");
}

#[test]
fn device_plugin_variables_are_parsed_and_bad_entries_noted() {
    let (vfs, notes) = pod_vfs_from_env([
        ("PCIDEVICE_B", "0000:zz:00.0,0000:19:00.3"),
        ("HOME", "/root"),
        ("PCIDEVICE_A", "0000:19:00.2,,0000:19:00.3"),
    ]);
    assert_eq!(vfs, ["0000:19:00.2", "0000:19:00.3"]);
    assert_eq!(notes.len(), 1);
    assert!(notes[0].contains("PCIDEVICE_B") && notes[0].contains("0000:zz:00.0"));
}

proptest! {
    #[test]
    fn a_transfer_goes_out_on_its_node_when_a_nic_is_there(
        nics in proptest::collection::vec(proptest::option::of(0u32..4), 0..8),
        mem in proptest::option::of(0u32..4),
    ) {
        let chosen = local_nics(&nics, mem);
        prop_assert_eq!(chosen.is_empty(), nics.is_empty());
        prop_assert!(chosen.windows(2).all(|w| w[0] < w[1]));
        let has_local = mem.is_some() && nics.contains(&mem);
        if has_local {
            prop_assert!(chosen.iter().all(|&i| nics[i] == mem));
            prop_assert_eq!(chosen.len(), nics.iter().filter(|n| **n == mem).count());
        } else {
            prop_assert_eq!(chosen, (0..nics.len()).collect::<Vec<_>>());
        }
    }
}

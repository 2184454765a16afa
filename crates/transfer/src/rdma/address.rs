//! How a queue pair addresses its peer when it moves to RTR: from the local port's attributes
//! (link layer, LID, source GID, as `ibv_query_port`/`ibv_query_gid` report them) and the peer's
//! [`QpInfo`] from the handshake. InfiniBand routes by LID inside a subnet (a GRH only when the
//! peer's GID is in another subnet); Ethernet (RoCE) has no LIDs and always routes by GID with a
//! GRH. Pure: no I/O; the libibverbs binding and the fake fabric both call [`address_for`].

use super::handshake::QpInfo;

/// `link_layer` values of `struct ibv_port_attr` (verbs.h).
pub const IBV_LINK_LAYER_UNSPECIFIED: u8 = 0;
pub const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;

/// First multicast LID: unicast LIDs are 1..=0xBFFF.
const FIRST_MULTICAST_LID: u16 = 0xC000;
/// Hop limit put in a GRH.
pub const HOP_LIMIT: u8 = 64;

/// The link layer of an RDMA port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkLayer {
    InfiniBand,
    /// RoCE: RDMA over Ethernet.
    Ethernet,
}

impl LinkLayer {
    /// From `ibv_port_attr.link_layer`; old drivers leave it unspecified, which means
    /// InfiniBand (Ethernet ports always say so).
    pub fn from_verbs(value: u8) -> LinkLayer {
        match value {
            IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
            _ => LinkLayer::InfiniBand,
        }
    }

    /// From sysfs `ports/N/link_layer` ("InfiniBand" or "Ethernet").
    pub fn from_sysfs(text: &str) -> LinkLayer {
        if text.trim().eq_ignore_ascii_case("ethernet") {
            LinkLayer::Ethernet
        } else {
            LinkLayer::InfiniBand
        }
    }
}

/// What the local port says about itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortAttr {
    pub link_layer: LinkLayer,
    /// The port's LID (InfiniBand; 0 on Ethernet, or on an IB port not yet configured by a
    /// subnet manager).
    pub lid: u16,
    /// The source GID (at the chosen GID index).
    pub gid: [u8; 16],
    /// The GID index the queue pair sends from.
    pub gid_index: u32,
}

/// The global route header of an address vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grh {
    pub dgid: [u8; 16],
    pub sgid_index: u8,
    pub hop_limit: u8,
}

/// The address vector (`ibv_ah_attr`) a queue pair uses to reach its peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddressVector {
    /// Destination LID (0 on Ethernet).
    pub dlid: u16,
    /// `Some` sets `is_global` and routes by GID.
    pub grh: Option<Grh>,
}

/// Why a peer cannot be addressed from this port.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum AddressError {
    #[error(
        "peer queue pair on {peer} sent LID 0 but the local port is InfiniBand: the peer is RoCE \
         (Ethernet) or its port has no LID from a subnet manager"
    )]
    PeerWithoutLid { peer: String },
    #[error("peer queue pair on {peer} sent multicast LID {lid:#06x}")]
    MulticastLid { peer: String, lid: u16 },
    #[error(
        "the local InfiniBand port has LID 0: no subnet manager has configured it (is opensm running?)"
    )]
    LocalWithoutLid,
    #[error(
        "peer queue pair on {peer} sent an all-zero GID but the local port is Ethernet (RoCE): \
         the peer is InfiniBand or has no usable GID"
    )]
    PeerWithoutGid { peer: String },
    #[error("GID index {0} does not fit an address vector (0..=255)")]
    GidIndex(u32),
}

impl AddressError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// The 64-bit subnet prefix of a GID.
fn subnet_prefix(gid: &[u8; 16]) -> &[u8] {
    gid.get(..8).unwrap_or(&[])
}

/// The address vector for reaching `remote` from `local`: on InfiniBand the peer's LID (and a
/// GRH only when its GID is in another subnet); on Ethernet the peer's GID with a GRH.
pub fn address_for(local: &PortAttr, remote: &QpInfo) -> Result<AddressVector, AddressError> {
    let sgid_index =
        u8::try_from(local.gid_index).map_err(|_| AddressError::GidIndex(local.gid_index))?;
    let zero_gid = remote.gid.iter().all(|&b| b == 0);
    let grh = Grh {
        dgid: remote.gid,
        sgid_index,
        hop_limit: HOP_LIMIT,
    };
    match local.link_layer {
        LinkLayer::InfiniBand => {
            if local.lid == 0 {
                return Err(AddressError::LocalWithoutLid);
            }
            if remote.lid == 0 {
                return Err(AddressError::PeerWithoutLid {
                    peer: remote.device.clone(),
                });
            }
            if remote.lid >= FIRST_MULTICAST_LID {
                return Err(AddressError::MulticastLid {
                    peer: remote.device.clone(),
                    lid: remote.lid,
                });
            }
            let other_subnet = !zero_gid && subnet_prefix(&remote.gid) != subnet_prefix(&local.gid);
            Ok(AddressVector {
                dlid: remote.lid,
                grh: other_subnet.then_some(grh),
            })
        }
        LinkLayer::Ethernet => {
            if zero_gid {
                return Err(AddressError::PeerWithoutGid {
                    peer: remote.device.clone(),
                });
            }
            Ok(AddressVector {
                dlid: 0,
                grh: Some(grh),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::handshake::MTU_1024;

    const SUBNET_A: [u8; 8] = [0xfe, 0x80, 0, 0, 0, 0, 0, 0];
    const SUBNET_B: [u8; 8] = [0xfe, 0x80, 0, 0, 0, 0, 0, 7];

    fn gid(prefix: [u8; 8], guid: u8) -> [u8; 16] {
        let mut g = [0u8; 16];
        g[..8].copy_from_slice(&prefix);
        g[15] = guid;
        g
    }

    fn peer(lid: u16, gid: [u8; 16]) -> QpInfo {
        QpInfo {
            device: "mlx5_1".into(),
            qp_num: 9,
            psn: 1,
            lid,
            gid,
            mtu: MTU_1024,
        }
    }

    fn ib(lid: u16) -> PortAttr {
        PortAttr {
            link_layer: LinkLayer::InfiniBand,
            lid,
            gid: gid(SUBNET_A, 1),
            gid_index: 0,
        }
    }

    fn roce(gid_index: u32) -> PortAttr {
        PortAttr {
            link_layer: LinkLayer::Ethernet,
            lid: 0,
            gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1],
            gid_index,
        }
    }

    #[test]
    fn infiniband_uses_the_peer_lid_without_grh_inside_the_subnet() {
        let av = address_for(&ib(3), &peer(17, gid(SUBNET_A, 2))).unwrap();
        assert_eq!(
            av,
            AddressVector {
                dlid: 17,
                grh: None
            }
        );
        // A peer that sent no GID at all is addressed the same way.
        let av = address_for(&ib(3), &peer(17, [0; 16])).unwrap();
        assert_eq!(av.grh, None);
    }

    #[test]
    fn infiniband_adds_a_grh_for_a_peer_in_another_subnet() {
        let remote = gid(SUBNET_B, 2);
        let av = address_for(&ib(3), &peer(17, remote)).unwrap();
        assert_eq!(av.dlid, 17);
        assert_eq!(
            av.grh,
            Some(Grh {
                dgid: remote,
                sgid_index: 0,
                hop_limit: HOP_LIMIT
            })
        );
    }

    #[test]
    fn infiniband_refuses_missing_and_multicast_lids() {
        let e = address_for(&ib(3), &peer(0, gid(SUBNET_A, 2))).unwrap_err();
        assert_eq!(e.category(), "peer_without_lid");
        assert!(
            e.to_string().contains("mlx5_1") && e.to_string().contains("LID 0"),
            "{e}"
        );
        let e = address_for(&ib(3), &peer(0xC001, [0; 16])).unwrap_err();
        assert_eq!(e.category(), "multicast_lid");
        let e = address_for(&ib(0), &peer(17, [0; 16])).unwrap_err();
        assert_eq!(e, AddressError::LocalWithoutLid);
    }

    #[test]
    fn ethernet_routes_by_gid_with_a_grh_and_ignores_lids() {
        let remote = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 2];
        let av = address_for(&roce(3), &peer(0, remote)).unwrap();
        assert_eq!(
            av,
            AddressVector {
                dlid: 0,
                grh: Some(Grh {
                    dgid: remote,
                    sgid_index: 3,
                    hop_limit: HOP_LIMIT
                })
            }
        );
        let e = address_for(&roce(3), &peer(17, [0; 16])).unwrap_err();
        assert_eq!(e.category(), "peer_without_gid");
        let e = address_for(&roce(256), &peer(0, remote)).unwrap_err();
        assert_eq!(e, AddressError::GidIndex(256));
    }

    #[test]
    fn link_layers_parse_from_verbs_and_sysfs() {
        assert_eq!(
            LinkLayer::from_verbs(IBV_LINK_LAYER_ETHERNET),
            LinkLayer::Ethernet
        );
        assert_eq!(
            LinkLayer::from_verbs(IBV_LINK_LAYER_INFINIBAND),
            LinkLayer::InfiniBand
        );
        assert_eq!(
            LinkLayer::from_verbs(IBV_LINK_LAYER_UNSPECIFIED),
            LinkLayer::InfiniBand
        );
        assert_eq!(LinkLayer::from_sysfs("Ethernet\n"), LinkLayer::Ethernet);
        assert_eq!(LinkLayer::from_sysfs("InfiniBand"), LinkLayer::InfiniBand);
    }
}

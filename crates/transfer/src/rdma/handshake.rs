//! Encoding of the RDMA queue-pair handshake that travels as the payload of the RDMA_CONNECT and
//! RDMA_CONNECT_OK frames on an authenticated TCP control connection: per queue pair the device,
//! QPN, PSN, LID, GID and MTU, and in the reply the address, rkey and length of the remote
//! segment's memory region on that device. Pure: no I/O; the decoder is property-tested to
//! reject every malformed payload with an error, never a panic.
//!
//! ```text
//! RDMA_CONNECT payload              RDMA_CONNECT_OK payload
//!   u8   version (1)                  u8   version (1)
//!   u16  segment name length          u8   count (1..=MAX_QPS)
//!   ..   segment name (UTF-8)         count x { QpInfo, u64 addr, u32 rkey, u64 len }
//!   u8   count (1..=MAX_QPS)
//!   count x QpInfo
//!
//! QpInfo: u8 device name length, device name (UTF-8, <= 64 bytes), u32 qp_num, u32 psn
//!         (24 bits), u16 lid, [u8; 16] gid, u8 mtu (IBV_MTU_256 = 1 .. IBV_MTU_4096 = 5)
//! ```
//! All integers little endian. A payload with bytes after the last field is rejected.

/// Version of the handshake payload spoken by this build.
pub const HANDSHAKE_VERSION: u8 = 1;
/// Most queue pairs (local NICs) one handshake may carry.
pub const MAX_QPS: usize = 16;
/// Longest device name accepted.
pub const MAX_DEVICE_NAME: usize = 64;
/// Longest segment name accepted.
pub const MAX_SEGMENT_NAME: usize = 4096;

/// Path MTU as the verbs enum encodes it (1 = 256 bytes ... 5 = 4096 bytes).
pub const MTU_1024: u8 = 3;

/// One side's queue pair, as the other side needs it to move its own QP to RTR.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QpInfo {
    pub device: String,
    pub qp_num: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    pub mtu: u8,
}

/// The remote segment's registration on one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionInfo {
    pub addr: u64,
    pub rkey: u32,
    pub len: u64,
}

/// Initiator -> target: connect these queue pairs to segment `segment`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectRequest {
    pub segment: String,
    pub qps: Vec<QpInfo>,
}

/// Target -> initiator: one entry per requested queue pair, in the same order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectReply {
    pub paths: Vec<(QpInfo, RegionInfo)>,
}

/// Why a handshake payload was rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum HandshakeError {
    #[error("handshake payload truncated while reading {0}")]
    Truncated(&'static str),
    #[error("handshake version {0} is not supported (this build speaks {HANDSHAKE_VERSION})")]
    BadVersion(u8),
    #[error("{0} queue pairs in a handshake (must be 1..={MAX_QPS})")]
    BadCount(usize),
    #[error("{what} of {len} bytes exceeds the limit of {limit}")]
    TooLong {
        what: &'static str,
        len: usize,
        limit: usize,
    },
    #[error("{0} is not valid UTF-8")]
    BadUtf8(&'static str),
    #[error("path MTU code {0} is not one of 1..=5")]
    BadMtu(u8),
    #[error("PSN {0:#x} does not fit in 24 bits")]
    BadPsn(u32),
    #[error("{0} trailing bytes after the handshake payload")]
    Trailing(usize),
}

impl HandshakeError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// A cursor over a payload that only ever returns errors for short input.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], HandshakeError> {
        if self.buf.len() < n {
            return Err(HandshakeError::Truncated(what));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], HandshakeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, HandshakeError> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, HandshakeError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, HandshakeError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, HandshakeError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(
        &mut self,
        len: usize,
        limit: usize,
        what: &'static str,
    ) -> Result<String, HandshakeError> {
        if len > limit {
            return Err(HandshakeError::TooLong { what, len, limit });
        }
        let bytes = self.take(len, what)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| HandshakeError::BadUtf8(what))
    }

    fn finish(self) -> Result<(), HandshakeError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(HandshakeError::Trailing(self.buf.len()))
        }
    }
}

fn check_count(n: usize) -> Result<(), HandshakeError> {
    if n == 0 || n > MAX_QPS {
        Err(HandshakeError::BadCount(n))
    } else {
        Ok(())
    }
}

fn check_version(r: &mut Reader<'_>) -> Result<(), HandshakeError> {
    match r.u8("version")? {
        HANDSHAKE_VERSION => Ok(()),
        v => Err(HandshakeError::BadVersion(v)),
    }
}

impl QpInfo {
    fn validate(&self) -> Result<(), HandshakeError> {
        if self.device.len() > MAX_DEVICE_NAME {
            return Err(HandshakeError::TooLong {
                what: "device name",
                len: self.device.len(),
                limit: MAX_DEVICE_NAME,
            });
        }
        if !(1..=5).contains(&self.mtu) {
            return Err(HandshakeError::BadMtu(self.mtu));
        }
        if self.psn > 0x00ff_ffff {
            return Err(HandshakeError::BadPsn(self.psn));
        }
        Ok(())
    }

    fn encode_into(&self, out: &mut Vec<u8>) {
        // Validated before encoding: the name fits in a u8 length.
        out.push(self.device.len() as u8);
        out.extend_from_slice(self.device.as_bytes());
        out.extend_from_slice(&self.qp_num.to_le_bytes());
        out.extend_from_slice(&self.psn.to_le_bytes());
        out.extend_from_slice(&self.lid.to_le_bytes());
        out.extend_from_slice(&self.gid);
        out.push(self.mtu);
    }

    fn decode_from(r: &mut Reader<'_>) -> Result<QpInfo, HandshakeError> {
        let name_len = usize::from(r.u8("device name length")?);
        let device = r.string(name_len, MAX_DEVICE_NAME, "device name")?;
        let info = QpInfo {
            device,
            qp_num: r.u32("qp_num")?,
            psn: r.u32("psn")?,
            lid: r.u16("lid")?,
            gid: r.array("gid")?,
            mtu: r.u8("mtu")?,
        };
        info.validate()?;
        Ok(info)
    }
}

impl ConnectRequest {
    pub fn encode(&self) -> Result<Vec<u8>, HandshakeError> {
        check_count(self.qps.len())?;
        if self.segment.len() > MAX_SEGMENT_NAME {
            return Err(HandshakeError::TooLong {
                what: "segment name",
                len: self.segment.len(),
                limit: MAX_SEGMENT_NAME,
            });
        }
        let mut out = vec![HANDSHAKE_VERSION];
        out.extend_from_slice(&(self.segment.len() as u16).to_le_bytes());
        out.extend_from_slice(self.segment.as_bytes());
        out.push(self.qps.len() as u8);
        for q in &self.qps {
            q.validate()?;
            q.encode_into(&mut out);
        }
        Ok(out)
    }

    pub fn decode(buf: &[u8]) -> Result<ConnectRequest, HandshakeError> {
        let mut r = Reader { buf };
        check_version(&mut r)?;
        let name_len = usize::from(r.u16("segment name length")?);
        let segment = r.string(name_len, MAX_SEGMENT_NAME, "segment name")?;
        let count = usize::from(r.u8("queue pair count")?);
        check_count(count)?;
        let qps = (0..count)
            .map(|_| QpInfo::decode_from(&mut r))
            .collect::<Result<Vec<_>, _>>()?;
        r.finish()?;
        Ok(ConnectRequest { segment, qps })
    }
}

impl ConnectReply {
    pub fn encode(&self) -> Result<Vec<u8>, HandshakeError> {
        check_count(self.paths.len())?;
        let mut out = vec![HANDSHAKE_VERSION, self.paths.len() as u8];
        for (q, region) in &self.paths {
            q.validate()?;
            q.encode_into(&mut out);
            out.extend_from_slice(&region.addr.to_le_bytes());
            out.extend_from_slice(&region.rkey.to_le_bytes());
            out.extend_from_slice(&region.len.to_le_bytes());
        }
        Ok(out)
    }

    pub fn decode(buf: &[u8]) -> Result<ConnectReply, HandshakeError> {
        let mut r = Reader { buf };
        check_version(&mut r)?;
        let count = usize::from(r.u8("queue pair count")?);
        check_count(count)?;
        let mut paths = Vec::with_capacity(count);
        for _ in 0..count {
            let q = QpInfo::decode_from(&mut r)?;
            let region = RegionInfo {
                addr: r.u64("region address")?,
                rkey: r.u32("rkey")?,
                len: r.u64("region length")?,
            };
            paths.push((q, region));
        }
        r.finish()?;
        Ok(ConnectReply { paths })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn qp_info() -> impl Strategy<Value = QpInfo> {
        (
            "[a-z0-9_]{0,64}",
            any::<u32>(),
            0u32..=0x00ff_ffff,
            any::<u16>(),
            any::<[u8; 16]>(),
            1u8..=5,
        )
            .prop_map(|(device, qp_num, psn, lid, gid, mtu)| QpInfo {
                device,
                qp_num,
                psn,
                lid,
                gid,
                mtu,
            })
    }

    fn region() -> impl Strategy<Value = RegionInfo> {
        (any::<u64>(), any::<u32>(), any::<u64>()).prop_map(|(addr, rkey, len)| RegionInfo {
            addr,
            rkey,
            len,
        })
    }

    proptest! {
        #[test]
        fn requests_round_trip(segment in "\\PC{0,40}", qps in proptest::collection::vec(qp_info(), 1..=MAX_QPS)) {
            let req = ConnectRequest { segment, qps };
            let enc = req.encode().unwrap();
            prop_assert_eq!(ConnectRequest::decode(&enc), Ok(req));
        }

        #[test]
        fn replies_round_trip(paths in proptest::collection::vec((qp_info(), region()), 1..=MAX_QPS)) {
            let rep = ConnectReply { paths };
            let enc = rep.encode().unwrap();
            prop_assert_eq!(ConnectReply::decode(&enc), Ok(rep));
        }

        #[test]
        fn decoders_never_panic_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = ConnectRequest::decode(&bytes);
            let _ = ConnectReply::decode(&bytes);
        }

        #[test]
        fn every_truncation_of_a_valid_payload_is_an_error(
            qps in proptest::collection::vec(qp_info(), 1..4), region in region(), cut_seed: usize
        ) {
            let req = ConnectRequest { segment: "node-a/dram0".into(), qps: qps.clone() }.encode().unwrap();
            let cut = cut_seed % req.len();
            prop_assert!(ConnectRequest::decode(&req[..cut]).is_err());
            let rep = ConnectReply { paths: qps.into_iter().map(|q| (q, region)).collect() }.encode().unwrap();
            let cut = cut_seed % rep.len();
            prop_assert!(ConnectReply::decode(&rep[..cut]).is_err());
        }

        #[test]
        fn single_byte_corruptions_never_panic(qps in proptest::collection::vec(qp_info(), 1..4), at: usize, byte: u8) {
            let mut req = ConnectRequest { segment: "s".into(), qps }.encode().unwrap();
            let i = at % req.len();
            req[i] = byte;
            let _ = ConnectRequest::decode(&req);
        }
    }

    fn sample() -> QpInfo {
        QpInfo {
            device: "mlx5_0".into(),
            qp_num: 0x1234,
            psn: 0x42,
            lid: 0,
            gid: [0xfe; 16],
            mtu: MTU_1024,
        }
    }

    #[test]
    fn malformed_payloads_name_what_is_wrong() {
        let good = ConnectRequest {
            segment: "seg".into(),
            qps: vec![sample()],
        }
        .encode()
        .unwrap();
        let mut b = good.clone();
        b[0] = 9;
        assert_eq!(
            ConnectRequest::decode(&b),
            Err(HandshakeError::BadVersion(9))
        );
        let mut b = good.clone();
        b.push(0);
        assert_eq!(ConnectRequest::decode(&b), Err(HandshakeError::Trailing(1)));
        // The count byte sits after version (1), name length (2) and name (3).
        let mut b = good.clone();
        b[6] = 0;
        assert_eq!(ConnectRequest::decode(&b), Err(HandshakeError::BadCount(0)));
        b[6] = 17;
        assert_eq!(
            ConnectRequest::decode(&b),
            Err(HandshakeError::BadCount(17))
        );
        let mut b = good.clone();
        let last = b.len() - 1;
        b[last] = 7;
        assert_eq!(ConnectRequest::decode(&b), Err(HandshakeError::BadMtu(7)));
        let mut b = good;
        b[4] = 0xff; // first byte of the segment name
        assert_eq!(
            ConnectRequest::decode(&b),
            Err(HandshakeError::BadUtf8("segment name"))
        );
        assert_eq!(
            ConnectRequest::decode(&[]),
            Err(HandshakeError::Truncated("version"))
        );
    }

    #[test]
    fn encoding_refuses_values_the_decoder_would_reject() {
        let mut q = sample();
        q.psn = 1 << 24;
        let req = ConnectRequest {
            segment: "s".into(),
            qps: vec![q],
        };
        assert_eq!(req.encode(), Err(HandshakeError::BadPsn(1 << 24)));
        let req = ConnectRequest {
            segment: "s".into(),
            qps: vec![],
        };
        assert_eq!(req.encode(), Err(HandshakeError::BadCount(0)));
        let mut q = sample();
        q.device = "x".repeat(65);
        assert!(matches!(
            ConnectReply {
                paths: vec![(
                    q,
                    RegionInfo {
                        addr: 0,
                        rkey: 0,
                        len: 0
                    }
                )]
            }
            .encode(),
            Err(HandshakeError::TooLong { .. })
        ));
    }
}

//! Striping's on-pool format: when a value is striped ([`StripeConfig`]), the manifest stored
//! under the caller's key ([`Manifest`]) and the keys of its parts ([`stripe_part_key`]).
//! Pure.

use kvpool_core::master::types::ObjectKey;

/// When a value is striped: values larger than `threshold` bytes are cut into parts of
/// `part_size` bytes, each its own object placed by the master (most free space first, so parts
/// spread over the nodes), plus a small manifest under the caller's key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StripeConfig {
    pub threshold: u64,
    pub part_size: u64,
}

impl Default for StripeConfig {
    fn default() -> Self {
        Self {
            threshold: 16 << 20,
            part_size: 4 << 20,
        }
    }
}

/// Start of every manifest value.
const MANIFEST_MAGIC: &[u8; 16] = b"kvpool-stripe-v1";
/// Manifest layout: magic, digest of the owning key (16), total size, part size, part count.
pub const MANIFEST_LEN: usize = 16 + 16 + 8 + 8 + 4;
/// Most parts one object may have (bounds what a manifest read from the pool can ask for).
const MAX_PARTS: u64 = 16_384;

/// What a striped object's manifest says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Manifest {
    pub total: u64,
    pub part_size: u64,
    pub parts: u32,
}

impl Manifest {
    pub(super) fn new(total: u64, part_size: u64) -> Option<Self> {
        let parts = total.div_ceil(part_size.max(1));
        (part_size > 0 && total > 0 && parts <= MAX_PARTS).then_some(Self {
            total,
            part_size,
            parts: u32::try_from(parts).ok()?,
        })
    }

    /// Offset and length of part `i`.
    pub fn part(&self, i: u32) -> (u64, u64) {
        let off = u64::from(i) * self.part_size;
        (off, self.part_size.min(self.total.saturating_sub(off)))
    }

    /// The keys of every part of the striped object `key`, in order.
    pub(super) fn part_keys(&self, key: &[u8]) -> Vec<Vec<u8>> {
        (0..self.parts).map(|i| stripe_part_key(key, i)).collect()
    }

    pub fn encode(&self, key: &[u8]) -> [u8; MANIFEST_LEN] {
        let d = ObjectKey::from_bytes(key);
        let mut out = [0u8; MANIFEST_LEN];
        let fields: [&[u8]; 6] = [
            MANIFEST_MAGIC,
            &d.hi.to_le_bytes(),
            &d.lo.to_le_bytes(),
            &self.total.to_le_bytes(),
            &self.part_size.to_le_bytes(),
            &self.parts.to_le_bytes(),
        ];
        let mut at = 0;
        for f in fields {
            if let Some(dst) = out.get_mut(at..at + f.len()) {
                dst.copy_from_slice(f);
            }
            at += f.len();
        }
        out
    }

    /// The manifest of `key` if `value` is one: right length, magic, the key's own digest and
    /// consistent sizes. Anything else is an ordinary value.
    pub fn decode(key: &[u8], value: &[u8]) -> Option<Self> {
        if value.len() != MANIFEST_LEN || value.get(..16)? != MANIFEST_MAGIC {
            return None;
        }
        let u64_at = |at: usize| -> Option<u64> {
            Some(u64::from_le_bytes(value.get(at..at + 8)?.try_into().ok()?))
        };
        let d = ObjectKey::from_bytes(key);
        if u64_at(16)? != d.hi || u64_at(24)? != d.lo {
            return None;
        }
        let total = u64_at(32)?;
        let part_size = u64_at(40)?;
        let parts = u32::from_le_bytes(value.get(48..52)?.try_into().ok()?);
        Self::new(total, part_size).filter(|m| m.parts == parts)
    }
}

/// Key of part `i` of the striped object `key`: a fixed-length name derived from the key's
/// digest, in a namespace (leading NUL and tag) that caller keys are not expected to use.
pub fn stripe_part_key(key: &[u8], i: u32) -> Vec<u8> {
    let d = ObjectKey::from_bytes(key);
    let mut k = Vec::with_capacity(13 + 16 + 4);
    k.extend_from_slice(b"\0kvpool-part\0");
    k.extend_from_slice(&d.hi.to_le_bytes());
    k.extend_from_slice(&d.lo.to_le_bytes());
    k.extend_from_slice(&i.to_le_bytes());
    k
}

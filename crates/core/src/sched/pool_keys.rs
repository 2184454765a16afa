//! The pool key contract (docs/engine-contract.md, "Pool keys"): the names under which engine
//! connectors store blocks in the pool, so that the conductor asks the master for exactly the
//! objects an engine wrote, and the master's block events name them by the engine's own block
//! hashes. Pure; no I/O.
//!
//! - kvpool's synthetic engines: `kvpool/synthetic/<model>/<key as 16 hex digits>`
//!   ([`super::pool_key`]).
//! - kvpool's vLLM connector (`kvpool.adapters.vllm`):
//!   `[<prefix>@]<model>@kvpool-vllm@<kv dtype>@bs<block size>@tp<r>of<n>@pp<r>of<n>@<hash>`,
//!   where `<model>` is the last path component of the engine's served model name (what
//!   clients put in a request's `model`; by default the model path), `<kv dtype>` the KV
//!   cache's element type (`bfloat16`, or vLLM's `--kv-cache-dtype` when set), `<hash>` the
//!   block's 32-byte vLLM block hash in lowercase hex, and `tp`/`pp` the parallel rank that
//!   holds that shard of the block. Every rank's shard is its own object; a block is in the
//!   pool when every rank's is, and the conductor asks for rank 0's.

use super::engine_hash::EngineHash;
use super::{BlockKey, pool_key};

/// The component that marks a name as the vLLM connector's.
pub const VLLM_MARKER: &str = "kvpool-vllm";

/// How the conductor names a prompt's blocks when it asks the pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolKeys {
    /// kvpool's synthetic engines, by the request's model name.
    Synthetic,
    /// kvpool's vLLM connector.
    Vllm(VllmKeys),
}

impl PoolKeys {
    /// The names of the blocks of a request for `model` (the model it names, which is the
    /// engines' served model name): `hashes` (the engine's block hashes) where the contract
    /// needs them, else `keys`. `None` when no name can be made (the contract needs hashes
    /// that were not computed, or the model has no usable name).
    pub fn names(
        &self,
        model: &str,
        keys: &[BlockKey],
        hashes: Option<&[EngineHash]>,
    ) -> Option<Vec<Vec<u8>>> {
        match self {
            PoolKeys::Synthetic => Some(keys.iter().map(|&k| pool_key(model, k)).collect()),
            PoolKeys::Vllm(v) => {
                let namespace = v.namespace(model).ok()?;
                hashes.map(|hs| hs.iter().map(|h| v.name_in(&namespace, h)).collect())
            }
        }
    }
}

/// The vLLM connector's names for one engine configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VllmKeys {
    /// The model's name in keys when set; else the request's model.
    model: Option<String>,
    kv_dtype: String,
    block_size: u32,
    tp_size: u32,
    pp_size: u32,
    prefix: Option<String>,
}

/// Why a vLLM key namespace cannot be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{field} {value:?}: {problem}")]
pub struct KeyContractError {
    pub field: &'static str,
    pub value: String,
    pub problem: &'static str,
}

fn component(field: &'static str, value: &str) -> Result<(), KeyContractError> {
    let bad = |problem| {
        Err(KeyContractError {
            field,
            value: value.to_owned(),
            problem,
        })
    };
    if value.is_empty() {
        return bad("must not be empty");
    }
    if value.contains('@') {
        return bad("must not contain '@' (the key's separator)");
    }
    Ok(())
}

impl VllmKeys {
    /// The names of engines with KV elements of `kv_dtype`, `block_size` tokens per block,
    /// and `tp_size` x `pp_size` ranks; `prefix` is the connector's `cache_prefix`, if any;
    /// `model` fixes the model's name (else each request's model is used).
    pub fn new(
        model: Option<&str>,
        kv_dtype: &str,
        block_size: u32,
        tp_size: u32,
        pp_size: u32,
        prefix: Option<&str>,
    ) -> Result<Self, KeyContractError> {
        if let Some(m) = model {
            component("model", model_id(m))?;
        }
        component("kv dtype", kv_dtype)?;
        if let Some(p) = prefix {
            component("cache prefix", p)?;
        }
        let positive = |field, v: u32| {
            if v == 0 {
                Err(KeyContractError {
                    field,
                    value: v.to_string(),
                    problem: "must be at least 1",
                })
            } else {
                Ok(())
            }
        };
        positive("block size", block_size)?;
        positive("tensor parallel size", tp_size)?;
        positive("pipeline parallel size", pp_size)?;
        Ok(Self {
            model: model.map(|m| model_id(m).to_owned()),
            kv_dtype: kv_dtype.to_owned(),
            block_size,
            tp_size,
            pp_size,
            prefix: prefix.map(str::to_owned),
        })
    }

    /// `[<prefix>@]<model>@kvpool-vllm@<kv dtype>@bs<block size>` for requests naming
    /// `model` (a served model name, a path or a hub name: its last component is used).
    pub fn namespace(&self, model: &str) -> Result<String, KeyContractError> {
        let model = self.model.as_deref().unwrap_or_else(|| model_id(model));
        component("model", model)?;
        let prefix = self
            .prefix
            .as_deref()
            .map(|p| format!("{p}@"))
            .unwrap_or_default();
        Ok(format!(
            "{prefix}{model}@{VLLM_MARKER}@{}@bs{}",
            self.kv_dtype, self.block_size
        ))
    }

    /// Rank 0's name of the block with `hash` in `namespace` ([`Self::namespace`]).
    pub fn name_in(&self, namespace: &str, hash: &EngineHash) -> Vec<u8> {
        format!(
            "{namespace}@tp0of{}@pp0of{}@{}",
            self.tp_size,
            self.pp_size,
            hash.to_hex()
        )
        .into_bytes()
    }
}

/// The model's name in keys: the last `/` component of a served model name, path or hub name
/// (trailing `/` ignored).
pub fn model_id(model: &str) -> &str {
    let trimmed = model.trim_end_matches('/');
    trimmed.rsplit('/').next().unwrap_or(trimmed)
}

/// One parsed vLLM connector name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VllmName<'a> {
    pub namespace: &'a str,
    pub tp_rank: u32,
    pub tp_size: u32,
    pub pp_rank: u32,
    pub pp_size: u32,
    pub hash: EngineHash,
}

/// `rank` and `size` of `tp<rank>of<size>` (or `pp`).
fn rank_of(part: &str, tag: &str) -> Option<(u32, u32)> {
    let (rank, size) = part.strip_prefix(tag)?.split_once("of")?;
    let (rank, size) = (rank.parse().ok()?, size.parse().ok()?);
    (rank < size).then_some((rank, size))
}

/// Parses a vLLM connector name; `None` for any other key.
pub fn parse_vllm_name(key: &[u8]) -> Option<VllmName<'_>> {
    let text = std::str::from_utf8(key).ok()?;
    let mut parts = text.rsplitn(4, '@');
    let (hex, pp, tp, namespace) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if !namespace.split('@').any(|p| p == VLLM_MARKER) || hex.len() != 64 {
        return None;
    }
    let mut hash = [0u8; 32];
    for (i, byte) in hash.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    let (tp_rank, tp_size) = rank_of(tp, "tp")?;
    let (pp_rank, pp_size) = rank_of(pp, "pp")?;
    Some(VllmName {
        namespace,
        tp_rank,
        tp_size,
        pp_rank,
        pp_size,
        hash: EngineHash(hash),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(seed: u8) -> EngineHash {
        EngineHash(std::array::from_fn(|i| seed.wrapping_add(i as u8)))
    }

    #[test]
    fn names_follow_the_documented_layout() {
        let k = VllmKeys::new(None, "bfloat16", 16, 2, 1, None).expect("valid");
        let ns = k.namespace("/models/tiny/").expect("valid model");
        assert_eq!(ns, "tiny@kvpool-vllm@bfloat16@bs16");
        let name = String::from_utf8(k.name_in(&ns, &hash(0))).expect("utf8");
        assert_eq!(
            name,
            format!(
                "tiny@kvpool-vllm@bfloat16@bs16@tp0of2@pp0of1@{}",
                hash(0).to_hex()
            )
        );
        let p = VllmKeys::new(Some("org/m"), "fp8_e4m3", 128, 1, 1, Some("team")).expect("valid");
        assert_eq!(
            p.namespace("other").expect("fixed model"),
            "team@m@kvpool-vllm@fp8_e4m3@bs128"
        );
        assert!(k.namespace("a@b").is_err());
    }

    #[test]
    fn bad_components_are_refused_by_name() {
        let e = VllmKeys::new(Some("a@b"), "bfloat16", 16, 1, 1, None).expect_err("@ in model");
        assert_eq!(e.field, "model");
        assert!(VllmKeys::new(None, "", 16, 1, 1, None).is_err());
        assert!(VllmKeys::new(None, "bf16", 0, 1, 1, None).is_err());
        assert!(VllmKeys::new(None, "bf16", 16, 0, 1, None).is_err());
        assert!(VllmKeys::new(None, "bf16", 16, 1, 1, Some("")).is_err());
    }

    #[test]
    fn parse_inverts_name_and_refuses_other_keys() {
        let k = VllmKeys::new(None, "bfloat16", 16, 1, 1, Some("x")).expect("valid");
        let name = k.name_in(&k.namespace("tiny").expect("valid"), &hash(7));
        let parsed = parse_vllm_name(&name).expect("parses");
        assert_eq!(parsed.namespace, "x@tiny@kvpool-vllm@bfloat16@bs16");
        assert_eq!(
            (
                parsed.tp_rank,
                parsed.tp_size,
                parsed.pp_rank,
                parsed.pp_size
            ),
            (0, 1, 0, 1)
        );
        assert_eq!(parsed.hash, hash(7));
        let rank3 = format!("m@kvpool-vllm@bf16@bs16@tp3of4@pp1of2@{}", hash(1).to_hex());
        let p = parse_vllm_name(rank3.as_bytes()).expect("parses");
        assert_eq!((p.tp_rank, p.pp_rank), (3, 1));
        for other in [
            b"kvpool/synthetic/m/00000000000000ff".to_vec(),
            format!("m@other@bf16@bs16@tp0of1@pp0of1@{}", hash(1).to_hex()).into_bytes(),
            format!("m@kvpool-vllm@bf16@bs16@tp1of1@pp0of1@{}", hash(1).to_hex()).into_bytes(),
            b"m@kvpool-vllm@bf16@bs16@tp0of1@pp0of1@zz".to_vec(),
            vec![0xff, b'@', b'@'],
            b"".to_vec(),
        ] {
            assert_eq!(
                parse_vllm_name(&other),
                None,
                "{}",
                String::from_utf8_lossy(&other)
            );
        }
    }

    #[test]
    fn names_for_a_prompt() {
        let v = PoolKeys::Vllm(VllmKeys::new(None, "bf16", 16, 1, 1, None).expect("valid"));
        assert_eq!(v.names("m", &[1], None), None);
        let hs = [hash(1), hash(2)];
        assert_eq!(v.names("bad@name", &[1, 2], Some(&hs)), None);
        let names = v
            .names("/models/m", &[1, 2], Some(&hs))
            .expect("hashes given");
        assert!(names[0].starts_with(b"m@kvpool-vllm@bf16@bs16@tp0of1@pp0of1@"));
        assert_eq!(names.len(), 2);
        assert_eq!(parse_vllm_name(&names[1]).expect("parses").hash, hash(2));
        assert_eq!(
            PoolKeys::Synthetic.names("m", &[255], None),
            Some(vec![b"kvpool/synthetic/m/00000000000000ff".to_vec()])
        );
    }
}

#[cfg(test)]
mod event_tests {
    use super::*;
    use crate::master::types::EventName;

    #[test]
    fn events_name_rank_zero_blocks_by_the_engine_hash() {
        let k = VllmKeys::new(None, "bfloat16", 16, 2, 1, None).expect("valid");
        let h = EngineHash(std::array::from_fn(|i| i as u8));
        let name = k.name_in(&k.namespace("m").expect("valid"), &h);
        assert_eq!(EventName::of_key(&name), EventName::Int(h.as_u64()));
        assert_eq!(h.as_u64(), 0x18191a1b1c1d1e1f);
        let rank1 = format!("m@kvpool-vllm@bfloat16@bs16@tp1of2@pp0of1@{}", h.to_hex());
        assert_eq!(
            EventName::of_key(rank1.as_bytes()),
            EventName::Bytes(rank1.into_bytes())
        );
    }
}

//! KV cache events as vLLM publishes them (and SGLang, which uses the same shape): what an
//! engine stored in and removed from its prefix cache. On the wire (ZMQ PUB) each message is
//! three frames, `[topic, sequence, payload]`: the sequence an 8-byte big-endian counter, the
//! payload a msgpack `EventBatch`, `[timestamp, events, data_parallel_rank]`. An event is either
//! a positional array whose first element names its kind (`["BlockStored", block_hashes,
//! parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
//! group_idx]`, `["BlockRemoved", block_hashes, medium, group_idx]`, trailing defaults omitted)
//! or a map with a `"type"` key and the same field names. Per-block `extra_keys` are skipped
//! (the conductor keys LoRA requests by `lora_name`, see `kvpool_core::sched::engine_hash`). Block
//! hashes are integers or raw bytes. This module decodes both forms and encodes either (the
//! synthetic engine and the master publish with it). Pure; no sockets.
//!
//! The replay protocol (ZMQ ROUTER on the engine, DEALER on the consumer): the consumer sends
//! `["", start_sequence]` and receives `["", sequence, payload]` for every buffered batch from
//! `start_sequence` on, then `["", END_SEQUENCE, ""]`.

use rmpv::Value;

/// The sequence frame that ends a replay (`-1` as a signed 64-bit big-endian integer).
pub const END_SEQUENCE: [u8; 8] = [0xff; 8];

/// Deepest msgpack nesting accepted (a batch is 4 levels deep; strings count one more).
const MAX_DEPTH: usize = 16;

/// A block hash as published: vLLM's integer form or the hash's raw bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireHash {
    Int(u64),
    Bytes(Vec<u8>),
}

impl WireHash {
    /// The conductor's key of this hash: the integer itself, or the bytes' last 8 read
    /// big-endian (which is what the integer form is).
    pub fn key(&self) -> u64 {
        match self {
            WireHash::Int(v) => *v,
            WireHash::Bytes(b) => kvpool_core::sched::u64_of_hash_bytes(b),
        }
    }
}

/// One KV cache event.
#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    /// Blocks entered the engine's cache (`block_hashes` in order, each the child of the one
    /// before, the first the child of `parent`).
    BlockStored {
        block_hashes: Vec<WireHash>,
        parent: Option<WireHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<i64>,
        lora_name: Option<String>,
        /// Where the blocks live (`GPU`, `CPU`, `DISK`...); none means the engine's device.
        medium: Option<String>,
        /// KV cache group (hybrid models), when published.
        group_idx: Option<u32>,
    },
    /// Blocks left the engine's cache.
    BlockRemoved {
        block_hashes: Vec<WireHash>,
        medium: Option<String>,
        group_idx: Option<u32>,
    },
    /// The engine dropped its whole cache (a prefix-cache reset).
    AllBlocksCleared,
}

/// One published batch of events.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    /// Seconds since the epoch, the publisher's clock.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    /// The data-parallel rank that published it, when the engine runs several.
    pub data_parallel_rank: Option<u32>,
}

impl EventBatch {
    /// A batch stamped with the current time, as publishers send them.
    pub fn now(events: Vec<KvEvent>) -> Self {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        Self {
            ts,
            events,
            data_parallel_rank: None,
        }
    }
}

/// Which event encoding to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    /// Positional arrays tagged by their first element (vLLM's `array_like` structs).
    Array,
    /// Maps with a `"type"` key.
    Map,
}

/// What is wrong with a payload.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum EventError {
    #[error("not msgpack: {0}")]
    Msgpack(String),
    #[error("{0}")]
    Shape(String),
}

fn shape(msg: impl Into<String>) -> EventError {
    EventError::Shape(msg.into())
}

/// Decodes one payload (a msgpack `EventBatch`).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, EventError> {
    let mut rd = payload;
    let v = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| EventError::Msgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(shape(format!("{} bytes after the batch", rd.len())));
    }
    let Value::Array(items) = v else {
        return Err(shape(
            "a batch is an array [ts, events, data_parallel_rank]",
        ));
    };
    let ts = match items.first() {
        Some(Value::F64(t)) => *t,
        Some(Value::F32(t)) => f64::from(*t),
        Some(Value::Integer(i)) => i.as_f64().unwrap_or(0.0),
        _ => return Err(shape("batch[0] (ts) is not a number")),
    };
    let Some(Value::Array(raw)) = items.get(1) else {
        return Err(shape("batch[1] (events) is not an array"));
    };
    let data_parallel_rank = match items.get(2) {
        None | Some(Value::Nil) => None,
        Some(v) => Some(small_uint(v, "data_parallel_rank")?),
    };
    let events = raw
        .iter()
        .enumerate()
        .map(|(i, e)| decode_event(e).map_err(|err| shape(format!("event {i}: {err}"))))
        .collect::<Result<_, _>>()?;
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

/// Field access over either encoding: by position (after the tag) or by name.
enum Fields<'a> {
    Positional(&'a [Value]),
    Named(&'a [(Value, Value)]),
}

impl<'a> Fields<'a> {
    fn get(&self, pos: usize, name: &str) -> Option<&'a Value> {
        let v = match self {
            Fields::Positional(items) => items.get(pos),
            Fields::Named(pairs) => pairs
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v),
        };
        v.filter(|v| !v.is_nil())
    }

    /// The field at `pos` or `name` read by `read`, or `None` when the field is absent or nil.
    fn optional<T>(
        &self,
        pos: usize,
        name: &str,
        read: fn(&Value, &str) -> Result<T, EventError>,
    ) -> Result<Option<T>, EventError> {
        self.get(pos, name).map(|v| read(v, name)).transpose()
    }
}

fn decode_event(v: &Value) -> Result<KvEvent, EventError> {
    let (kind, fields) = match v {
        Value::Array(items) => match items.split_first() {
            Some((tag, rest)) => (tag.as_str(), Fields::Positional(rest)),
            None => return Err(shape("empty event array")),
        },
        Value::Map(pairs) => {
            let kind = pairs
                .iter()
                .find(|(k, _)| k.as_str() == Some("type"))
                .and_then(|(_, v)| v.as_str());
            (kind, Fields::Named(pairs))
        }
        _ => return Err(shape("an event is an array or a map")),
    };
    match kind {
        Some("BlockStored") => {
            let block_hashes = hashes(fields.get(0, "block_hashes"), "block_hashes")?;
            let parent = fields.optional(1, "parent_block_hash", hash)?;
            let token_ids = match fields.get(2, "token_ids") {
                None => Vec::new(),
                Some(Value::Array(ts)) => ts
                    .iter()
                    .map(|t| small_uint(t, "token_ids"))
                    .collect::<Result<_, _>>()?,
                Some(_) => return Err(shape("token_ids is not an array")),
            };
            let block_size = match fields.get(3, "block_size") {
                Some(v) => small_uint(v, "block_size")?,
                None => return Err(shape("BlockStored without block_size")),
            };
            // Fields are read in wire order, so the first bad one is the one reported.
            Ok(KvEvent::BlockStored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                lora_id: fields.get(4, "lora_id").and_then(Value::as_i64),
                medium: fields.optional(5, "medium", text)?,
                lora_name: fields.optional(6, "lora_name", text)?,
                group_idx: fields.optional(8, "group_idx", small_uint)?,
            })
        }
        Some("BlockRemoved") => Ok(KvEvent::BlockRemoved {
            block_hashes: hashes(fields.get(0, "block_hashes"), "block_hashes")?,
            medium: fields.optional(1, "medium", text)?,
            group_idx: fields.optional(2, "group_idx", small_uint)?,
        }),
        Some("AllBlocksCleared") => Ok(KvEvent::AllBlocksCleared),
        Some(other) => Err(shape(format!("unknown event type {other:?}"))),
        None => Err(shape("event without a type")),
    }
}

fn hash(v: &Value, what: &str) -> Result<WireHash, EventError> {
    match v {
        Value::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => Ok(WireHash::Int(u)),
            // A signed 64-bit form of the same bits (some publishers use it).
            (None, Some(s)) => Ok(WireHash::Int(s as u64)),
            _ => Err(shape(format!("{what}: integer out of range"))),
        },
        Value::Binary(b) if !b.is_empty() && b.len() <= 64 => Ok(WireHash::Bytes(b.clone())),
        _ => Err(shape(format!("{what}: a hash is an integer or 1-64 bytes"))),
    }
}

fn hashes(v: Option<&Value>, what: &str) -> Result<Vec<WireHash>, EventError> {
    match v {
        Some(Value::Array(items)) => items.iter().map(|h| hash(h, what)).collect(),
        _ => Err(shape(format!("{what} is not an array"))),
    }
}

fn small_uint(v: &Value, what: &str) -> Result<u32, EventError> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| shape(format!("{what}: expected an unsigned 32-bit integer")))
}

fn text(v: &Value, what: &str) -> Result<String, EventError> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| shape(format!("{what}: expected a string")))
}

fn wire_hash(h: &WireHash) -> Value {
    match h {
        WireHash::Int(v) => Value::from(*v),
        WireHash::Bytes(b) => Value::Binary(b.clone()),
    }
}

fn opt<T>(v: &Option<T>, f: impl Fn(&T) -> Value) -> Value {
    v.as_ref().map_or(Value::Nil, f)
}

fn encode_event(e: &KvEvent, enc: Encoding) -> Value {
    let (kind, fields): (&str, Vec<(&str, Value)>) = match e {
        KvEvent::BlockStored {
            block_hashes,
            parent,
            token_ids,
            block_size,
            lora_id,
            lora_name,
            medium,
            group_idx,
        } => (
            "BlockStored",
            vec![
                (
                    "block_hashes",
                    Value::Array(block_hashes.iter().map(wire_hash).collect()),
                ),
                ("parent_block_hash", opt(parent, wire_hash)),
                (
                    "token_ids",
                    Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
                ),
                ("block_size", Value::from(*block_size)),
                ("lora_id", opt(lora_id, |&v| Value::from(v))),
                ("medium", opt(medium, |m| Value::from(m.as_str()))),
                ("lora_name", opt(lora_name, |m| Value::from(m.as_str()))),
                ("extra_keys", Value::Nil),
                ("group_idx", opt(group_idx, |&g| Value::from(g))),
            ],
        ),
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
            group_idx,
        } => (
            "BlockRemoved",
            vec![
                (
                    "block_hashes",
                    Value::Array(block_hashes.iter().map(wire_hash).collect()),
                ),
                ("medium", opt(medium, |m| Value::from(m.as_str()))),
                ("group_idx", opt(group_idx, |&g| Value::from(g))),
            ],
        ),
        KvEvent::AllBlocksCleared => ("AllBlocksCleared", Vec::new()),
    };
    match enc {
        Encoding::Array => {
            let mut items: Vec<Value> = std::iter::once(Value::from(kind))
                .chain(fields.into_iter().map(|(_, v)| v))
                .collect();
            // Trailing defaults are omitted, as msgspec's omit_defaults does.
            while items.len() > 1 && items.last().is_some_and(Value::is_nil) {
                items.pop();
            }
            Value::Array(items)
        }
        Encoding::Map => Value::Map(
            std::iter::once((Value::from("type"), Value::from(kind)))
                .chain(
                    fields
                        .into_iter()
                        .filter(|(_, v)| !v.is_nil())
                        .map(|(k, v)| (Value::from(k), v)),
                )
                .collect(),
        ),
    }
}

/// Encodes a batch in `enc` form.
pub fn encode_batch(batch: &EventBatch, enc: Encoding) -> Vec<u8> {
    let mut items = vec![
        Value::F64(batch.ts),
        Value::Array(batch.events.iter().map(|e| encode_event(e, enc)).collect()),
    ];
    if let Some(r) = batch.data_parallel_rank {
        items.push(Value::from(r));
    }
    let mut out = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &Value::Array(items));
    out
}

/// Decodes a sequence frame (8 bytes, big-endian; vLLM counts from 0).
pub fn decode_sequence(frame: &[u8]) -> Result<u64, EventError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| shape(format!("a sequence frame is 8 bytes, not {}", frame.len())))?;
    Ok(u64::from_be_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64], medium: Option<&str>) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.iter().map(|&h| WireHash::Int(h)).collect(),
            parent: Some(WireHash::Int(7)),
            token_ids: vec![1, 2, 3, 4],
            block_size: 2,
            lora_id: None,
            lora_name: None,
            medium: medium.map(str::to_owned),
            group_idx: None,
        }
    }

    #[test]
    fn both_encodings_round_trip() {
        let batch = EventBatch {
            ts: 1.5,
            events: vec![
                stored(&[10, 11], Some("GPU")),
                KvEvent::BlockRemoved {
                    block_hashes: vec![WireHash::Bytes(vec![0xab; 32])],
                    medium: None,
                    group_idx: Some(1),
                },
                KvEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(1),
        };
        for enc in [Encoding::Array, Encoding::Map] {
            assert_eq!(decode_batch(&encode_batch(&batch, enc)), Ok(batch.clone()));
        }
    }

    #[test]
    fn array_form_omits_trailing_defaults_and_decodes_without_them() {
        let bytes = encode_batch(
            &EventBatch {
                ts: 0.0,
                events: vec![stored(&[1], None)],
                data_parallel_rank: None,
            },
            Encoding::Array,
        );
        let v = rmpv::decode::read_value(&mut &bytes[..]).expect("msgpack");
        let ev = &v.as_array().expect("batch")[1].as_array().expect("events")[0];
        // tag, block_hashes, parent, token_ids, block_size: lora_id and later omitted.
        assert_eq!(ev.as_array().expect("event").len(), 5);
    }

    #[test]
    fn bad_payloads_name_what_is_wrong() {
        assert!(matches!(
            decode_batch(b"\x92\x01"),
            Err(EventError::Msgpack(_))
        ));
        let not_batch = encode_value(Value::from(3));
        assert!(decode_batch(&not_batch).is_err());
        let unknown = encode_value(Value::Array(vec![
            Value::F64(0.0),
            Value::Array(vec![Value::Array(vec![Value::from("Exploded")])]),
        ]));
        let err = decode_batch(&unknown).expect_err("unknown type");
        assert!(err.to_string().contains("Exploded"), "{err}");
        let no_size = encode_value(Value::Array(vec![
            Value::F64(0.0),
            Value::Array(vec![Value::Array(vec![
                Value::from("BlockStored"),
                Value::Array(vec![Value::from(1)]),
            ])]),
        ]));
        assert!(
            decode_batch(&no_size)
                .expect_err("no block size")
                .to_string()
                .contains("block_size")
        );
        // Deep nesting is refused, not recursed into.
        let mut deep = Value::Nil;
        for _ in 0..64 {
            deep = Value::Array(vec![deep]);
        }
        assert!(decode_batch(&encode_value(deep)).is_err());
        assert!(decode_sequence(&[1, 2, 3]).is_err());
        assert_eq!(decode_sequence(&5u64.to_be_bytes()), Ok(5));
    }

    #[test]
    fn byte_hashes_key_by_their_last_eight_bytes() {
        let mut b = vec![0u8; 32];
        b[31] = 9;
        assert_eq!(WireHash::Bytes(b).key(), 9);
        assert_eq!(WireHash::Int(42).key(), 42);
    }

    fn encode_value(v: Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &v).expect("vec");
        out
    }
}

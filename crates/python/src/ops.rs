//! The store's calls, as async functions over a live connection: puts and gets of caller
//! bytes and of registered memory, batches of them (registered memory, one or several ranges
//! per value: one master call and one transfer batch per batch, see `PoolClient::
//! put_many_from`; caller bytes: run concurrently, the master client coalescing their master
//! calls), existence, sizes and removal. I/O boundary: the pool client's master and transfer
//! calls.

use std::time::Duration;

use futures::future::join_all;

use kvpool_core::master::types::PutOptions;

use kvpool_client::pool::BatchItem;

use crate::buffers::Span;
use crate::client::Live;
use crate::errors::{Failure, Kind};

/// Keys, each with the registered ranges its value spans (Mooncake's multi-buffer calls).
pub type PartsItems = [(Vec<u8>, Vec<(usize, u64)>)];

/// Placement and pinning of a put (Mooncake's `ReplicateConfig`).
#[derive(Clone, Debug, Default)]
pub struct PutArgs {
    pub replicas: u8,
    /// Node whose segments take the first replica (Mooncake's `preferred_segment`, the
    /// `get_hostname()` of the process that contributes it).
    pub preferred: Option<String>,
    pub hard_pin: bool,
    pub soft_pin_ttl_ms: u64,
}

impl PutArgs {
    /// The put's options, its pin included: the master pins the object from its commit on,
    /// so no eviction can come between the commit and the pin (a pin sent after the put could
    /// find the object already evicted on a full pool).
    fn options(&self) -> PutOptions {
        PutOptions {
            replicas: self.replicas.max(1),
            writer_node: self.preferred.clone(),
            hard_pin: self.hard_pin,
            soft_pin_ttl_ms: if self.hard_pin {
                0
            } else {
                self.soft_pin_ttl_ms
            },
            ..PutOptions::default()
        }
    }
}

/// A put of a key already committed succeeds and keeps the first value, whatever its size
/// (the master refuses a different size; Mooncake answers success either way).
fn committed(r: Result<(), kvpool_client::pool::DataError>) -> Result<(), Failure> {
    match r.map_err(Failure::from) {
        Err(f) if f.kind == Kind::Exists => Ok(()),
        other => other,
    }
}

/// Keys of puts must not be empty.
fn check_key(key: &[u8]) -> Result<(), Failure> {
    if key.is_empty() {
        return Err(Failure::invalid("the key is empty"));
    }
    Ok(())
}

/// Store `value` under `key` (copied once into registered staging memory). Empty values are
/// refused.
pub async fn put(live: &Live, key: &[u8], value: &[u8], args: &PutArgs) -> Result<(), Failure> {
    check_key(key)?;
    if value.is_empty() {
        return Err(Failure::invalid("the value is empty"));
    }
    committed(live.pool.put(key, value, &args.options()).await.map(|_| ()))
}

/// Store `len` bytes at `ptr`, inside a registered buffer, with no copy. A put of 0 bytes
/// succeeds and stores nothing, as Mooncake's does.
pub async fn put_from(
    live: &Live,
    key: &[u8],
    ptr: usize,
    len: u64,
    args: &PutArgs,
) -> Result<(), Failure> {
    check_key(key)?;
    if len == 0 {
        return Ok(());
    }
    let span = live.buffers.lock().span(ptr, len)?;
    committed(
        live.pool
            .put_from(key, &span.local, span.offset, span.len, &args.options())
            .await
            .map(|_| ()),
    )
}

/// The value of `key`.
pub async fn get(live: &Live, key: &[u8]) -> Result<Vec<u8>, Failure> {
    Ok(live.pool.get(key).await?)
}

/// Read the value of `key` into `out`; its length.
pub async fn get_into_slice(live: &Live, key: &[u8], out: &mut [u8]) -> Result<u64, Failure> {
    Ok(live.pool.get_into(key, out).await? as u64)
}

/// Read the value of `key` into the `len` bytes at `ptr`, inside a registered buffer, with no
/// copy; its length.
pub async fn get_into(live: &Live, key: &[u8], ptr: usize, len: u64) -> Result<u64, Failure> {
    let span = live.buffers.lock().span(ptr, len)?;
    Ok(live
        .pool
        .get_to_within(key, &span.local, span.offset, span.len)
        .await?)
}

/// One result per item of a batch: the value's length (gets), 0 (puts), or Mooncake's code.
pub fn code_of(r: Result<u64, Failure>) -> i64 {
    match r {
        Ok(n) => i64::try_from(n).unwrap_or(i64::MAX),
        Err(f) => f.code(),
    }
}

/// Puts of registered memory in one batch (one master call allocates them, one transfer
/// batch writes them, one master call commits them; see `PoolClient::put_many_from`): one
/// code per item (0 or negative).
pub async fn batch_put_from(
    live: &Live,
    items: &[(Vec<u8>, usize, u64)],
    args: &PutArgs,
) -> Vec<i64> {
    let mut codes: Vec<Option<i64>> = vec![None; items.len()];
    let mut spans = Vec::with_capacity(items.len());
    {
        let buffers = live.buffers.lock();
        for (i, (key, ptr, len)) in items.iter().enumerate() {
            let span = if *len == 0 {
                Err(Failure::invalid("the value is empty"))
            } else {
                check_key(key).and_then(|()| buffers.span(*ptr, *len))
            };
            match span {
                Ok(s) => spans.push((i, s)),
                Err(f) => codes[i] = Some(code_of(Err(f))),
            }
        }
    }
    let batch: Vec<_> = spans
        .iter()
        .map(|(i, s)| BatchItem::one(&items[*i].0, &s.local, s.offset, s.len))
        .collect();
    let done = live.pool.put_many_from(&batch, &args.options()).await;
    for ((i, _), r) in spans.iter().zip(done) {
        codes[*i] = Some(code_of(committed(r).map(|()| 0)));
    }
    codes.into_iter().map(|c| c.unwrap_or(-1)).collect()
}

/// Gets into registered memory in one batch (one master call locates them, one transfer
/// batch reads them; see `PoolClient::get_many_to`): per item the length read or a negative
/// code.
pub async fn batch_get_into(live: &Live, items: &[(Vec<u8>, usize, u64)]) -> Vec<i64> {
    let mut codes: Vec<Option<i64>> = vec![None; items.len()];
    let mut spans = Vec::with_capacity(items.len());
    {
        let buffers = live.buffers.lock();
        for (i, (_, ptr, len)) in items.iter().enumerate() {
            match buffers.span(*ptr, *len) {
                Ok(s) => spans.push((i, s)),
                Err(f) => codes[i] = Some(code_of(Err(f))),
            }
        }
    }
    let batch: Vec<_> = spans
        .iter()
        .map(|(i, s)| BatchItem::one(&items[*i].0, &s.local, s.offset, s.len))
        .collect();
    let done = live.pool.get_many_to(&batch).await;
    for ((i, _), r) in spans.iter().zip(done) {
        codes[*i] = Some(code_of(r.map_err(Failure::from)));
    }
    codes.into_iter().map(|c| c.unwrap_or(-1)).collect()
}

/// The registered ranges of each key's value, checked (a put's key and ranges must not be
/// empty): per key its spans, or the code it fails with.
fn parts_spans(live: &Live, items: &PartsItems, put: bool) -> Vec<Result<Vec<Span>, i64>> {
    let buffers = live.buffers.lock();
    items
        .iter()
        .map(|(key, parts)| {
            if put {
                check_key(key).map_err(|f| f.code())?;
            }
            if put && (parts.is_empty() || parts.iter().any(|(_, len)| *len == 0)) {
                return Err(Failure::invalid(
                    "a value in registered ranges needs ranges of 1 byte or more",
                )
                .code());
            }
            buffers.spans(parts).map_err(|f| f.code())
        })
        .collect()
}

/// The batch items of `items` whose ranges checked out; `parts`: per item, the offset of the
/// value its ranges start at (a get of part of each value).
fn parts_batch<'a>(
    items: &'a PartsItems,
    spans: &'a [Result<Vec<Span>, i64>],
    parts: Option<&[u64]>,
) -> Vec<BatchItem<'a>> {
    items
        .iter()
        .zip(spans)
        .enumerate()
        .filter_map(|(i, ((key, _), s))| {
            let s = s.as_ref().ok()?;
            Some(BatchItem {
                key,
                ranges: s.iter().map(|s| (&s.local, s.offset, s.len)).collect(),
                part: parts.and_then(|p| p.get(i).copied()),
            })
        })
        .collect()
}

/// Puts of values spread over registered ranges, in one batch (see [`batch_put_from`]); the
/// ranges go straight from the caller's memory, no copy: one code per key.
pub async fn batch_put_parts(live: &Live, items: &PartsItems, args: &PutArgs) -> Vec<i64> {
    let spans = parts_spans(live, items, true);
    let batch = parts_batch(items, &spans, None);
    let mut done = live
        .pool
        .put_many_from(&batch, &args.options())
        .await
        .into_iter();
    spans
        .iter()
        .map(|s| match s {
            Err(code) => *code,
            Ok(_) => code_of(committed(done.next().unwrap_or(Ok(()))).map(|()| 0)),
        })
        .collect()
}

/// Gets of values into registered ranges, in one batch (see [`batch_get_into`]); straight
/// into the caller's memory: per key the length read or a negative code. As Mooncake's, the
/// ranges must add up to the value exactly (the memory is untouched otherwise); with `parts`
/// (one value offset per key) each reads only its ranges' bytes from that offset of the value
/// on, which the value must hold.
pub async fn batch_get_parts(live: &Live, items: &PartsItems, parts: Option<&[u64]>) -> Vec<i64> {
    let spans = parts_spans(live, items, false);
    let batch = parts_batch(items, &spans, parts);
    let mut done = live.pool.get_many_to(&batch).await.into_iter();
    spans
        .iter()
        .map(|s| match s {
            Err(code) => *code,
            Ok(_) => code_of(done.next().unwrap_or(Ok(0)).map_err(parts_failure)),
        })
        .collect()
}

/// A failed get into several ranges: a value smaller than the ranges is Mooncake's transfer
/// failure.
fn parts_failure(e: kvpool_client::pool::DataError) -> Failure {
    match e {
        kvpool_client::pool::DataError::SizeMismatch { got, want } => Failure::new(
            Kind::TransferFailed,
            format!("the ranges hold {want} bytes, the value {got}: they must match"),
        ),
        e @ kvpool_client::pool::DataError::OutsideValue { .. } => {
            Failure::new(Kind::InvalidArgument, e.to_string())
        }
        other => Failure::from(other),
    }
}

/// Puts of several values, concurrently.
pub async fn batch_put(
    live: &Live,
    items: &[(Vec<u8>, &[u8])],
    args: &PutArgs,
) -> Vec<Result<(), Failure>> {
    join_all(
        items
            .iter()
            .map(|(key, value)| async move { put(live, key, value, args).await }),
    )
    .await
}

/// Gets of several values, concurrently.
pub async fn batch_get(live: &Live, keys: &[Vec<u8>]) -> Vec<Result<Vec<u8>, Failure>> {
    join_all(keys.iter().map(|key| async move { get(live, key).await })).await
}

/// Whether each key is stored (an empty key never is).
pub async fn exists(live: &Live, keys: &[Vec<u8>]) -> Result<Vec<bool>, Failure> {
    let refs: Vec<&[u8]> = keys
        .iter()
        .filter(|k| !k.is_empty())
        .map(Vec::as_slice)
        .collect();
    let mut answers = if refs.is_empty() {
        Vec::new()
    } else {
        live.pool.master().exists(&refs).await?
    }
    .into_iter();
    if answers.len() != refs.len() {
        return Err(Failure::new(
            Kind::Internal,
            format!(
                "the master answered {} of {} keys",
                answers.len(),
                refs.len()
            ),
        ));
    }
    Ok(keys
        .iter()
        .map(|k| !k.is_empty() && answers.next().unwrap_or(false))
        .collect())
}

/// The size of the value of `key` (a striped object's whole size).
pub async fn size(live: &Live, key: &[u8]) -> Result<u64, Failure> {
    Ok(live.pool.value_size(key).await?)
}

/// How long a forced removal waits for the reads in flight to end.
const FORCE_WAIT: Duration = Duration::from_secs(15);
/// Pause between the attempts of a forced removal.
const FORCE_PAUSE: Duration = Duration::from_millis(20);

/// Remove `key` (a striped object with its parts). A reader's lease refuses the removal;
/// `force` waits for the reads in flight to end instead (kvpool never frees memory under a
/// reader), up to [`FORCE_WAIT`].
pub async fn remove(live: &Live, key: &[u8], force: bool) -> Result<(), Failure> {
    let deadline = tokio::time::Instant::now() + FORCE_WAIT;
    loop {
        live.pool.flush_releases().await;
        match live.pool.remove(key).await.map_err(Failure::from) {
            Err(f) if force && f.kind == Kind::Leased && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(FORCE_PAUSE).await;
            }
            other => return other,
        }
    }
}

/// Remove every object no reader holds a lease on; how many were removed. With `force`,
/// passes repeat until one removes nothing, so objects whose reads were in flight go too.
pub async fn remove_all(live: &Live, force: bool) -> Result<u64, Failure> {
    let mut removed = live.pool.master().remove_all().await?;
    if force {
        loop {
            tokio::time::sleep(FORCE_PAUSE).await;
            let more = live.pool.master().remove_all().await?;
            if more == 0 {
                break;
            }
            removed += more;
        }
    }
    Ok(removed)
}

/// Whether the master answers.
pub async fn health(live: &Live) -> Result<(), Failure> {
    live.pool.master().stats().await?;
    Ok(())
}

/// Keys with their ranges, checked: one list of addresses and one of sizes per key, of one
/// length each.
pub fn parts(
    keys: Vec<crate::Key>,
    all_ptrs: Vec<Vec<usize>>,
    all_sizes: Vec<Vec<u64>>,
) -> Result<Vec<crate::PartsItem>, Failure> {
    crate::same_length(keys.len(), all_ptrs.len(), all_sizes.len())?;
    keys.into_iter()
        .zip(all_ptrs.into_iter().zip(all_sizes))
        .map(|(k, (ptrs, sizes))| {
            if ptrs.len() != sizes.len() {
                return Err(Failure::invalid(format!(
                    "{} addresses and {} sizes for one key: they must pair up",
                    ptrs.len(),
                    sizes.len()
                )));
            }
            Ok((k.into_bytes(), ptrs.into_iter().zip(sizes).collect()))
        })
        .collect()
}

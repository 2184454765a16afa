//! The store's calls, as async functions over a live connection: puts and gets of caller
//! bytes and of registered memory, batches of them (run concurrently; the master client
//! coalesces their master calls), existence, sizes and removal. I/O boundary: the pool
//! client's master and transfer calls.

use std::time::Duration;

use futures::future::join_all;

use kvpool_core::master::types::PutOptions;

use crate::client::Live;
use crate::errors::{Failure, Kind};

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
    fn options(&self) -> PutOptions {
        PutOptions {
            replicas: self.replicas.max(1),
            writer_node: self.preferred.clone(),
            ..PutOptions::default()
        }
    }
}

/// Pin `key` as `args` asks, after its put committed.
async fn pin(live: &Live, key: &[u8], args: &PutArgs) -> Result<(), Failure> {
    let (hard, ttl) = if args.hard_pin {
        (true, Duration::ZERO)
    } else if args.soft_pin_ttl_ms > 0 {
        (false, Duration::from_millis(args.soft_pin_ttl_ms))
    } else {
        return Ok(());
    };
    let results = live.pool.master().pin(&[key], hard, ttl).await?;
    results
        .into_iter()
        .next()
        .unwrap_or(Ok(()))
        .map_err(Failure::from)
}

/// Store `value` under `key` (copied once into registered staging memory).
pub async fn put(live: &Live, key: &[u8], value: &[u8], args: &PutArgs) -> Result<(), Failure> {
    live.pool.put(key, value, &args.options()).await?;
    pin(live, key, args).await
}

/// Store `len` bytes at `ptr`, inside a registered buffer, with no copy.
pub async fn put_from(
    live: &Live,
    key: &[u8],
    ptr: usize,
    len: u64,
    args: &PutArgs,
) -> Result<(), Failure> {
    let span = live.buffers.lock().span(ptr, len)?;
    live.pool
        .put_from(key, &span.local, span.offset, span.len, &args.options())
        .await?;
    pin(live, key, args).await
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
fn code_of(r: Result<u64, Failure>) -> i64 {
    match r {
        Ok(n) => i64::try_from(n).unwrap_or(i64::MAX),
        Err(f) => f.code(),
    }
}

/// Puts of registered memory, concurrently: one code per item (0 or negative).
pub async fn batch_put_from(
    live: &Live,
    items: &[(Vec<u8>, usize, u64)],
    args: &PutArgs,
) -> Vec<i64> {
    let calls = items.iter().map(|(key, ptr, len)| async move {
        code_of(put_from(live, key, *ptr, *len, args).await.map(|()| 0))
    });
    join_all(calls).await
}

/// Gets into registered memory, concurrently: per item the length read or a negative code.
pub async fn batch_get_into(live: &Live, items: &[(Vec<u8>, usize, u64)]) -> Vec<i64> {
    let calls = items
        .iter()
        .map(|(key, ptr, len)| async move { code_of(get_into(live, key, *ptr, *len).await) });
    join_all(calls).await
}

/// Store the concatenation of several registered ranges under `key`. One range goes
/// straight from the caller's memory; several are gathered into one staging copy first.
pub async fn put_parts(
    live: &Live,
    key: &[u8],
    parts: &[(usize, u64)],
    args: &PutArgs,
) -> Result<(), Failure> {
    if let [(ptr, len)] = parts {
        return put_from(live, key, *ptr, *len, args).await;
    }
    let spans = {
        let buffers = live.buffers.lock();
        parts
            .iter()
            .map(|(p, l)| buffers.span(*p, *l))
            .collect::<Result<Vec<_>, _>>()?
    };
    let total: u64 = spans.iter().map(|s| s.len).sum();
    let mut value = vec![0u8; usize::try_from(total).map_err(|_| too_large(total))?];
    let mut at = 0usize;
    for s in &spans {
        let n = s.len as usize;
        s.local
            .segment()
            .read_at(s.offset, &mut value[at..at + n])
            .map_err(|e| Failure::invalid(format!("reading a registered range: {e}")))?;
        at += n;
    }
    put(live, key, &value, args).await
}

/// Read the value of `key` across several registered ranges, in order; its length. One range
/// is read into directly; several through one staging copy.
pub async fn get_parts(live: &Live, key: &[u8], parts: &[(usize, u64)]) -> Result<u64, Failure> {
    if let [(ptr, len)] = parts {
        return get_into(live, key, *ptr, *len).await;
    }
    let spans = {
        let buffers = live.buffers.lock();
        parts
            .iter()
            .map(|(p, l)| buffers.span(*p, *l))
            .collect::<Result<Vec<_>, _>>()?
    };
    let room: u64 = spans.iter().map(|s| s.len).sum();
    let size = live.pool.master().get(key).await.map(|l| {
        live.pool.master().release_lease_later(l.lease_id);
        l.size
    })?;
    if size > room {
        return Err(Failure::new(
            Kind::BufferTooSmall,
            format!("a value of {size} bytes does not fit the {room} bytes of the ranges"),
        ));
    }
    let value = get(live, key).await?;
    let mut rest = value.as_slice();
    for s in &spans {
        if rest.is_empty() {
            break;
        }
        let n = rest.len().min(s.len as usize);
        s.local
            .segment()
            .write_at(s.offset, &rest[..n])
            .map_err(|e| Failure::invalid(format!("writing a registered range: {e}")))?;
        rest = &rest[n..];
    }
    if !rest.is_empty() {
        return Err(Failure::new(
            Kind::BufferTooSmall,
            format!(
                "a value of {} bytes does not fit the {room} bytes of the ranges",
                value.len()
            ),
        ));
    }
    Ok(value.len() as u64)
}

fn too_large(total: u64) -> Failure {
    Failure::invalid(format!("{total} bytes do not fit in memory"))
}

/// [`put_parts`] of several keys, concurrently: one code per key.
pub async fn batch_put_parts(
    live: &Live,
    items: &[(Vec<u8>, Vec<(usize, u64)>)],
    args: &PutArgs,
) -> Vec<i64> {
    let calls = items.iter().map(|(key, parts)| async move {
        code_of(put_parts(live, key, parts, args).await.map(|()| 0))
    });
    join_all(calls).await
}

/// [`get_parts`] of several keys, concurrently: per key the length read or a negative code.
pub async fn batch_get_parts(live: &Live, items: &[(Vec<u8>, Vec<(usize, u64)>)]) -> Vec<i64> {
    let calls = items
        .iter()
        .map(|(key, parts)| async move { code_of(get_parts(live, key, parts).await) });
    join_all(calls).await
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

/// Whether each key is stored.
pub async fn exists(live: &Live, keys: &[Vec<u8>]) -> Result<Vec<bool>, Failure> {
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let present = live.pool.master().exists(&refs).await?;
    if present.len() != keys.len() {
        return Err(Failure::new(
            Kind::Internal,
            format!(
                "the master answered {} of {} keys",
                present.len(),
                keys.len()
            ),
        ));
    }
    Ok(present)
}

/// The size of the value of `key` (a striped object's whole size).
pub async fn size(live: &Live, key: &[u8]) -> Result<u64, Failure> {
    let master = live.pool.master();
    let located = master.get(key).await?;
    master.release_lease_later(located.lease_id);
    if located.size == kvpool_client::pool::MANIFEST_LEN as u64 {
        // Could be a striped object's manifest: only its bytes tell.
        let value = live.pool.get(key).await;
        if let Ok(v) = value {
            if let Some(m) = kvpool_client::pool::Manifest::decode(key, &v) {
                return Ok(m.total);
            }
        }
    }
    Ok(located.size)
}

/// Remove `key` (a striped object with its parts).
pub async fn remove(live: &Live, key: &[u8]) -> Result<(), Failure> {
    live.pool.flush_releases().await;
    Ok(live.pool.remove(key).await?)
}

/// Remove every object no reader holds a lease on; how many were removed.
pub async fn remove_all(live: &Live) -> Result<u64, Failure> {
    Ok(live.pool.master().remove_all().await?)
}

/// Whether the master answers.
pub async fn health(live: &Live) -> Result<(), Failure> {
    live.pool.master().stats().await?;
    Ok(())
}

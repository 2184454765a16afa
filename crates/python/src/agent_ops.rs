//! The store's calls in agent mode, over the engine API: every call is one put or get RPC
//! naming ranges of the session's staging area (a batch is one RPC, or one per group of items
//! whose bytes fit the staging space a call takes at once). Bytes from Python and registered
//! memory are copied once into a staging range the call takes from the arena; memory that
//! `alloc_buffer` handed out already lies in the staging area and moves with no copy. Gets land
//! in staging and are copied out once, or in place for `alloc_buffer` memory. I/O boundary:
//! the agent's RPCs and the staging copies (both in `agent`).

use std::time::Duration;

use kvpool_proto::engine_api::{GetItem, PutItem, Status};

use crate::agent::{Agent, MAX_BATCH, Place, status_failure};
use crate::errors::{Failure, Kind};
use crate::ops::PutArgs;
use crate::staging::{ALIGN, Range};

/// Where the bytes of one put come from.
pub enum Src<'a> {
    /// Already in staging, at this offset (alloc_buffer memory).
    Staged(u64, u64),
    /// Copied in from these pieces, concatenated.
    Copy(Vec<Piece<'a>>),
}

/// A piece of a value to copy into staging.
pub enum Piece<'a> {
    Bytes(&'a [u8]),
    /// Caller memory at an address checked by `Agent::place`, or an alloc_buffer range.
    Raw(Place, u64),
}

impl Src<'_> {
    fn len(&self) -> u64 {
        match self {
            Src::Staged(_, len) => *len,
            Src::Copy(pieces) => pieces.iter().map(Piece::len).sum(),
        }
    }

    /// Staging bytes this put takes for its copy.
    fn room(&self) -> u64 {
        match self {
            Src::Staged(..) => 0,
            Src::Copy(_) => self.len().max(1).next_multiple_of(ALIGN),
        }
    }
}

impl Piece<'_> {
    fn len(&self) -> u64 {
        match self {
            Piece::Bytes(b) => b.len() as u64,
            Piece::Raw(_, len) => *len,
        }
    }
}

/// Where the value of one get goes.
pub enum Dst {
    /// In place, at this staging offset, with this room (alloc_buffer memory).
    Staged(u64, u64),
    /// Copied out to these places in order; `exact`: the value must fill them (Mooncake's
    /// multi-buffer gets), else it may be shorter.
    Copy(Vec<(Place, u64)>, bool),
    /// Returned as bytes; the room to try first.
    Bytes(u64),
}

/// What a get gave: the value's length, and its bytes for [`Dst::Bytes`].
pub type Got = (u64, Option<Vec<u8>>);

impl Dst {
    fn cap(&self) -> u64 {
        match self {
            Dst::Staged(_, cap) | Dst::Bytes(cap) => *cap,
            Dst::Copy(places, _) => places.iter().map(|(_, n)| n).sum(),
        }
    }

    fn room(&self) -> u64 {
        match self {
            Dst::Staged(..) => 0,
            _ => self.cap().max(1).next_multiple_of(ALIGN),
        }
    }
}

/// A failure for each of several items.
fn copy_failure(f: &Failure) -> Failure {
    Failure::new(f.kind, f.message.clone())
}

/// Keys of puts must not be empty.
fn check_key(key: &[u8]) -> Result<(), Failure> {
    if key.is_empty() {
        return Err(Failure::invalid("the key is empty"));
    }
    Ok(())
}

/// The agent places every put (its own replica count, its node first) and pins nothing.
pub fn check_args(args: &PutArgs) -> Result<(), Failure> {
    if args.hard_pin || args.soft_pin_ttl_ms > 0 {
        return Err(Failure::new(
            Kind::NotSupported,
            "pinning is not offered in agent mode (the engine API has no pins); use \
             mode=\"direct\"",
        ));
    }
    Ok(())
}

/// The checks of one put of a batch, before any byte moves: [`check_args`], and a key given.
pub fn check_put(key: &[u8], args: &PutArgs) -> Result<(), Failure> {
    check_args(args)?;
    check_key(key)
}

/// Staging bytes one RPC of a batch takes at most (so concurrent calls share the area).
fn group_room(a: &Agent) -> u64 {
    (a.arena.size() / 4).max(ALIGN)
}

/// Items `0..n`, cut into runs whose rooms fit [`group_room`] (an item larger than that runs
/// alone) and of at most [`MAX_BATCH`] items.
fn groups(a: &Agent, rooms: &[u64]) -> Vec<std::ops::Range<usize>> {
    let cap = group_room(a);
    let mut out = Vec::new();
    let (mut start, mut sum) = (0, 0u64);
    for (i, room) in rooms.iter().enumerate() {
        if i > start && (sum + room > cap || i - start >= MAX_BATCH) {
            out.push(start..i);
            (start, sum) = (i, 0);
        }
        sum += room;
    }
    if start < rooms.len() {
        out.push(start..rooms.len());
    }
    out
}

/// Store each `(key, src)`: one put RPC per group; one result per item.
pub async fn put_all(a: &Agent, items: &[(&[u8], Src<'_>)]) -> Vec<Result<(), Failure>> {
    let rooms: Vec<u64> = items.iter().map(|(_, s)| s.room()).collect();
    by_group(a, items, &rooms, |part, room| put_group(a, part, room)).await
}

/// `run` on each group of `items` (cut by [`groups`] from their `rooms`), one result per item:
/// a group whose call failed as a whole fails each of its items.
async fn by_group<'i, I, T, Fut>(
    a: &Agent,
    items: &'i [I],
    rooms: &[u64],
    run: impl Fn(&'i [I], u64) -> Fut,
) -> Vec<Result<T, Failure>>
where
    Fut: Future<Output = Result<Vec<Result<T, Failure>>, Failure>>,
{
    let mut out = Vec::with_capacity(items.len());
    for g in groups(a, rooms) {
        let part = &items[g.clone()];
        match run(part, rooms[g].iter().sum()).await {
            Ok(results) => out.extend(results),
            Err(f) => out.extend(part.iter().map(|_| Err(copy_failure(&f)))),
        }
    }
    out
}

/// `room` bytes of staging for one group's copies, and where they start; none when the group
/// copies nothing (all its items already lie in staging).
async fn take_room(a: &Agent, room: u64) -> Result<(Option<Range>, u64), Failure> {
    if room == 0 {
        return Ok((None, 0));
    }
    let lease = a.arena.take(room, a.timeout).await?;
    let at = lease.offset;
    Ok((Some(lease), at))
}

async fn put_group(
    a: &Agent,
    items: &[(&[u8], Src<'_>)],
    room: u64,
) -> Result<Vec<Result<(), Failure>>, Failure> {
    let (lease, mut at) = take_room(a, room).await?;
    let mut rpc = Vec::with_capacity(items.len());
    // Per item: the failure of its copy into staging (its caller memory gone, say), which
    // keeps it out of the call and fails it alone.
    let mut staged: Vec<Option<Failure>> = Vec::with_capacity(items.len());
    for (key, src) in items {
        let offset = match src {
            Src::Staged(offset, _) => *offset,
            Src::Copy(pieces) => {
                let start = at;
                at = start + src.room();
                if let Err(f) = stage(a, start, pieces) {
                    staged.push(Some(f));
                    continue;
                }
                start
            }
        };
        staged.push(None);
        rpc.push(PutItem {
            key: key.to_vec(),
            offset,
            length: src.len(),
        });
    }
    let mut statuses = if rpc.is_empty() {
        Vec::new()
    } else {
        a.put_rpc(rpc).await?
    }
    .into_iter();
    drop(lease);
    let mut out = Vec::with_capacity(items.len());
    for ((key, _), failed) in items.iter().zip(staged) {
        // A failed item was not sent: it takes no status.
        if let Some(f) = failed {
            out.push(Err(f));
            continue;
        }
        out.push(match statuses.next() {
            Some(status) => put_outcome(a, key, status).await,
            None => Err(Failure::new(
                Kind::Internal,
                "the agent answered fewer items than were sent",
            )),
        });
    }
    Ok(out)
}

/// Copy a value's pieces into the staging area from `at` on.
fn stage(a: &Agent, mut at: u64, pieces: &[Piece<'_>]) -> Result<(), Failure> {
    for p in pieces {
        match p {
            Piece::Bytes(b) => a.write(at, b)?,
            Piece::Raw(Place::Caller(ptr), n) => a.write_raw(at, *ptr, *n)?,
            Piece::Raw(Place::Staged(off), n) => {
                let mut tmp = vec![0u8; *n as usize];
                a.read(*off, &mut tmp)?;
                a.write(at, &tmp)?;
            }
        }
        at += p.len();
    }
    Ok(())
}

/// A put the agent refused as invalid although its range and key were sound is a re-put of a
/// key already committed with another size: it succeeds and keeps the first value, as in
/// direct mode (and Mooncake).
async fn put_outcome(a: &Agent, key: &[u8], status: Status) -> Result<(), Failure> {
    if status == Status::Invalid && a.exists_rpc(vec![key.to_vec()]).await? == [true] {
        return Ok(());
    }
    status_failure(status, key, 0).map_or(Ok(()), Err)
}

/// Fetch each `(key, dst)`: one get RPC per group; a value larger than a [`Dst::Bytes`]
/// guess is fetched again with its size. One result per item.
pub async fn get_all(a: &Agent, items: &[(&[u8], Dst)]) -> Vec<Result<Got, Failure>> {
    fetch(a, items, true).await
}

async fn fetch(a: &Agent, items: &[(&[u8], Dst)], retry: bool) -> Vec<Result<Got, Failure>> {
    let rooms: Vec<u64> = items.iter().map(|(_, d)| d.room()).collect();
    let mut out = by_group(a, items, &rooms, |part, room| get_group(a, part, room)).await;
    // Values that did not fit the first guess: again, with room for their size.
    let again: Vec<(usize, u64)> = out
        .iter()
        .enumerate()
        .filter_map(|(i, r)| match (r, &items[i].1) {
            (Err(f), Dst::Bytes(_)) if f.kind == Kind::BufferTooSmall => {
                f.message.parse::<u64>().ok().map(|n| (i, n))
            }
            _ => None,
        })
        .collect();
    if again.is_empty() {
        return out;
    }
    if !retry {
        // The value grew between the two gets (removed and put again): report it.
        for (i, n) in again {
            out[i] = Err(Failure::new(
                Kind::Internal,
                format!(
                    "the value of key {:?} changed size ({n} bytes) while being read",
                    String::from_utf8_lossy(items[i].0)
                ),
            ));
        }
        return out;
    }
    let sized: Vec<(&[u8], Dst)> = again
        .iter()
        .map(|(i, n)| (items[*i].0, Dst::Bytes(*n)))
        .collect();
    let results = Box::pin(fetch(a, &sized, false)).await;
    for ((i, _), r) in again.iter().zip(results) {
        out[*i] = r;
    }
    out
}

async fn get_group(
    a: &Agent,
    items: &[(&[u8], Dst)],
    room: u64,
) -> Result<Vec<Result<Got, Failure>>, Failure> {
    let (lease, mut at) = take_room(a, room).await?;
    let mut rpc = Vec::with_capacity(items.len());
    let mut offsets = Vec::with_capacity(items.len());
    for (key, dst) in items {
        let offset = match dst {
            Dst::Staged(offset, _) => *offset,
            _ => {
                let start = at;
                at += dst.room();
                start
            }
        };
        offsets.push(offset);
        rpc.push(GetItem {
            key: key.to_vec(),
            offset,
            capacity: dst.cap(),
        });
    }
    let results = a.get_rpc(rpc).await?;
    let out = items
        .iter()
        .zip(offsets)
        .zip(results)
        .map(|(((key, dst), offset), (status, len))| deliver(a, key, dst, offset, status, len))
        .collect();
    drop(lease);
    Ok(out)
}

/// Hand one fetched value to its destination.
fn deliver(
    a: &Agent,
    key: &[u8],
    dst: &Dst,
    offset: u64,
    status: Status,
    len: u64,
) -> Result<Got, Failure> {
    if status == Status::BufferTooSmall && matches!(dst, Dst::Bytes(_)) {
        // get_all retries with the size, carried in the message.
        return Err(Failure::new(Kind::BufferTooSmall, len.to_string()));
    }
    if let Some(f) = status_failure(status, key, len) {
        return Err(f);
    }
    match dst {
        Dst::Staged(..) => Ok((len, None)),
        Dst::Bytes(_) => {
            let mut value = vec![0u8; usize::try_from(len).unwrap_or(0)];
            a.read(offset, &mut value)?;
            Ok((len, Some(value)))
        }
        Dst::Copy(places, exact) => {
            let room = dst.cap();
            if *exact && len < room {
                return Err(Failure::new(
                    Kind::TransferFailed,
                    format!("the ranges hold {room} bytes, the value {len}: they must match"),
                ));
            }
            let (mut at, mut rest) = (offset, len);
            for (place, n) in places {
                let n = rest.min(*n);
                if n == 0 {
                    break;
                }
                match place {
                    Place::Caller(ptr) => a.read_raw(at, *ptr, n)?,
                    Place::Staged(off) => {
                        let mut tmp = vec![0u8; n as usize];
                        a.read(at, &mut tmp)?;
                        a.write(*off, &tmp)?;
                    }
                }
                at += n;
                rest -= n;
            }
            Ok((len, None))
        }
    }
}

/// The first guess of room for a value of unknown size.
pub fn guess(a: &Agent) -> u64 {
    (4 << 20).min(group_room(a))
}

/// Where the bytes of a put from caller memory come from.
pub fn src_of(a: &Agent, ptr: usize, len: u64) -> Result<Src<'static>, Failure> {
    Ok(match a.place(ptr, len)? {
        Place::Staged(offset) => Src::Staged(offset, len),
        place => Src::Copy(vec![Piece::Raw(place, len)]),
    })
}

/// Where a get into caller memory goes.
pub fn dst_of(a: &Agent, ptr: usize, len: u64) -> Result<Dst, Failure> {
    Ok(match a.place(ptr, len)? {
        Place::Staged(offset) => Dst::Staged(offset, len),
        place => Dst::Copy(vec![(place, len)], false),
    })
}

/// A value in several ranges of caller memory.
pub fn parts_src(a: &Agent, parts: &[(usize, u64)]) -> Result<Src<'static>, Failure> {
    if parts.is_empty() || parts.iter().any(|(_, len)| *len == 0) {
        return Err(Failure::invalid(
            "a value in registered ranges needs ranges of 1 byte or more",
        ));
    }
    if let [(ptr, len)] = parts {
        return src_of(a, *ptr, *len);
    }
    let pieces = parts
        .iter()
        .map(|(p, l)| Ok(Piece::Raw(a.place(*p, *l)?, *l)))
        .collect::<Result<Vec<_>, Failure>>()?;
    Ok(Src::Copy(pieces))
}

pub fn parts_dst(a: &Agent, parts: &[(usize, u64)]) -> Result<Dst, Failure> {
    let places = parts
        .iter()
        .map(|(p, l)| Ok((a.place(*p, *l)?, *l)))
        .collect::<Result<Vec<_>, Failure>>()?;
    Ok(Dst::Copy(places, true))
}

/// Put one item.
pub async fn put_one(a: &Agent, key: &[u8], src: Src<'_>) -> Result<(), Failure> {
    check_key(key)?;
    one(put_all(a, &[(key, src)]).await)
}

/// Get one item.
pub async fn get_one(a: &Agent, key: &[u8], dst: Dst) -> Result<Got, Failure> {
    one(get_all(a, &[(key, dst)]).await)
}

fn one<T>(results: Vec<Result<T, Failure>>) -> Result<T, Failure> {
    results
        .into_iter()
        .next()
        .unwrap_or_else(|| Err(Failure::new(Kind::Internal, "no result")))
}

/// The size of the value of `key`: a get with no room, which the agent answers with the
/// value's size (it fetches the value to learn it).
pub async fn size(a: &Agent, key: &[u8]) -> Result<u64, Failure> {
    let results = a
        .get_rpc(vec![GetItem {
            key: key.to_vec(),
            offset: 0,
            capacity: 0,
        }])
        .await?;
    match results.first() {
        Some((Status::BufferTooSmall | Status::Ok, len)) => Ok(*len),
        Some((status, len)) => Err(status_failure(*status, key, *len)
            .unwrap_or_else(|| Failure::new(Kind::Internal, "no result"))),
        None => Err(Failure::new(Kind::Internal, "no result")),
    }
}

/// Whether each key is stored (an empty key never is): one RPC per [`MAX_BATCH`] keys.
pub async fn exists(a: &Agent, keys: &[Vec<u8>]) -> Result<Vec<bool>, Failure> {
    let asked: Vec<Vec<u8>> = keys.iter().filter(|k| !k.is_empty()).cloned().collect();
    let mut answers = Vec::with_capacity(asked.len());
    for chunk in asked.chunks(MAX_BATCH) {
        answers.extend(a.exists_rpc(chunk.to_vec()).await?);
    }
    let mut answers = answers.into_iter();
    Ok(keys
        .iter()
        .map(|k| !k.is_empty() && answers.next().unwrap_or(false))
        .collect())
}

/// How long a forced removal waits for the reads in flight to end.
const FORCE_WAIT: Duration = Duration::from_secs(15);
const FORCE_PAUSE: Duration = Duration::from_millis(20);

/// Remove `key`. The agent answers only whether it removed it: a key still there afterwards
/// is held by a reader's lease (`Leased`; `force` waits that out), one not there is
/// `NotFound`.
pub async fn remove(a: &Agent, key: &[u8], force: bool) -> Result<(), Failure> {
    let deadline = tokio::time::Instant::now() + FORCE_WAIT;
    loop {
        if a.remove_rpc(vec![key.to_vec()]).await? == [true] {
            return Ok(());
        }
        if a.exists_rpc(vec![key.to_vec()]).await? != [true] {
            return Err(Failure::new(
                Kind::NotFound,
                format!("no object under key {:?}", String::from_utf8_lossy(key)),
            ));
        }
        if !force || tokio::time::Instant::now() >= deadline {
            return Err(Failure::new(
                Kind::Leased,
                format!(
                    "key {:?} is being read (a reader holds its lease)",
                    String::from_utf8_lossy(key)
                ),
            ));
        }
        tokio::time::sleep(FORCE_PAUSE).await;
    }
}

/// The agent answers, knows this session and reaches its master.
pub async fn health(a: &Agent) -> Result<(), Failure> {
    a.ping().await?;
    a.exists_rpc(vec![b"\0kvpool-health".to_vec()])
        .await
        .map(|_| ())
}

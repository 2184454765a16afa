//! Which NUMA node a DRAM segment is announced on: the node its pages were read back on, never
//! just the one that was asked for. After `mbind` and populating, a sample of the mapping's
//! pages is queried with `move_pages` (query mode: no node list, nothing moves), or with
//! `get_mempolicy(MPOL_F_NODE | MPOL_F_ADDR)` where `move_pages` is refused; the segment is
//! announced on the node only when every sampled page sits there. Otherwise it is announced
//! unbound, with a warning (and the runtime counts `kvpool_agent_numa_binding_failures_total`).
//! [`bind_and_verify`] does the same for an engine session's staging area: `mbind` it to the
//! engine's node, populate it, read it back.
//! I/O boundary: the read-only queries in [`page_nodes`] and the mbind/madvise of
//! [`bind_and_verify`]; the judgement is pure.

use std::collections::BTreeMap;

/// Pages sampled per segment (evenly spaced, first and last included).
pub const SAMPLE_PAGES: usize = 64;

const PAGE: usize = 4096;
const MPOL_F_NODE: libc::c_ulong = 1;
const MPOL_F_ADDR: libc::c_ulong = 2;
const MPOL_BIND: libc::c_long = 2;
const MPOL_MF_STRICT: libc::c_ulong = 1;
const MPOL_MF_MOVE: libc::c_ulong = 2;
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Where one sampled page is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageState {
    /// Resident on this node.
    Node(u32),
    /// Not faulted in yet (no node to report).
    Absent,
    /// The query failed for this page (errno).
    Error(i32),
}

/// Why a segment is announced unbound.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    #[error("binding to NUMA node {0} failed")]
    BindFailed(u32),
    #[error("reading back the pages' NUMA node failed ({0})")]
    Query(String),
    #[error("none of the {0} sampled pages is resident, so their node is unknown")]
    NotResident(usize),
    #[error(
        "pages were asked for on NUMA node {wanted} but sit on {}",
        describe(found)
    )]
    Elsewhere {
        wanted: u32,
        /// Sampled pages per node (`None`: the query failed for them).
        found: BTreeMap<Option<u32>, usize>,
    },
}

fn describe(found: &BTreeMap<Option<u32>, usize>) -> String {
    found
        .iter()
        .map(|(node, n)| match node {
            Some(node) => format!("node {node} ({n} pages)"),
            None => format!("unreadable ({n} pages)"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Judge sampled page states against the node the segment was bound to: `Ok(wanted)` only
/// when every resident sample is on it, no query failed, and at least one page is resident.
pub fn judge(wanted: u32, pages: &[PageState]) -> Result<u32, VerifyError> {
    let mut found: BTreeMap<Option<u32>, usize> = BTreeMap::new();
    let mut resident = 0;
    for p in pages {
        match p {
            PageState::Node(n) => {
                resident += 1;
                *found.entry(Some(*n)).or_default() += 1;
            }
            PageState::Error(_) => *found.entry(None).or_default() += 1,
            PageState::Absent => {}
        }
    }
    if resident == 0 && found.is_empty() {
        return Err(VerifyError::NotResident(pages.len()));
    }
    if found.keys().all(|k| *k == Some(wanted)) {
        Ok(wanted)
    } else {
        Err(VerifyError::Elsewhere { wanted, found })
    }
}

/// Addresses of up to `samples` pages spread over `addr..addr + len`.
pub fn sample_addresses(addr: usize, len: usize, samples: usize) -> Vec<usize> {
    let pages = len.div_ceil(PAGE).max(1);
    let n = samples.clamp(1, pages);
    if n == 1 {
        return vec![addr];
    }
    (0..n)
        .map(|i| addr + (i * (pages - 1) / (n - 1)) * PAGE)
        .collect()
}

/// Query the node of each page at `addrs` (inside a mapping of this process).
pub fn page_nodes(addrs: &[usize]) -> std::io::Result<Vec<PageState>> {
    match move_pages_query(addrs) {
        Ok(states) => Ok(states),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) => {
            addrs.iter().map(|a| mempolicy_node(*a)).collect()
        }
        Err(e) => Err(e),
    }
}

fn move_pages_query(addrs: &[usize]) -> std::io::Result<Vec<PageState>> {
    let pages: Vec<*mut libc::c_void> = addrs.iter().map(|a| *a as *mut libc::c_void).collect();
    let mut status: Vec<libc::c_int> = vec![0; addrs.len()];
    // SAFETY: move_pages with a null node list only reports where the pages are: it reads
    // `count` pointers from `pages` and writes `count` ints to `status`, both of that length;
    // an address outside any mapping yields -EFAULT in its status, not a fault here.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            0 as libc::c_int,
            pages.len() as libc::c_ulong,
            pages.as_ptr(),
            std::ptr::null::<libc::c_int>(),
            status.as_mut_ptr(),
            0 as libc::c_int,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(status
        .into_iter()
        .map(|s| match s {
            n if n >= 0 => PageState::Node(n.unsigned_abs()),
            n if n == -libc::ENOENT => PageState::Absent,
            n => PageState::Error(-n),
        })
        .collect())
}

fn mempolicy_node(addr: usize) -> std::io::Result<PageState> {
    let mut node: libc::c_int = -1;
    // SAFETY: get_mempolicy with MPOL_F_NODE | MPOL_F_ADDR writes one int (the node of the
    // page at `addr`) to `node`; the node mask pointer is null with a size of 0.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            addr as *mut libc::c_void,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    if rc < 0 {
        let e = std::io::Error::last_os_error();
        return Ok(PageState::Error(e.raw_os_error().unwrap_or(0)));
    }
    Ok(u32::try_from(node).map_or(PageState::Absent, PageState::Node))
}

/// The node to announce for segment `index` at `addr..addr + len`, which was asked to be on
/// `requested` and whose binding succeeded (`bound`) or not: the verified node, or `None`
/// with a warning pushed to `warnings` when the binding failed or the pages are elsewhere.
pub fn announced_node(
    index: usize,
    addr: usize,
    len: usize,
    requested: Option<u32>,
    bound: bool,
    warnings: &mut Vec<String>,
) -> Option<u32> {
    let wanted = requested?;
    let verdict = if bound {
        page_nodes(&sample_addresses(addr, len, SAMPLE_PAGES))
            .map_err(|e| VerifyError::Query(e.to_string()))
            .and_then(|pages| judge(wanted, &pages))
    } else {
        Err(VerifyError::BindFailed(wanted))
    };
    match verdict {
        Ok(node) => Some(node),
        Err(e) => {
            warnings.push(format!(
                "segment {index}: {}{e}; announced without a NUMA node",
                UNBOUND_WARNING
            ));
            None
        }
    }
}

/// Bind the mapping at `addr..addr + len` (page-aligned `addr`, a shared file mapping such as
/// an engine's staging area) to NUMA node `node`, fault its pages in (their contents are kept)
/// and read back where they are: `Ok(node)` only when they are all there.
///
/// # Safety
/// `addr..addr + len` must be a live, writable mapping of this process that no other thread
/// unmaps or remaps during the call.
pub unsafe fn bind_and_verify(addr: usize, len: usize, node: u32) -> Result<u32, VerifyError> {
    let bits = libc::c_ulong::BITS;
    let words = (node / bits + 1) as usize;
    let mut mask: Vec<libc::c_ulong> = vec![0; words];
    if let Some(w) = mask.last_mut() {
        *w = 1 << (node % bits);
    }
    let maxnode = (words as libc::c_ulong) * libc::c_ulong::from(bits) + 1;
    // SAFETY: mbind only changes the NUMA policy of the caller's live mapping (and moves its
    // resident pages, keeping their contents); the mask holds `words` words, covering
    // `maxnode - 1` bits.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            addr as *mut libc::c_void,
            len as libc::c_ulong,
            MPOL_BIND,
            mask.as_ptr(),
            maxnode,
            MPOL_MF_STRICT | MPOL_MF_MOVE,
        )
    };
    if rc != 0 {
        return Err(VerifyError::BindFailed(node));
    }
    // SAFETY: advice on the caller's live mapping; populating faults pages in without changing
    // their contents. Best effort: without it (kernels before 5.14) the check below finds the
    // pages absent and says so.
    unsafe {
        libc::madvise(addr as *mut libc::c_void, len, MADV_POPULATE_WRITE);
    }
    let pages = page_nodes(&sample_addresses(addr, len, SAMPLE_PAGES))
        .map_err(|e| VerifyError::Query(e.to_string()))?;
    judge(node, &pages)
}

/// Bind an engine session's staging area to NUMA node `node` and verify it (see
/// [`bind_and_verify`]).
pub fn bind_staging(
    staging: &kvpool_client::engine_api::shm::Staging,
    node: u32,
) -> Result<u32, VerifyError> {
    let len = usize::try_from(staging.size()).map_err(|e| VerifyError::Query(e.to_string()))?;
    // SAFETY: the staging area's mapping is live and writable for `size` bytes while it is
    // borrowed, and only its owner unmaps it (on drop).
    unsafe { bind_and_verify(staging.as_ptr() as usize, len, node) }
}

/// Start of the warning [`announced_node`] gives for a segment announced unbound.
pub const UNBOUND_WARNING: &str = "NUMA binding not verified: ";

/// Segments announced unbound although a node was asked for them, from what was asked
/// (`requested`) and what is announced (`announced`), in segment order.
pub fn binding_failures(requested: &[Option<u32>], announced: &[Option<u32>]) -> u64 {
    requested
        .iter()
        .zip(announced)
        .filter(|(r, a)| r.is_some() && a.is_none())
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{MappedRegion, RegionRequest};

    fn region(numa_node: Option<u32>) -> (MappedRegion, bool) {
        let (r, outcome) = MappedRegion::map(&RegionRequest {
            bytes: 1 << 20,
            numa_node,
            hugepage_size: None,
            lock: false,
            shareable: false,
        })
        .expect("map");
        (r, outcome.numa_bound)
    }

    /// The node this machine put an unbound, populated mapping's pages on.
    fn actual_node(r: &MappedRegion) -> u32 {
        let pages = page_nodes(&sample_addresses(r.addr(), r.len(), 8)).expect("query");
        match pages[0] {
            PageState::Node(n) => n,
            other => panic!("the populated page is not resident: {other:?}"),
        }
    }

    #[test]
    fn judgement_needs_every_resident_sample_on_the_node() {
        use PageState::*;
        assert_eq!(judge(1, &[Node(1), Absent, Node(1)]), Ok(1));
        let err = judge(1, &[Node(1), Node(0), Node(0)]).expect_err("spread");
        assert!(
            err.to_string()
                .contains("asked for on NUMA node 1 but sit on node 0 (2 pages), node 1 (1 pages)"),
            "{err}"
        );
        assert!(judge(0, &[Node(0), Error(libc::EFAULT)]).is_err());
        assert_eq!(
            judge(0, &[Absent, Absent]),
            Err(VerifyError::NotResident(2))
        );
        assert_eq!(sample_addresses(4096, 3 * 4096, 64), [4096, 8192, 12288]);
        let s = sample_addresses(0, 1 << 30, 64);
        assert_eq!((s.len(), s[0], s[63]), (64, 0, (1 << 30) - 4096));
    }

    #[test]
    fn a_segment_on_its_node_is_announced_there() {
        let (r, _) = region(None);
        let node = actual_node(&r);
        let mut warnings = Vec::new();
        let got = announced_node(0, r.addr(), r.len(), Some(node), true, &mut warnings);
        assert_eq!(got, Some(node));
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(
            announced_node(0, r.addr(), r.len(), None, false, &mut warnings),
            None
        );
        assert!(
            warnings.is_empty(),
            "nothing was asked: nothing to warn about"
        );
    }

    #[test]
    fn pages_elsewhere_are_caught_even_when_the_binding_claimed_success() {
        // An mbind that "succeeded" but left the pages on another node (a policy the kernel
        // could not honour): the read-back finds them and the segment is announced unbound.
        let (r, _) = region(None);
        let other = actual_node(&r) + 1;
        let mut warnings = Vec::new();
        assert_eq!(
            announced_node(3, r.addr(), r.len(), Some(other), true, &mut warnings),
            None
        );
        assert_eq!(warnings.len(), 1);
        assert!(
            warnings[0].starts_with(&format!("segment 3: {UNBOUND_WARNING}"))
                && warnings[0].contains(&format!("asked for on NUMA node {other}")),
            "{warnings:?}"
        );
        assert_eq!(binding_failures(&[Some(other), None], &[None, None]), 1);
    }

    #[test]
    fn a_node_this_machine_lacks_is_announced_unbound() {
        // No machine this runs on has 1000 NUMA nodes: mbind refuses, and the segment says
        // unbound instead of claiming the node (what `dram::map_segments` announces).
        let (r, bound) = region(Some(999));
        assert!(!bound);
        let mut warnings = Vec::new();
        assert_eq!(
            announced_node(0, r.addr(), r.len(), Some(999), bound, &mut warnings),
            None
        );
        assert!(
            warnings[0].contains(UNBOUND_WARNING)
                && warnings[0].contains("binding to NUMA node 999"),
            "{warnings:?}"
        );
    }

    #[test]
    fn a_staging_area_is_bound_to_an_existing_node_and_refused_elsewhere() {
        let dir = tempfile::tempdir().expect("tempdir");
        let staging = kvpool_client::engine_api::shm::Staging::create(dir.path(), "s", 1 << 20)
            .expect("staging");
        staging.write_from(4096, b"kept").expect("write");
        let (r, _) = region(None);
        let node = actual_node(&r);
        assert_eq!(bind_staging(&staging, node), Ok(node));
        let mut back = [0u8; 4];
        staging.read_into(4096, &mut back).expect("read");
        assert_eq!(&back, b"kept", "binding keeps the contents");
        assert_eq!(
            bind_staging(&staging, 999),
            Err(VerifyError::BindFailed(999))
        );
    }
}

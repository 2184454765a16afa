//! The persistent DRAM tier at start-up (pool mode, `dram.persistence`): checks that the tier's
//! directory is on the filesystem its mode names (tmpfs or hugetlbfs, by `statfs` magic) and
//! reads its page size, credits the memory the files of the last run still hold to the
//! placement's free-memory check, removes segment files a smaller tier no longer uses, and
//! opens each segment's durable index — the pool SSD segment's index format and code — checking
//! every indexed block against the file's bytes before the file is mapped. I/O boundary:
//! `statfs` and the tier's files; [`credit_kept`]'s arithmetic is pure.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::config::{DramPersistence, PersistenceMode};
use crate::dram::{UNIT, segment_file};
use crate::placement::SegmentPlan;
use crate::ssd::pool::{PoolIndexError, PoolRecovery, PoolSsdIndex};
use crate::topology::Topology;

const TMPFS_MAGIC: i64 = 0x0102_1994;
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// Errors of the persistent DRAM tier's start-up.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum PersistError {
    #[error("cannot create or inspect {path}")]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "dram.persistence.path {path} is on {found}, not {wanted} (mode {wanted} keeps the tier \
         there; mount a {wanted} filesystem at that path)"
    )]
    WrongFilesystem {
        path: PathBuf,
        wanted: &'static str,
        found: String,
    },
    #[error(
        "dram.persistence.index_path {path} is on hugetlbfs, which cannot hold the index (files \
         there can only be mapped); use a tmpfs directory"
    )]
    IndexOnHugetlbfs { path: PathBuf },
    #[error("index of DRAM segment {segment}")]
    Index {
        segment: usize,
        #[source]
        source: PoolIndexError,
    },
}

kvpool_runtime::error_category!(PersistError);

/// The index file of DRAM segment `index`.
pub fn index_file(p: &DramPersistence, index: usize) -> PathBuf {
    p.index_dir.join(format!("dram{index}.idx"))
}

fn statfs(path: &Path) -> Result<libc::statfs, PersistError> {
    let dir_err = |source| PersistError::Dir {
        path: path.to_owned(),
        source,
    };
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| dir_err(std::io::Error::other(e)))?;
    let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: `c` is a NUL-terminated path and `st` a buffer of the struct statfs fills.
    let rc = unsafe { libc::statfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(dir_err(std::io::Error::last_os_error()));
    }
    // SAFETY: statfs succeeded, so it initialised the struct (it was zeroed before anyway).
    Ok(unsafe { st.assume_init() })
}

fn fs_name(magic: i64) -> String {
    match magic {
        TMPFS_MAGIC => "tmpfs".to_owned(),
        HUGETLBFS_MAGIC => "hugetlbfs".to_owned(),
        m => format!("a filesystem with magic {m:#x}"),
    }
}

/// Create the tier's directories, check that the data directory is on the filesystem the mode
/// names, and return its page size (4 KiB on tmpfs, the mount's huge page size on hugetlbfs).
// statfs field types differ between targets (i64 on x86_64, i32 on some others): the
// conversions are no-ops here and needed there.
#[allow(clippy::useless_conversion)]
pub fn prepare(p: &DramPersistence) -> Result<u64, PersistError> {
    for dir in [&p.dir, &p.index_dir] {
        std::fs::create_dir_all(dir).map_err(|source| PersistError::Dir {
            path: dir.clone(),
            source,
        })?;
    }
    let st = statfs(&p.dir)?;
    // f_type's integer type differs between targets; every one of them fits an i64.
    let magic = i64::from(st.f_type);
    let (wanted, want_magic) = match p.mode {
        PersistenceMode::Tmpfs => ("tmpfs", TMPFS_MAGIC),
        PersistenceMode::Hugetlbfs => ("hugetlbfs", HUGETLBFS_MAGIC),
        // Validation turns mode none into no persistence at all.
        PersistenceMode::None => ("tmpfs or hugetlbfs", TMPFS_MAGIC),
    };
    if magic != want_magic {
        return Err(PersistError::WrongFilesystem {
            path: p.dir.clone(),
            wanted,
            found: fs_name(magic),
        });
    }
    if i64::from(statfs(&p.index_dir)?.f_type) == HUGETLBFS_MAGIC {
        return Err(PersistError::IndexOnHugetlbfs {
            path: p.index_dir.clone(),
        });
    }
    let page = u64::try_from(i64::from(st.f_bsize)).unwrap_or(4096);
    Ok(if magic == HUGETLBFS_MAGIC {
        page.max(4096)
    } else {
        4096
    })
}

/// Bytes held by the segment files in `dir` (`dram<i>.dat`).
fn kept_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with("dram") && name.ends_with(".dat")
        })
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

/// The topology placement should check the tier against: with a persistent tier, the memory
/// its files from the last run hold is taken again, so it counts as free on every node (the
/// files' pages may sit on any of them).
pub fn credit_kept<'a>(topo: &'a Topology, p: Option<&DramPersistence>) -> Cow<'a, Topology> {
    let kept = p.map_or(0, |p| kept_bytes(&p.dir));
    if kept == 0 {
        return Cow::Borrowed(topo);
    }
    let mut t = topo.clone();
    for n in &mut t.numa_nodes {
        n.mem_free_bytes = n.mem_free_bytes.saturating_add(kept);
    }
    Cow::Owned(t)
}

/// What opening one segment's index found.
#[derive(Debug)]
pub struct OpenedIndex {
    pub index: PoolSsdIndex,
    pub recovery: PoolRecovery,
    /// Time spent replaying the index and checking every block's checksum.
    pub elapsed: Duration,
}

/// Open the index of every planned segment, checking each indexed block against the segment's
/// file (bounds, length, crc32c) before the file is mapped; remove the files of segments the
/// plan no longer has (a smaller tier), with a warning each.
pub fn open_indexes(
    p: &DramPersistence,
    plans: &[SegmentPlan],
) -> Result<Vec<OpenedIndex>, PersistError> {
    let mut out = Vec::with_capacity(plans.len());
    for (i, plan) in plans.iter().enumerate() {
        let started = Instant::now();
        let capacity = plan.bytes / UNIT * UNIT;
        let (index, recovery) =
            PoolSsdIndex::open_at(&index_file(p, i), &segment_file(&p.dir, i), capacity)
                .map_err(|source| PersistError::Index { segment: i, source })?;
        out.push(OpenedIndex {
            index,
            recovery,
            elapsed: started.elapsed(),
        });
    }
    for i in plans.len().. {
        let data = segment_file(&p.dir, i);
        if !data.exists() {
            break;
        }
        tracing::warn!(file = %data.display(),
            "removing a DRAM segment file the configured tier no longer has");
        for f in [data, index_file(p, i)] {
            if let Err(e) = std::fs::remove_file(&f)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(file = %f.display(), error = %e, "cannot remove");
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn persistence(dir: &Path) -> DramPersistence {
        DramPersistence {
            mode: PersistenceMode::Tmpfs,
            dir: dir.join("tier"),
            index_dir: dir.join("tier"),
        }
    }

    #[test]
    fn a_directory_not_on_tmpfs_is_refused_naming_the_filesystem() {
        // The build tree is not tmpfs on any machine this runs on (/dev/shm is).
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).expect("tempdir");
        let p = persistence(dir.path());
        let e = prepare(&p).expect_err("not tmpfs");
        let text = e.to_string();
        assert!(text.contains("not tmpfs"), "{text}");
        assert!(text.contains("dram.persistence.path"), "{text}");
        assert_eq!(e.category(), "wrong_filesystem");
        let hugetlbfs = DramPersistence {
            mode: PersistenceMode::Hugetlbfs,
            ..p
        };
        assert!(
            prepare(&hugetlbfs)
                .expect_err("not hugetlbfs")
                .to_string()
                .contains("not hugetlbfs")
        );
    }

    #[test]
    fn kept_files_are_credited_and_extra_segments_removed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = persistence(dir.path());
        std::fs::create_dir_all(&p.dir).expect("dir");
        std::fs::write(segment_file(&p.dir, 0), vec![0u8; 8192]).expect("seg 0");
        std::fs::write(segment_file(&p.dir, 1), vec![0u8; 4096]).expect("seg 1");
        std::fs::write(p.dir.join("other.dat"), vec![0u8; 4096]).expect("other");
        assert_eq!(kept_bytes(&p.dir), 12_288);
        let mut topo = Topology::default();
        topo.numa_nodes.push(Default::default());
        let credited = credit_kept(&topo, Some(&p));
        assert_eq!(credited.numa_nodes[0].mem_free_bytes, 12_288);
        assert!(matches!(credit_kept(&topo, None), Cow::Borrowed(_)));
        // One segment planned now: segment 1's file goes, segment 0's index is created.
        let plans = [SegmentPlan {
            numa_node: None,
            bytes: 8192,
            hugepage_size: None,
        }];
        let opened = open_indexes(&p, &plans).expect("open");
        assert_eq!(opened.len(), 1);
        assert!(opened[0].index.is_empty());
        assert!(index_file(&p, 0).exists());
        assert!(!segment_file(&p.dir, 1).exists());
        assert!(segment_file(&p.dir, 0).exists());
    }
}

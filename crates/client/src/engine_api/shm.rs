//! Shared-memory staging areas of the engine API: one file per session in a directory both the
//! agent and the engines can reach (a tmpfs such as /dev/shm or a hostPath under /run), mapped
//! MAP_SHARED by both sides. Block bytes move through these mappings; gRPC only names ranges.
//! I/O boundary: the staging files and their mappings. The copies in and out use raw pointers
//! because the other process may write the mapping at any time (no Rust reference to it is
//! ever formed); this module holds the engine API's only `unsafe`.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use memmap2::{MmapOptions, MmapRaw};

use kvpool_transfer::memory::CallerMemory;

/// File name prefix of staging files (stale ones are removed at start-up).
pub const STAGING_PREFIX: &str = "kvpool-staging-";

/// Errors of staging areas.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum ShmError {
    #[error("cannot create staging file {path}")]
    Create {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot map staging file {path}")]
    Map {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("range {offset}+{len} is outside the {size}-byte staging area")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("caller memory {addr:#x}+{len} is not mapped for this copy: {source}")]
    Fault {
        addr: usize,
        len: usize,
        #[source]
        source: std::io::Error,
    },
}

impl ShmError {
    /// Short label for metrics.
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// A mapped staging file.
#[derive(Debug)]
pub struct Staging {
    path: PathBuf,
    map: MmapRaw,
    size: u64,
    /// Whether dropping this value removes the file (the agent's side owns it).
    owner: bool,
    /// NUMA node the agent bound the pages to and verified (`None`: not bound).
    numa_node: Option<u32>,
}

fn map_file(file: &File, path: &Path, size: u64) -> Result<MmapRaw, ShmError> {
    let len = usize::try_from(size).map_err(|_| ShmError::Map {
        path: path.to_owned(),
        source: std::io::Error::other("size does not fit in memory"),
    })?;
    MmapOptions::new()
        .len(len)
        .map_raw(file)
        .map_err(|source| ShmError::Map {
            path: path.to_owned(),
            source,
        })
}

impl Staging {
    /// Create a new staging file of `size` bytes in `dir` (agent side), readable and writable by
    /// its owner and group.
    pub fn create(dir: &Path, name: &str, size: u64) -> Result<Self, ShmError> {
        Self::create_for_group(dir, name, size, None)
    }

    /// [`Staging::create`], handing the file to `group` so that engines running as another
    /// user in that group can map it.
    pub fn create_for_group(
        dir: &Path,
        name: &str,
        size: u64,
        group: Option<u32>,
    ) -> Result<Self, ShmError> {
        let path = dir.join(format!("{STAGING_PREFIX}{name}"));
        let create_err = |source| ShmError::Create {
            path: path.clone(),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o660)
            .open(&path)
            .map_err(create_err)?;
        // The umask may have taken the group's write bit: engines write puts into the file.
        if let Some(gid) = group
            && let Err(e) = std::os::unix::fs::fchown(&file, None, Some(gid)).and_then(|()| {
                use std::os::unix::fs::PermissionsExt;
                file.set_permissions(std::fs::Permissions::from_mode(0o660))
            })
        {
            let _ = std::fs::remove_file(&path);
            return Err(create_err(e));
        }
        if let Err(e) = file.set_len(size) {
            let _ = std::fs::remove_file(&path);
            return Err(create_err(e));
        }
        let map = match map_file(&file, &path, size) {
            Ok(m) => m,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
        Ok(Self {
            path,
            map,
            size,
            owner: true,
            numa_node: None,
        })
    }

    /// Map an existing staging file (client side).
    pub fn open(path: &Path, size: u64) -> Result<Self, ShmError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| ShmError::Map {
                path: path.to_owned(),
                source,
            })?;
        let map = map_file(&file, path, size)?;
        Ok(Self {
            path: path.to_owned(),
            map,
            size,
            owner: false,
            numa_node: None,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Record the NUMA node the pages were bound to and verified on (agent side).
    pub fn set_numa_node(&mut self, node: Option<u32>) {
        self.numa_node = node;
    }

    /// The NUMA node given by [`Self::set_numa_node`].
    pub fn numa_node(&self) -> Option<u32> {
        self.numa_node
    }

    /// Address of the first byte of this process's mapping. Callers that hand out ranges of
    /// the area as memory of their own (the Python client's `alloc_buffer`) name it by this;
    /// the mapping lives as long as `self`.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    fn check(&self, offset: u64, len: usize) -> Result<usize, ShmError> {
        let len64 = len as u64;
        match offset.checked_add(len64) {
            Some(end) if end <= self.size => {
                usize::try_from(offset).map_err(|_| ShmError::OutOfRange {
                    offset,
                    len: len64,
                    size: self.size,
                })
            }
            _ => Err(ShmError::OutOfRange {
                offset,
                len: len64,
                size: self.size,
            }),
        }
    }

    /// Whether `offset..offset+len` lies inside the area.
    pub fn contains(&self, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.size)
    }

    /// Copy `dst.len()` bytes from the area at `offset` into `dst`.
    pub fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<(), ShmError> {
        let start = self.check(offset, dst.len())?;
        // SAFETY: `check` proved start..start+len lies inside the live mapping; `dst` is a
        // distinct Rust buffer, so the ranges do not overlap. The other process may write the
        // source concurrently: the copy then sees some mix of bytes, which is the client's
        // contract to avoid, and never undefined behaviour on our side since no reference to
        // the shared bytes exists.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_ptr().add(start),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
        Ok(())
    }

    /// Copy `src` into the area at `offset`.
    pub fn write_from(&self, offset: u64, src: &[u8]) -> Result<(), ShmError> {
        let start = self.check(offset, src.len())?;
        // SAFETY: as in `read_into`, with the destination inside the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.map.as_mut_ptr().add(start),
                src.len(),
            );
        }
        Ok(())
    }
}

impl Staging {
    /// Copy `len` bytes of caller memory at `src` into the area at `offset`. The kernel checks
    /// that `src` is mapped and readable: a buffer unmapped since it was registered is a
    /// [`ShmError::Fault`], never a signal.
    ///
    /// # Safety
    /// None beyond the arguments' meaning: `src` need not be valid (that is what is checked).
    pub unsafe fn write_from_caller(
        &self,
        offset: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), ShmError> {
        let start = self.check(offset, len)?;
        // SAFETY: start..start+len lies inside the live mapping (checked); no reference to the
        // shared bytes exists; the kernel checks `src`.
        unsafe {
            kvpool_transfer::memory::checked_copy(
                self.map.as_ptr().add(start).cast_mut(),
                src,
                len,
                CallerMemory::SRC,
            )
        }
        .map_err(|source| ShmError::Fault {
            addr: src as usize,
            len,
            source,
        })
    }

    /// Copy `len` bytes of the area at `offset` to caller memory at `dst`, the kernel checking
    /// that `dst` is mapped and writable (see [`Self::write_from_caller`]).
    ///
    /// # Safety
    /// No Rust reference may point into `dst..dst+len`; `dst` need not be valid.
    pub unsafe fn read_into_caller(
        &self,
        offset: u64,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), ShmError> {
        let start = self.check(offset, len)?;
        // SAFETY: as above, the other way round.
        unsafe {
            kvpool_transfer::memory::checked_copy(
                dst,
                self.map.as_ptr().add(start),
                len,
                CallerMemory::DST,
            )
        }
        .map_err(|source| ShmError::Fault {
            addr: dst as usize,
            len,
            source,
        })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.owner {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Remove staging files left by an earlier agent process; returns how many.
pub fn remove_stale(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(STAGING_PREFIX))
        .filter(|e| std::fs::remove_file(e.path()).is_ok())
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_sides_see_the_same_bytes_and_owner_removes_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let agent = Staging::create(dir.path(), "t1", 8192).expect("create");
        let client = Staging::open(agent.path(), 8192).expect("open");
        client.write_from(100, b"hello").expect("write");
        let mut out = [0u8; 5];
        agent.read_into(100, &mut out).expect("read");
        assert_eq!(&out, b"hello");
        assert_eq!(
            agent
                .read_into(8190, &mut out)
                .expect_err("range")
                .category(),
            "out_of_range"
        );
        assert!(agent.write_from(u64::MAX, b"x").is_err());
        let path = agent.path().to_owned();
        drop(client);
        assert!(path.exists());
        drop(agent);
        assert!(!path.exists());
    }

    #[test]
    fn stale_files_are_removed() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(format!("{STAGING_PREFIX}old")), b"x").expect("w");
        std::fs::write(dir.path().join("other"), b"x").expect("w");
        assert_eq!(remove_stale(dir.path()), 1);
        assert!(dir.path().join("other").exists());
    }
}

//! Where `kvpool up` keeps its agents' DRAM tiers (`--agent-dram-persistence`): in a directory
//! on /dev/shm when that is a tmpfs mount, one sub-directory per agent, so that a restarted
//! agent finds its committed blocks again (docs/agent.md, "Persistent DRAM tier"). `auto` (the
//! default) makes a temporary directory for the run, removed at exit (and by a later `up` if
//! this one is killed, as its working directory is); `keep` (with `--dir`) uses
//! `/dev/shm/kvpool-up-dir-<device>-<inode>` of the working directory and leaves it after exit,
//! so a second run with the same `--dir` starts with the first one's cache. I/O boundary:
//! /proc/mounts and /dev/shm.

use std::path::{Path, PathBuf};

use super::UpError;
use super::workdir::{PID_FILE, TEMP_PREFIX};

/// The memory filesystem `up` puts the tiers on.
const SHM: &str = "/dev/shm";

/// Whether the agents' DRAM tiers persist.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DramPersistence {
    /// In a temporary directory on /dev/shm for the run when /dev/shm is tmpfs, else in
    /// anonymous memory (with a note in the log).
    #[default]
    Auto,
    /// In a directory on /dev/shm tied to `--dir`, kept after exit for the next run.
    Keep,
    /// Anonymous memory: an agent's tier ends with it.
    Off,
}

/// Whether `mount_point` is a tmpfs mount, from `/proc/mounts`.
fn is_tmpfs(mount_point: &str) -> bool {
    std::fs::read_to_string("/proc/mounts").is_ok_and(|m| {
        m.lines().any(|l| {
            let mut f = l.split(' ');
            let (_, at, fs) = (f.next(), f.next(), f.next());
            at == Some(mount_point) && fs == Some("tmpfs")
        })
    })
}

/// The directory of the agents' tiers (agent `i` in `agent-<i>` below it), if any, and the
/// guard that removes a temporary one.
pub(super) fn tier_dir(
    mode: DramPersistence,
    work_dir: &Path,
    temporary: bool,
) -> Result<(Option<PathBuf>, Option<tempfile::TempDir>), UpError> {
    if mode == DramPersistence::Keep && temporary {
        return Err(super::settings::flag(
            "agent-dram-persistence",
            "keep needs --dir (the tiers are kept for the next run in that directory)",
        ));
    }
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    if mode == DramPersistence::Off {
        return Ok((None, None));
    }
    if !is_tmpfs(SHM) {
        tracing::info!("{SHM} is not tmpfs: the agents' DRAM tiers are not persistent");
        return Ok((None, None));
    }
    let dir_err = |path: PathBuf| move |source| UpError::Dir { path, source };
    if mode == DramPersistence::Auto {
        super::workdir::remove_stale_dirs(Path::new(SHM));
        let t = tempfile::Builder::new()
            .prefix(TEMP_PREFIX)
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir_in(SHM)
            .map_err(dir_err(PathBuf::from(SHM)))?;
        let pid = t.path().join(PID_FILE);
        std::fs::write(&pid, std::process::id().to_string()).map_err(dir_err(pid))?;
        return Ok((Some(t.path().to_owned()), Some(t)));
    }
    let meta = std::fs::metadata(work_dir).map_err(dir_err(work_dir.to_owned()))?;
    let dir = Path::new(SHM).join(format!("kvpool-up-dir-{:x}-{:x}", meta.dev(), meta.ino()));
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(dir_err(dir.clone()))?;
    tracing::info!(dir = %dir.display(),
        "the agents' DRAM tiers are kept here after exit (remove it to free the memory)");
    Ok((Some(dir), None))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_means_no_directory_and_a_temporary_run_cleans_up() {
        let work = tempfile::tempdir().expect("tempdir");
        let (d, g) = tier_dir(DramPersistence::Off, work.path(), true).expect("off");
        assert!(d.is_none() && g.is_none());
        assert!(
            tier_dir(DramPersistence::Keep, work.path(), true).is_err(),
            "keep needs --dir"
        );
        let (d, g) = tier_dir(DramPersistence::Auto, work.path(), false).expect("auto");
        if !is_tmpfs(SHM) {
            assert!(d.is_none(), "no tmpfs, no persistence");
            return;
        }
        let d = d.expect("a directory on /dev/shm");
        assert!(d.starts_with(SHM) && d.join(PID_FILE).exists());
        drop(g);
        assert!(!d.exists(), "removed with its guard");
        // keep: the same directory every time, left after exit.
        let (a, g) = tier_dir(DramPersistence::Keep, work.path(), false).expect("kept");
        assert!(g.is_none());
        let (b, _) = tier_dir(DramPersistence::Keep, work.path(), false).expect("again");
        assert_eq!(a, b);
        let a = a.expect("dir");
        assert!(a.exists());
        std::fs::remove_dir_all(&a).expect("clean up");
    }
}

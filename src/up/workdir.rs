//! The working directory of `kvpool up`: `--dir`, or a private temporary one that names its
//! `up` process, and the clean-up of those that earlier, killed `up` processes left behind.
//! I/O boundary: the file system and `kill(pid, 0)`.

use std::path::PathBuf;

use super::{UpArgs, UpError};

/// Prefix of the temporary working directories.
pub(super) const TEMP_PREFIX: &str = "kvpool-up-";
/// File in the working directory naming the `up` process that uses it.
pub(super) const PID_FILE: &str = "up.pid";

/// The working directory: `--dir`, or a temporary one removed when the guard drops. A
/// directory `up` creates is private to the user (0700: it holds the pool key, sockets and
/// logs), and names this process in `up.pid` so that a later `up` can remove it if this one
/// is killed before it cleans up.
pub(super) fn work_dir(args: &UpArgs) -> Result<(PathBuf, Option<tempfile::TempDir>), UpError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let dir_err = |path: PathBuf| move |source| UpError::Dir { path, source };
    let (dir, temp) = match &args.dir {
        Some(d) => (d.clone(), None),
        None => {
            remove_stale_dirs(&std::env::temp_dir());
            let t = tempfile::Builder::new()
                .prefix(TEMP_PREFIX)
                .permissions(std::fs::Permissions::from_mode(0o700))
                .tempdir()
                .map_err(dir_err(std::env::temp_dir()))?;
            (t.path().to_owned(), Some(t))
        }
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(dir_err(dir.clone()))?;
    if let Ok(meta) = std::fs::metadata(&dir)
        && meta.permissions().mode() & 0o077 != 0
    {
        tracing::warn!(dir = %dir.display(), mode = format!("{:o}", meta.permissions().mode() & 0o777),
            "the working directory is open to other users (its key file is not)");
    }
    let pid = dir.join(PID_FILE);
    std::fs::write(&pid, std::process::id().to_string()).map_err(dir_err(pid))?;
    Ok((dir, temp))
}

/// Removes the temporary working directories of earlier `up` runs that died without cleaning
/// up: `kvpool-up-*` directories in `tmp` owned by this user whose `up.pid` names a process
/// that no longer exists. Directories without a readable pid file (another `up` may be
/// creating one right now) and those of live processes are left alone; failures are logged.
pub(super) fn remove_stale_dirs(tmp: &std::path::Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    // SAFETY: geteuid has no preconditions, touches no memory of ours and cannot fail.
    let uid = unsafe { libc::geteuid() };
    for entry in entries.filter_map(Result::ok) {
        let path = entry.path();
        let stale = entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(TEMP_PREFIX))
            && std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir() && m.uid() == uid)
            && std::fs::read_to_string(path.join(PID_FILE))
                .ok()
                .and_then(|p| p.trim().parse::<i32>().ok())
                .is_some_and(|pid| pid > 0 && !process_exists(pid));
        if stale {
            match std::fs::remove_dir_all(&path) {
                Ok(()) => {
                    tracing::info!(dir = %path.display(), "removed the working directory of an earlier kvpool up that was killed")
                }
                Err(e) => {
                    tracing::warn!(dir = %path.display(), error = %e, "cannot remove a stale working directory")
                }
            }
        }
    }
}

/// Whether a process `pid` exists (a process of another user counts as existing).
fn process_exists(pid: i32) -> bool {
    use nix::errno::Errno;
    !matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
        Err(Errno::ESRCH)
    )
}

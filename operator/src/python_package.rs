//! `kvpool operator install-python`: what the init container of every engine pod runs. It copies
//! the `kvpool` Python package that the `kvpool` image carries (docker/kvpool.Dockerfile installs
//! it at [`crate::contract::PYTHON_PACKAGE_DIR`]) into the pod's `emptyDir`, which the engine
//! container then mounts read-only and finds through `PYTHONPATH`. The image is distroless (no
//! shell, no `cp`), hence a subcommand of the one binary. Files keep their mode, made readable by
//! everyone (the engine may run as another user); symbolic links are recreated, not followed.
//! I/O boundary: the file system under the two directories.

use std::fmt;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// What went wrong, naming the path.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum InstallError {
    /// The image carries no package where it should.
    #[error(
        "{0} does not exist: this image carries no kvpool Python package (docker/kvpool.Dockerfile \
         installs it there)"
    )]
    MissingSource(PathBuf),
    /// The source is not a directory.
    #[error("{0} is not a directory")]
    SourceNotADirectory(PathBuf),
    /// The destination lies inside the source, so the copy would never end.
    #[error("{to} lies inside {from}")]
    DestinationInsideSource { from: PathBuf, to: PathBuf },
    /// Reading the source tree failed.
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Writing into the destination failed.
    #[error("writing {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A device, socket or pipe in the source: not part of a Python package.
    #[error("{0} is neither a file, a directory nor a symbolic link")]
    #[strum(serialize = "unsupported_file_type")]
    Unsupported(PathBuf),
}

kvpool_runtime::error_category!(InstallError);

/// What one install copied.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InstallReport {
    pub from: PathBuf,
    pub to: PathBuf,
    pub files: u64,
    pub directories: u64,
    pub links: u64,
    pub bytes: u64,
}

impl fmt::Display for InstallReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "installed the kvpool Python package: {} files ({} bytes), {} directories and {} links \
             from {} into {}",
            self.files,
            self.bytes,
            self.directories,
            self.links,
            self.from.display(),
            self.to.display()
        )
    }
}

fn read_err(path: &Path) -> impl FnOnce(io::Error) -> InstallError + '_ {
    move |source| InstallError::Read {
        path: path.to_owned(),
        source,
    }
}

fn write_err(path: &Path) -> impl FnOnce(io::Error) -> InstallError + '_ {
    move |source| InstallError::Write {
        path: path.to_owned(),
        source,
    }
}

/// Removes what stands at `path` (a file or link from an earlier run of the init container),
/// so that a read-only file there does not stop the copy.
fn clear(path: &Path) -> Result<(), InstallError> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => Ok(()),
        Ok(_) => fs::remove_file(path).map_err(write_err(path)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(write_err(path)(e)),
    }
}

/// Copies the tree at `from` into the directory `to` (created if absent). Entries already in
/// `to` with the same names are replaced; others are left alone.
pub fn install(from: &Path, to: &Path) -> Result<InstallReport, InstallError> {
    let meta = match fs::metadata(from) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(InstallError::MissingSource(from.to_owned()));
        }
        Err(e) => return Err(read_err(from)(e)),
    };
    if !meta.is_dir() {
        return Err(InstallError::SourceNotADirectory(from.to_owned()));
    }
    fs::create_dir_all(to).map_err(write_err(to))?;
    let source = fs::canonicalize(from).map_err(read_err(from))?;
    let dest = fs::canonicalize(to).map_err(read_err(to))?;
    if dest.starts_with(&source) {
        return Err(InstallError::DestinationInsideSource {
            from: source,
            to: dest,
        });
    }
    let mut report = InstallReport {
        from: from.to_owned(),
        to: to.to_owned(),
        ..InstallReport::default()
    };
    // Depth-first with an explicit stack: (directory in the source, its copy).
    let mut pending = vec![(from.to_owned(), to.to_owned())];
    while let Some((src_dir, dst_dir)) = pending.pop() {
        let mut entries = fs::read_dir(&src_dir)
            .map_err(read_err(&src_dir))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(read_err(&src_dir))?;
        entries.sort_by_key(fs::DirEntry::file_name);
        for entry in entries {
            let src = entry.path();
            let dst = dst_dir.join(entry.file_name());
            let kind = entry.file_type().map_err(read_err(&src))?;
            if kind.is_dir() {
                clear(&dst)?;
                fs::create_dir_all(&dst).map_err(write_err(&dst))?;
                fs::set_permissions(&dst, fs::Permissions::from_mode(0o755))
                    .map_err(write_err(&dst))?;
                report.directories += 1;
                pending.push((src, dst));
            } else if kind.is_symlink() {
                let target = fs::read_link(&src).map_err(read_err(&src))?;
                clear(&dst)?;
                std::os::unix::fs::symlink(&target, &dst).map_err(write_err(&dst))?;
                report.links += 1;
            } else if kind.is_file() {
                let mode = entry
                    .metadata()
                    .map_err(read_err(&src))?
                    .permissions()
                    .mode();
                clear(&dst)?;
                report.bytes += fs::copy(&src, &dst).map_err(write_err(&dst))?;
                // Readable by any user, executable where the source was; never writable by others.
                fs::set_permissions(&dst, fs::Permissions::from_mode((mode & 0o755) | 0o444))
                    .map_err(write_err(&dst))?;
                report.files += 1;
            } else {
                return Err(InstallError::Unsupported(src));
            }
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, text: &str, mode: u32) {
        fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        fs::write(path, text).expect("write");
        fs::set_permissions(path, fs::Permissions::from_mode(mode)).expect("chmod");
    }

    fn mode(path: &Path) -> u32 {
        fs::symlink_metadata(path)
            .expect("stat")
            .permissions()
            .mode()
            & 0o777
    }

    #[test]
    fn copies_the_tree_readable_by_everyone_and_again_over_itself() {
        let dir = tempfile::tempdir().expect("tempdir");
        let from = dir.path().join("opt/kvpool/python");
        write(&from.join("kvpool/__init__.py"), "x = 1\n", 0o600);
        write(&from.join("kvpool/_native.abi3.so"), "ELF", 0o755);
        write(
            &from.join("kvpool/adapters/vllm.py"),
            "class C: ...\n",
            0o644,
        );
        std::os::unix::fs::symlink("vllm.py", from.join("kvpool/adapters/alias.py"))
            .expect("symlink");
        let to = dir.path().join("mnt/kvpool-python");

        let report = install(&from, &to).expect("install");
        assert_eq!(
            (report.files, report.directories, report.links, report.bytes),
            (3, 2, 1, 6 + 3 + 13)
        );
        assert!(
            report.to_string().contains("3 files (22 bytes)"),
            "{report}"
        );
        assert_eq!(
            fs::read_to_string(to.join("kvpool/adapters/vllm.py")).expect("read"),
            "class C: ...\n"
        );
        assert_eq!(mode(&to.join("kvpool/__init__.py")), 0o644);
        assert_eq!(mode(&to.join("kvpool/_native.abi3.so")), 0o755);
        assert_eq!(mode(&to.join("kvpool/adapters")), 0o755);
        assert_eq!(
            fs::read_link(to.join("kvpool/adapters/alias.py")).expect("link"),
            Path::new("vllm.py")
        );

        // A second run (the init container restarted) replaces read-only files and links.
        fs::set_permissions(
            to.join("kvpool/__init__.py"),
            fs::Permissions::from_mode(0o444),
        )
        .expect("chmod");
        write(&from.join("kvpool/__init__.py"), "x = 2\n", 0o644);
        let again = install(&from, &to).expect("second install");
        assert_eq!(again.files, 3);
        assert_eq!(
            fs::read_to_string(to.join("kvpool/__init__.py")).expect("read"),
            "x = 2\n"
        );
    }

    #[test]
    fn refuses_a_missing_source_a_file_and_a_destination_inside_the_source() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("opt/kvpool/python");
        let err = install(&missing, &dir.path().join("to")).expect_err("no source");
        assert_eq!(err.category(), "missing_source");
        assert!(err.to_string().contains("opt/kvpool/python"), "{err}");
        assert!(
            err.to_string().contains("docker/kvpool.Dockerfile"),
            "{err}"
        );

        let file = dir.path().join("file");
        write(&file, "", 0o644);
        let err = install(&file, &dir.path().join("to")).expect_err("not a directory");
        assert_eq!(err.category(), "source_not_a_directory");

        let from = dir.path().join("src");
        write(&from.join("a.py"), "", 0o644);
        let err = install(&from, &from.join("inner")).expect_err("inside");
        assert_eq!(err.category(), "destination_inside_source");
    }
}

//! `kvpool operator crd`: writes the CustomResourceDefinitions rendered by `kvpool_crd` into a
//! directory (one file per kind) or to stdout. I/O boundary: the output directory / stdout.

use std::io::Write;
use std::path::{Path, PathBuf};

use kvpool_crd::{CrdError, render_crds};

/// Failures of the `crd` subcommand.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum CrdCommandError {
    #[error("cannot render the CRDs")]
    Render(#[source] CrdError),
    #[error("cannot create directory {path}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write to stdout")]
    Stdout(#[source] std::io::Error),
}

kvpool_runtime::error_category!(CrdCommandError);

/// Write one `<plural>.kvpool.dev.yaml` per kind into `dir` (created if missing). Returns the
/// paths written, in the order of `kvpool_crd::crds`.
pub fn write_dir(dir: &Path) -> Result<Vec<PathBuf>, CrdCommandError> {
    std::fs::create_dir_all(dir).map_err(|source| CrdCommandError::CreateDir {
        path: dir.to_owned(),
        source,
    })?;
    let mut written = Vec::new();
    for crd in render_crds().map_err(CrdCommandError::Render)? {
        let path = dir.join(&crd.file_name);
        std::fs::write(&path, crd.yaml.as_bytes()).map_err(|source| CrdCommandError::Write {
            path: path.clone(),
            source,
        })?;
        written.push(path);
    }
    Ok(written)
}

/// Write every CRD to `out` as one multi-document stream.
pub fn write_stream(out: &mut impl Write) -> Result<(), CrdCommandError> {
    let yaml = kvpool_crd::crds_yaml().map_err(CrdCommandError::Render)?;
    out.write_all(yaml.as_bytes())
        .map_err(CrdCommandError::Stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_one_file_per_kind() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("crds");
        let paths = write_dir(&out).expect("write");
        let names: Vec<String> = paths
            .iter()
            .filter_map(|p| p.file_name()?.to_str().map(str::to_owned))
            .collect();
        assert_eq!(
            names,
            [
                "kvcachepools.kvpool.dev.yaml",
                "prefillpools.kvpool.dev.yaml",
                "decodepools.kvpool.dev.yaml"
            ]
        );
        let text = std::fs::read_to_string(&paths[0]).expect("read");
        assert!(text.contains("kind: CustomResourceDefinition"), "{text}");
        let mut stream = Vec::new();
        write_stream(&mut stream).expect("stream");
        assert_eq!(
            String::from_utf8(stream)
                .expect("utf8")
                .matches("kind: CustomResourceDefinition")
                .count(),
            3
        );
    }

    #[test]
    fn reports_an_unwritable_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("not-a-dir");
        std::fs::write(&file, b"x").expect("write");
        let err = write_dir(&file).expect_err("a file is not a directory");
        assert_eq!(err.category(), "create_dir");
    }
}

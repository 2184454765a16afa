//! Generates Rust code for every `.proto` file under `proto/`: messages and gRPC clients always,
//! server stubs behind the crate's `server` feature. Areas add their protos in their own folder
//! (`proto/<area>/*.proto`); nothing here needs to change.

use std::path::{Path, PathBuf};

fn collect(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "proto") {
            out.push(path);
        }
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new("proto");
    println!("cargo:rerun-if-changed=proto");
    let mut protos = Vec::new();
    if root.is_dir() {
        collect(root, &mut protos)?;
    }
    protos.sort();
    if protos.is_empty() {
        return Ok(());
    }
    tonic_prost_build::configure()
        // Clients build their own channels (Unix sockets, interceptors): no `connect` helpers,
        // so the crate needs no tonic transport.
        .build_transport(false)
        .server_mod_attribute(".", "#[cfg(feature = \"server\")]")
        .compile_protos(&protos, &[root.to_path_buf()])?;
    Ok(())
}

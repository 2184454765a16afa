//! `kvpool-agent`: the node agent run by the KVCachePool DaemonSet.

fn main() -> anyhow::Result<()> {
    println!("kvpool-agent {}", env!("CARGO_PKG_VERSION"));
    Ok(())
}

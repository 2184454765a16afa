//! `kvpool-operator`: reconciles KVCachePool, PrefillPool and DecodePool resources.

fn main() -> anyhow::Result<()> {
    println!("kvpool-operator {}", env!("CARGO_PKG_VERSION"));
    Ok(())
}

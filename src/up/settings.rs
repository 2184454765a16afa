//! From the flags of `kvpool up` to what it starts with: the validated settings (every flag
//! checked, naming the bad one), the ports of the children and the pool's random key.
//! I/O boundary: locating this executable and choosing free ports; the rest is pure.

use super::plan::UpSettings;
use super::{UpArgs, UpError};

/// Stand-in token width: fixed, so the conductor and the engines agree.
const CHUNK_BYTES: usize = 4;

pub(super) fn flag(flag: &'static str, problem: impl Into<String>) -> UpError {
    UpError::Flag(kvpool_core::flags::FlagError::new(flag, problem))
}

/// `tiers`: where the agents keep their DRAM tiers (see `shm`), if they persist.
pub(super) fn validate(
    args: &UpArgs,
    dir: std::path::PathBuf,
    tiers: Option<std::path::PathBuf>,
) -> Result<UpSettings, UpError> {
    if args.agents == 0 {
        return Err(flag("agents", "must be at least 1"));
    }
    if args.prefill == 0 {
        return Err(flag("prefill", "must be at least 1"));
    }
    if args.decode == 0 {
        return Err(flag("decode", "must be at least 1"));
    }
    if args.block_size == 0 {
        return Err(flag("block-size", "must be at least 1"));
    }
    if args.kv_bytes_per_token == 0 {
        return Err(flag("kv-bytes-per-token", "must be at least 1"));
    }
    if args.model.is_empty() {
        return Err(flag("model", "must not be empty"));
    }
    if !(args.speed.is_finite() && args.speed > 0.0) {
        return Err(flag(
            "speed",
            format!("must be a number > 0, got {}", args.speed),
        ));
    }
    if !(args.grace_s.is_finite() && args.grace_s >= 0.0) {
        return Err(flag("grace-s", "must be a number >= 0"));
    }
    if !(args.ready_timeout_s.is_finite() && args.ready_timeout_s > 0.0) {
        return Err(flag("ready-timeout-s", "must be a number > 0"));
    }
    let time_scale = args.time_scale.unwrap_or(1.0 / args.speed);
    if !(time_scale.is_finite() && time_scale >= 0.0) {
        return Err(flag("time-scale", "must be a number >= 0"));
    }
    if args.agent_dram.parse::<bytesize::ByteSize>().is_err() {
        return Err(flag(
            "agent-dram",
            format!("`{}` is not a size like 64MiB", args.agent_dram),
        ));
    }
    // Every child is this executable with its role as the first argument.
    let self_exe = std::env::current_exe().map_err(UpError::SelfExe)?;
    Ok(UpSettings {
        agents: args.agents,
        prefill: args.prefill,
        decode: args.decode,
        kvpool_bin: self_exe,
        dir,
        model: args.model.clone(),
        block_size: args.block_size,
        chunk_bytes: CHUNK_BYTES,
        kv_bytes_per_token: args.kv_bytes_per_token,
        agent_dram: args.agent_dram.clone(),
        time_scale,
        protocol: args.engine_protocol,
        sysfs_root: args.agent_sysfs_root.clone(),
        procfs_root: args.agent_procfs_root.clone(),
        dram_tiers: tiers,
    })
}

/// Ports for the children: consecutive from `base`, or free ones the kernel picks (held until
/// all are chosen so that none repeats).
pub(super) fn choose_ports(n: usize, base: u16, conductor: u16) -> Result<Vec<u16>, UpError> {
    let mut ports: Vec<u16> = if base != 0 {
        (0..n)
            .map(|i| u16::try_from(usize::from(base) + i).ok())
            .collect::<Option<_>>()
            .ok_or_else(|| flag("base-port", "leaves too few ports below 65536"))?
    } else {
        kvpool_harness::free_ports(n).map_err(UpError::Ports)?
    };
    // The conductor's API is the second to last port in the plan.
    if conductor != 0 && n >= 2 {
        if ports.contains(&conductor) {
            return Err(flag(
                "port",
                format!("{conductor} overlaps --base-port's range"),
            ));
        }
        ports[n - 2] = conductor;
    }
    Ok(ports)
}

pub(super) fn random_key() -> String {
    use rand::RngCore;
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_and_conductor_port_is_placed() {
        let p = choose_ports(6, 0, 0).unwrap();
        let mut q = p.clone();
        q.sort_unstable();
        q.dedup();
        assert_eq!(q.len(), 6);
        assert_eq!(choose_ports(3, 40000, 0).unwrap(), [40000, 40001, 40002]);
        assert_eq!(choose_ports(3, 40000, 9000).unwrap(), [40000, 9000, 40002]);
        assert!(choose_ports(3, 40000, 40001).is_err());
        assert!(choose_ports(3, 65534, 0).is_err());
    }
}

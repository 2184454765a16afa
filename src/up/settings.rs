//! From the flags of `kvpool up` to what it starts with: the validated settings (every flag
//! checked, naming the bad one), the ports of the children and the pool's random key.
//! I/O boundary: locating this executable and choosing free ports; the rest is pure.

use super::plan::UpSettings;
use super::{UpArgs, UpError};
use kvpool_crd::check_label_value;

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
    if args.block_size() == 0 {
        return Err(flag("block-size", "must be at least 1"));
    }
    let (vllm, served, kv_bytes_per_token) = match args.engine {
        super::UpEngine::Synthetic => (None, args.model.clone(), args.kv_bytes_per_token),
        super::UpEngine::Vllm => {
            let v = vllm_engine(args)?;
            let tp =
                super::vllm::tensor_parallel(&v.extra_args).map_err(|e| flag("engine-args", e))?;
            let shape = super::vllm::kv_shape(&v.model_dir, tp).map_err(|e| flag("model", e))?;
            let served = super::vllm::served_name(&v.model_dir);
            (Some(v), served, shape.bytes_per_token)
        }
    };
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
    if args.ready_timeout.is_zero() {
        return Err(flag("ready-timeout", "must be above zero"));
    }
    // Real engines run on the wall clock: no cost-model time to scale.
    let time_scale = match args.engine {
        super::UpEngine::Vllm => 1.0,
        super::UpEngine::Synthetic => args.time_scale.unwrap_or(1.0 / args.speed),
    };
    if !(time_scale.is_finite() && time_scale >= 0.0) {
        return Err(flag("time-scale", "must be a number >= 0"));
    }
    if args.agent_dram.parse::<bytesize::ByteSize>().is_err() {
        return Err(flag(
            "agent-dram",
            format!("`{}` is not a size like 64MiB", args.agent_dram),
        ));
    }
    if !(1..=8).contains(&args.replicas) {
        return Err(flag("replicas", "must be between 1 and 8"));
    }
    for d in &args.agent_failure_domains {
        // A failure domain is a node label's value in a cluster.
        if let Err(problem) = check_label_value(d) {
            return Err(flag(
                "agent-failure-domains",
                format!("{d:?} is not a failure domain: {problem}"),
            ));
        }
    }
    let master_flags = master_flags(args)?;
    // Every child is this executable with its role as the first argument.
    let self_exe = std::env::current_exe().map_err(UpError::SelfExe)?;
    Ok(UpSettings {
        agents: args.agents,
        prefill: args.prefill,
        decode: args.decode,
        kvpool_bin: self_exe,
        dir,
        model: served,
        block_size: args.block_size(),
        chunk_bytes: CHUNK_BYTES,
        kv_bytes_per_token,
        agent_dram: args.agent_dram.clone(),
        time_scale,
        protocol: args.engine_protocol,
        sysfs_root: args.agent_sysfs_root.clone(),
        procfs_root: args.agent_procfs_root.clone(),
        replicas: args.replicas,
        failure_domains: args.agent_failure_domains.clone(),
        master_flags,
        agent_flags: Vec::new(),
        dram_tiers: tiers,
        vllm,
        policy: args.policy,
    })
}

/// The vLLM engines of `--engine vllm`: the model directory (it must hold a config.json),
/// the Python to run them with, and the extra arguments.
fn vllm_engine(args: &UpArgs) -> Result<super::vllm::VllmEngine, UpError> {
    let model_dir = std::path::PathBuf::from(&args.model);
    if !model_dir.join("config.json").is_file() {
        return Err(flag(
            "model",
            format!(
                "{:?} is not a model directory (no config.json); --engine vllm serves a local \
                 model directory (scripts/make-models.py makes small ones)",
                args.model
            ),
        ));
    }
    let model_dir = model_dir
        .canonicalize()
        .map_err(|e| flag("model", format!("{}: {e}", model_dir.display())))?;
    let python = match &args.engine_python {
        Some(p) => p.clone(),
        None => {
            let tools = std::path::PathBuf::from(".tools/vllm/bin/python");
            if tools.exists() {
                // Absolute, but not resolved: a virtual environment's python is a symbolic
                // link, and resolving it would leave the environment.
                std::path::absolute(&tools).unwrap_or(tools)
            } else {
                "python3".into()
            }
        }
    };
    let extra_args = args
        .engine_args
        .as_deref()
        .map(|a| a.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default();
    Ok(super::vllm::VllmEngine {
        python,
        model_dir,
        extra_args,
    })
}

/// The master's eviction and spread flags: the policy, the watermarks (percent on the
/// command line, fractions for the master, both tiers) and, with failure domains, a
/// failure-domain spread.
fn master_flags(args: &UpArgs) -> Result<Vec<String>, UpError> {
    let mut out = vec![
        "--eviction-policy".to_owned(),
        args.eviction_policy.as_str().to_owned(),
    ];
    // The master's defaults, 95 / 85, when a flag is absent.
    let high = args.high_watermark_percent.unwrap_or(95);
    let low = args.low_watermark_percent.unwrap_or(85);
    if !(1..=100).contains(&high) {
        return Err(flag("high-watermark-percent", "must be between 1 and 100"));
    }
    if low >= high {
        return Err(flag(
            "low-watermark-percent",
            format!("must be below the high watermark ({high})"),
        ));
    }
    if args.high_watermark_percent.is_some() || args.low_watermark_percent.is_some() {
        let (high, low) = (
            (f64::from(high) / 100.0).to_string(),
            (f64::from(low) / 100.0).to_string(),
        );
        for tier in ["dram", "ssd"] {
            out.extend([
                format!("--{tier}-high-watermark"),
                high.clone(),
                format!("--{tier}-low-watermark"),
                low.clone(),
            ]);
        }
    }
    if !args.agent_failure_domains.is_empty() {
        out.extend(["--replica-spread".to_owned(), "failure-domain".to_owned()]);
    }
    Ok(out)
}

/// Ports for the children: consecutive from `base`, or free ones the kernel picks (held until
/// all are chosen so that none repeats).
/// `real_engines`: the children include real inference engines, which bind many port-0
/// sockets while they start; free ports are then taken below the kernel's ephemeral range,
/// where none of those binds can land on a port chosen for another child.
pub(super) fn choose_ports(
    n: usize,
    base: u16,
    conductor: u16,
    real_engines: bool,
) -> Result<Vec<u16>, UpError> {
    let mut ports: Vec<u16> = if base != 0 {
        (0..n)
            .map(|i| u16::try_from(usize::from(base) + i).ok())
            .collect::<Option<_>>()
            .ok_or_else(|| flag("base-port", "leaves too few ports below 65536"))?
    } else if real_engines {
        kvpool_harness::free_ports_below_ephemeral(n).map_err(UpError::Ports)?
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

    fn args(extra: &[&str]) -> UpArgs {
        use clap::Parser;
        #[derive(Parser)]
        struct Wrapper {
            #[command(flatten)]
            up: UpArgs,
        }
        let argv = std::iter::once("up").chain(extra.iter().copied());
        Wrapper::try_parse_from(argv).expect("parse").up
    }

    #[test]
    fn eviction_and_spread_flags_become_master_flags() {
        assert_eq!(
            master_flags(&args(&[])).expect("defaults"),
            ["--eviction-policy", "lru"]
        );
        let flags = master_flags(&args(&[
            "--eviction-policy",
            "lfu",
            "--high-watermark-percent",
            "90",
            "--low-watermark-percent",
            "0",
            "--agent-failure-domains",
            "rack-a,rack-b",
        ]))
        .expect("valid");
        for pair in [
            ["--eviction-policy", "lfu"],
            ["--dram-high-watermark", "0.9"],
            ["--dram-low-watermark", "0"],
            ["--ssd-high-watermark", "0.9"],
            ["--ssd-low-watermark", "0"],
            ["--replica-spread", "failure-domain"],
        ] {
            assert!(flags.windows(2).any(|w| w == pair), "{pair:?} in {flags:?}");
        }
        let bad = |extra: &[&str]| match master_flags(&args(extra)) {
            Err(UpError::Flag(f)) => f.flag,
            other => panic!("{extra:?}: {other:?}"),
        };
        assert_eq!(
            bad(&["--high-watermark-percent", "0"]),
            "high-watermark-percent"
        );
        assert_eq!(
            bad(&["--high-watermark-percent", "101"]),
            "high-watermark-percent"
        );
        assert_eq!(
            bad(&["--low-watermark-percent", "95"]),
            "low-watermark-percent"
        );
        assert!(check_label_value("rack-a").is_ok());
        for v in ["", "-a", "a b", "x".repeat(64).as_str()] {
            assert!(check_label_value(v).is_err(), "{v:?}");
        }
    }

    #[test]
    fn ports_are_distinct_and_conductor_port_is_placed() {
        let p = choose_ports(6, 0, 0, false).unwrap();
        let mut q = p.clone();
        q.sort_unstable();
        q.dedup();
        assert_eq!(q.len(), 6);
        assert_eq!(
            choose_ports(3, 40000, 0, false).unwrap(),
            [40000, 40001, 40002]
        );
        assert_eq!(
            choose_ports(3, 40000, 9000, false).unwrap(),
            [40000, 9000, 40002]
        );
        assert!(choose_ports(3, 40000, 40001, false).is_err());
        assert!(choose_ports(3, 65534, 0, false).is_err());
    }
}

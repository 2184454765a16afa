//! What `kvpool bench engine` reports: the driver's JSON (parsed), each arm's verification
//! (what the engine itself says about where the prompt tokens came from, and greedy token ids
//! equal across arms), the TTFT ratios and the acceptance targets, and the text table. Pure: no
//! I/O but stdout in [`print_text`].

use serde::{Deserialize, Serialize};

/// The arm with kvpool's own connector.
pub const KVPOOL: &str = "kvpool";
/// The arms of kvpool's own connector whose targets are reported (direct, agent mode).
pub const KVPOOL_ARMS: [&str; 2] = [KVPOOL, "kvpool-agent"];
/// The arm with vLLM's `MooncakeStoreConnector` on real Mooncake Store.
pub const MOONCAKE: &str = "mooncake";
/// The arm without a KV connector.
pub const NONE: &str = "none";

/// A TTFT sample set, in milliseconds.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub median_ms: f64,
    pub p90_ms: f64,
    pub min_ms: f64,
    pub mean_ms: f64,
    #[serde(default)]
    pub samples_ms: Vec<f64>,
}

/// Prompt tokens of one request by where the engine says they came from: vLLM's
/// `vllm:prompt_tokens_by_source_total`; SGLang's `meta_info` of the request
/// (`cached_tokens_details`: `storage` is `external_kv_transfer`, `device` + `host` are
/// `local_cache_hit`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Sources {
    #[serde(default)]
    pub local_compute: i64,
    #[serde(default)]
    pub local_cache_hit: i64,
    #[serde(default)]
    pub external_kv_transfer: i64,
}

/// The shared-prefix throughput workload on one arm's reader engine.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Throughput {
    pub requests: usize,
    pub completed: usize,
    #[serde(default)]
    pub errors: Vec<String>,
    pub wall_s: f64,
    pub output_tokens: u64,
    pub output_tok_per_s: f64,
    pub mean_ttft_ms: f64,
    pub sources: Sources,
}

/// How long the driver waited for an arm's store to settle after the writer's request.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Settle {
    pub keys: i64,
    pub waited_s: f64,
}

/// One arm, as the driver reports it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ArmRun {
    pub arm: String,
    /// TTFT of the first request of a new prefix on the reader engine: loaded from the store
    /// (recomputed on `none`).
    pub loaded: Summary,
    /// TTFT of the next request with the same prefix: vLLM's own prefix-cache hit.
    pub hit: Summary,
    pub sources_loaded: Vec<Sources>,
    pub sources_hit: Vec<Sources>,
    /// TTFT of a third request with the same prefix after the engine sat idle
    /// `idle_hit_after_s`: vLLM's prefix-cache hit on KV cache memory that was left alone,
    /// as a first request's load touches memory that was (absent when not measured).
    #[serde(default)]
    pub idle_hit: Option<Summary>,
    #[serde(default)]
    pub idle_hit_after_s: f64,
    #[serde(default)]
    pub sources_idle_hit: Vec<Sources>,
    #[serde(default)]
    pub ids_idle_hit: Vec<Vec<u32>>,
    /// TTFT of the short request the reader engine served just before each first request
    /// (`--warm-first`; absent without it): after the settle wait's idle, what an engine's
    /// first request would otherwise pay.
    #[serde(default)]
    pub warm: Option<Summary>,
    /// Its prompt tokens' sources: all computed (under one block, nothing to load or hit).
    #[serde(default)]
    pub sources_warm: Vec<Sources>,
    #[serde(default)]
    pub settle: Vec<Settle>,
    pub ids_loaded: Vec<Vec<u32>>,
    pub ids_hit: Vec<Vec<u32>>,
    pub throughput: Option<Throughput>,
    /// The arms whose engines ran at the same time as this one's.
    #[serde(default)]
    pub group: Vec<String>,
    /// Seconds until the group's engines all answered /health.
    #[serde(default)]
    pub startup_s: f64,
    /// The load average when the group started and ended.
    #[serde(default)]
    pub load_average: String,
    /// What engine B logged about its connector.
    #[serde(default)]
    pub connector_line: String,
    /// MiB of transparent huge pages engine B's processes had mapped after the rounds.
    #[serde(default)]
    pub reader_thp_mib: Option<f64>,
}

/// The driver's output.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct DriverRun {
    /// `vllm` or `sglang`.
    #[serde(default = "default_engine")]
    pub engine: String,
    /// The engine's version.
    #[serde(alias = "vllm")]
    pub version: String,
    #[serde(default)]
    pub mooncake: Option<String>,
    pub arms: Vec<ArmRun>,
}

/// What the run was asked to do (for the checks and the report).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Workload {
    pub model: String,
    pub prefix_tokens: u64,
    pub suffix_tokens: u64,
    pub block_size: u64,
    pub repeats: usize,
    pub max_tokens: u64,
    pub omp_threads: u64,
    /// Whether the reader engine served a short request of its own just before each first
    /// request (`--warm-first`).
    pub warm_first: bool,
    /// The page size of both stores' DRAM (`--store-hugepages`).
    pub store_hugepages: String,
    /// Whether every engine's CPU allocations used transparent huge pages (`--engine-thp`).
    pub engine_thp: bool,
    /// How kvpool's connector loads: `--layerwise-load` and `--early-load`, e.g.
    /// "layerwise auto, early auto".
    pub kvpool_loads: String,
    /// Where kvpool's Python package came from (a release build of the extension, or the
    /// venv's installed one).
    pub kvpool_package: String,
    pub load_average: String,
}

/// One arm's checks.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ArmCheck {
    pub arm: String,
    /// Every store-loaded request had at least the prefix's tokens from the connector
    /// (`external_kv_transfer`) and none from vLLM's own cache; on `none`, none from either.
    pub loaded_from_store: bool,
    /// Every second request had the prefix from vLLM's own prefix cache.
    pub hit_from_cache: bool,
    /// Greedy token ids of every request equal the first arm's (the same prompts).
    pub ids_equal: bool,
    /// Prompt tokens the store supplied per loaded request (minimum over the rounds).
    pub min_external_tokens: i64,
    pub notes: Vec<String>,
}

/// The acceptance targets of one of kvpool's connector arms.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Target {
    pub arm: String,
    /// Which prefix-cache hit is the reference: `none`'s (vLLM without a connector) when it
    /// ran in the same group, else this arm's own engine's.
    pub reference: String,
    /// Loaded TTFT over the reference hit (median over median).
    pub over_prefix_hit: f64,
    /// Loaded TTFT over real Mooncake's loaded TTFT, when Mooncake ran.
    pub over_mooncake: Option<f64>,
    /// Target 1: loaded TTFT <= 1.2 x vLLM's own prefix-cache hit.
    pub vs_prefix_hit: bool,
    /// Target 2: loaded TTFT <= real Mooncake's, in the same run.
    pub vs_mooncake: Option<bool>,
}

/// Ratios of medians and the acceptance targets.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Ratios {
    /// Per store arm: its loaded TTFT over vLLM's own prefix-cache hit without a connector
    /// (`none`'s hit), and over the same engine's own hit.
    pub loaded_over_none_hit: Vec<(String, f64)>,
    pub loaded_over_own_hit: Vec<(String, f64)>,
    /// Per arm: loaded TTFT over recomputing (`none`'s loaded).
    pub loaded_over_recompute: Vec<(String, f64)>,
    /// Per store arm, when idle hits were measured: its loaded TTFT over `none`'s prefix-cache
    /// hit after idling (its own engine's without `none`). Informative: the targets stay
    /// against the hot hit.
    #[serde(default)]
    pub loaded_over_idle_hit: Vec<(String, f64)>,
    /// For `kvpool` and `kvpool-agent`, when they ran.
    pub targets: Vec<Target>,
}

/// The report of `kvpool bench engine`.
#[derive(Clone, Debug, Serialize)]
pub struct EngineReport {
    pub workload: Workload,
    pub run: DriverRun,
    pub checks: Vec<ArmCheck>,
    pub ratios: Ratios,
    /// Every arm passed every check.
    pub all_verified: bool,
    /// This machine's cost of reading memory that sat idle (`crate::idle_memory::probe`),
    /// measured before the engines start: a first request touches memory idle for seconds
    /// (the saved blocks, the engine's free KV cache blocks), a hit does not.
    pub idle_memory: Option<crate::idle_memory::IdleRow>,
}

/// Parse the driver's output: its last line that starts a JSON object.
pub fn parse_run(stdout: &str) -> Result<DriverRun, String> {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or("the engine driver printed no JSON")?;
    serde_json::from_str(line).map_err(|e| format!("the engine driver's JSON: {e}"))
}

/// Tokens a connector can supply for a prompt of `prefix + suffix` tokens whose first
/// `prefix` are stored: the stored full blocks, leaving at least the last token to compute.
pub fn expected_external(prefix: u64, suffix: u64, block: u64) -> i64 {
    let block = block.max(1);
    let usable = (prefix + suffix).saturating_sub(1) / block;
    (usable.min(prefix / block) * block) as i64
}

fn check_arm(arm: &ArmRun, reference: Option<&ArmRun>, w: &Workload) -> ArmCheck {
    let want = expected_external(w.prefix_tokens, w.suffix_tokens, w.block_size);
    let mut notes = Vec::new();
    let store = arm.arm != NONE;
    let loaded_ok = |s: &Sources| {
        if store {
            s.external_kv_transfer >= want && s.local_cache_hit == 0
        } else {
            s.external_kv_transfer == 0 && s.local_cache_hit == 0
        }
    };
    let loaded_from_store = !arm.sources_loaded.is_empty()
        && arm.sources_loaded.len() == arm.loaded.n
        && arm.sources_loaded.iter().all(loaded_ok);
    if !loaded_from_store {
        notes.push(format!(
            "first requests' token sources {:?} (want {} from the {})",
            arm.sources_loaded,
            if store { want } else { 0 },
            if store {
                "connector, 0 from the engine's cache"
            } else {
                "connector and 0 from the engine's cache"
            }
        ));
    }
    let from_cache = |s: &Sources| s.local_cache_hit >= want && s.external_kv_transfer == 0;
    let hit_from_cache = !arm.sources_hit.is_empty() && arm.sources_hit.iter().all(from_cache);
    if !hit_from_cache {
        notes.push(format!(
            "second requests' token sources {:?} (want {want} from the engine's cache)",
            arm.sources_hit
        ));
    }
    let idle_hits = arm.idle_hit.as_ref().map_or(0, |h| h.n);
    let idle_from_cache = each_of(&arm.sources_idle_hit, idle_hits, from_cache);
    if !idle_from_cache {
        notes.push(format!(
            "idle hits' token sources {:?} (want {want} from the engine's cache in each of {idle_hits})",
            arm.sources_idle_hit
        ));
    }
    let hit_from_cache = hit_from_cache && idle_from_cache;
    let warm_requests = arm.warm.as_ref().map_or(0, |h| h.n);
    let computed = |s: &Sources| s.external_kv_transfer == 0 && s.local_cache_hit == 0;
    // A warm request that found blocks would have taken the first request's place.
    let warm_computed = each_of(&arm.sources_warm, warm_requests, computed);
    if !warm_computed {
        notes.push(format!(
            "warm requests' token sources {:?} (want all computed in each of {warm_requests})",
            arm.sources_warm
        ));
    }
    let loaded_from_store = loaded_from_store && warm_computed;
    let ids_equal = match reference {
        None => true,
        Some(r) => {
            let same = r.ids_loaded == arm.ids_loaded
                && r.ids_hit == arm.ids_hit
                && r.ids_idle_hit == arm.ids_idle_hit;
            if !same {
                notes.push(format!("greedy token ids differ from arm {}", r.arm));
            }
            same
        }
    } && arm
        .ids_loaded
        .iter()
        .chain(&arm.ids_hit)
        .all(|v| !v.is_empty());
    let min_external_tokens = arm
        .sources_loaded
        .iter()
        .map(|s| s.external_kv_transfer)
        .min()
        .unwrap_or(0);
    ArmCheck {
        arm: arm.arm.clone(),
        loaded_from_store,
        hit_from_cache,
        ids_equal,
        min_external_tokens,
        notes,
    }
}

/// Whether there are `n` requests' sources and every one passes `ok`.
fn each_of(sources: &[Sources], n: usize, ok: impl Fn(&Sources) -> bool) -> bool {
    sources.len() == n && sources.iter().all(ok)
}

fn over(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { f64::NAN }
}

/// The ratios of medians and the targets.
pub fn ratios(run: &DriverRun) -> Ratios {
    let find = |name: &str| run.arms.iter().find(|a| a.arm == name);
    let none = find(NONE);
    let stores = run.arms.iter().filter(|a| a.arm != NONE);
    let loaded_over_none_hit = none
        .map(|n| {
            stores
                .clone()
                .map(|a| (a.arm.clone(), over(a.loaded.median_ms, n.hit.median_ms)))
                .collect()
        })
        .unwrap_or_default();
    let loaded_over_own_hit = stores
        .clone()
        .map(|a| (a.arm.clone(), over(a.loaded.median_ms, a.hit.median_ms)))
        .collect();
    let loaded_over_recompute = none
        .map(|n| {
            stores
                .clone()
                .map(|a| (a.arm.clone(), over(a.loaded.median_ms, n.loaded.median_ms)))
                .collect()
        })
        .unwrap_or_default();
    let loaded_over_idle_hit = stores
        .clone()
        .filter_map(|a| {
            let reference = none
                .filter(|n| n.group == a.group)
                .and_then(|n| n.idle_hit.as_ref())
                .or(a.idle_hit.as_ref())?;
            Some((a.arm.clone(), over(a.loaded.median_ms, reference.median_ms)))
        })
        .collect();
    let mooncake = find(MOONCAKE);
    let targets = KVPOOL_ARMS
        .iter()
        .filter_map(|name| find(name))
        .map(|k| {
            let (reference, hit) = match none {
                Some(n) if n.group == k.group => (NONE, n.hit.median_ms),
                _ => (k.arm.as_str(), k.hit.median_ms),
            };
            let over_prefix_hit = over(k.loaded.median_ms, hit);
            let over_mooncake = mooncake.map(|m| over(k.loaded.median_ms, m.loaded.median_ms));
            Target {
                arm: k.arm.clone(),
                reference: reference.to_owned(),
                over_prefix_hit,
                over_mooncake,
                vs_prefix_hit: over_prefix_hit <= 1.2,
                vs_mooncake: over_mooncake.map(|r| r <= 1.0),
            }
        })
        .collect();
    Ratios {
        loaded_over_none_hit,
        loaded_over_own_hit,
        loaded_over_recompute,
        loaded_over_idle_hit,
        targets,
    }
}

/// The report of one run.
pub fn report(workload: Workload, run: DriverRun) -> EngineReport {
    let reference = run.arms.first();
    let checks: Vec<ArmCheck> = run
        .arms
        .iter()
        .enumerate()
        .map(|(i, a)| check_arm(a, if i == 0 { None } else { reference }, &workload))
        .collect();
    let all_verified = !checks.is_empty()
        && checks
            .iter()
            .all(|c| c.loaded_from_store && c.hit_from_cache && c.ids_equal);
    let ratios = ratios(&run);
    EngineReport {
        workload,
        run,
        checks,
        ratios,
        all_verified,
        idle_memory: None,
    }
}

fn default_engine() -> String {
    "vllm".into()
}

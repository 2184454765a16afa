#!/usr/bin/env bash
# The paper's placement-policy comparison on live engines (docs/scheduling.md, "TTFT per policy
# on live vLLM engines"): a shared-prefix workload derived from the Mooncake conversation trace
# (of its first WINDOW records, those of conversations with at least MIN_TURNS turns, a
# conversation being the records that share their second block, the first being the system
# prompt every record shares), replayed by `kvpool up --engine vllm` once per conductor policy,
# everything else equal; then `kvpool simulate` replays the same workload, scaled as the live
# replay scales it (src/up/vllm.rs, `scale_record`), with the prefill cost the conductor fitted
# on the live engines. Writes one summary per policy (`<policy>.json`, `kvpool up --json`), their
# logs, the machine's load around each run, the workload, its scaled form and the simulator's
# output into OUT_DIR, and prints a table.
#   scripts/up-policies.sh [OUT_DIR]          (default: target/up-policies)
# Environment (defaults in brackets): WINDOW [1000], MIN_TURNS [3], LIMIT [all], SPEED [1],
# MODEL [.tools/models/small],
# POLICIES ["conductor local-only least-load random"], AGENT_DRAM [512MiB], PREFILL [2],
# DECODE [1], TRACE [the conversation trace], KVPOOL [target/release/kvpool].
# Needs the vLLM environment and models of scripts/engines.sh and a release build.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/up-policies}
WINDOW=${WINDOW:-1000}
MIN_TURNS=${MIN_TURNS:-3}
LIMIT=${LIMIT:-1000000}
SPEED=${SPEED:-1}
MODEL=${MODEL:-.tools/models/small}
POLICIES=${POLICIES:-conductor local-only least-load random}
AGENT_DRAM=${AGENT_DRAM:-512MiB}
PREFILL=${PREFILL:-2}
DECODE=${DECODE:-1}
TRACE=${TRACE:-/work/shared/data/mooncake-traces/conversation_trace.jsonl}
KVPOOL=${KVPOOL:-target/release/kvpool}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$out"
echo "commit $(git rev-parse --short HEAD), $(date -u +%FT%TZ), $(nproc) cores" > "$out/load.txt"
python3 - "$TRACE" "$WINDOW" "$MIN_TURNS" "$out/workload.jsonl" <<'EOF'
import collections, json, sys
trace, window, min_turns, dest = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
recs = []
with open(trace) as f:
    for line in f:
        if line.strip() and len(recs) < window:
            recs.append(json.loads(line))
turns = collections.Counter(r["hash_ids"][1] for r in recs if len(r["hash_ids"]) > 1)
with open(dest, "w") as w:
    for r in recs:
        if len(r["hash_ids"]) > 1 and turns[r["hash_ids"][1]] >= min_turns:
            w.write(json.dumps(r) + "\n")
EOF
workload="$out/workload.jsonl"
echo "workload: $(wc -l <"$workload") records of the first $WINDOW of $TRACE (conversations of >= $MIN_TURNS turns)" >>"$out/load.txt"
for p in $POLICIES; do
  before=$(cut -d' ' -f1-3 /proc/loadavg)
  start=$(date +%s)
  rc=0
  "$KVPOOL" up --engine vllm --model "$MODEL" --prefill "$PREFILL" --decode "$DECODE" \
    --agent-dram "$AGENT_DRAM" --policy "$p" --replay "$workload" --limit "$LIMIT" \
    --speed "$SPEED" --ready-timeout 5m --json >"$out/$p.json" 2>"$out/$p.log" || rc=$?
  echo "$p: exit $rc, $(($(date +%s) - start)) s, load before $before, after $(cut -d' ' -f1-3 /proc/loadavg)" \
    | tee -a "$out/load.txt"
done

# The slice as the live replay sends it: each 512-token trace block one 32-token engine block,
# at most 1,024 tokens a prompt, outputs scaled alike (1 to 64 tokens).
python3 - "$workload" "$LIMIT" "$out/slice.jsonl" <<'EOF'
import json, sys
trace, limit, dest = sys.argv[1], int(sys.argv[2]), sys.argv[3]
recs = []
with open(trace) as f:
    for line in f:
        if line.strip():
            recs.append(json.loads(line))
recs.sort(key=lambda r: r["timestamp"])
with open(dest, "w") as w:
    for r in recs[:limit]:
        n = min(max(-(-r["input_length"] * 32 // 512), 1), 1024)
        o = min(max(-(-r["output_length"] * 32 // 512), 1), 64)
        w.write(json.dumps({"timestamp": r["timestamp"], "input_length": n,
                            "output_length": o, "hash_ids": r["hash_ids"][: -(-n // 32)]}) + "\n")
EOF

# The simulator with the live setup: the engines, their block size and KV bytes per token (the
# conductor's, from the model's config.json), vLLM's CPU cache (1 GiB) and the agents' DRAM as
# local caches and pool, and the prefill cost the conductor fitted in the `conductor` run.
python3 - "$out" "$MODEL" "$AGENT_DRAM" "$PREFILL" "$DECODE" <<'EOF' >"$out/sim-args.txt"
import json, sys, re
out, model, dram, prefill, decode = sys.argv[1:]
c = json.load(open(f"{model}/config.json"))
head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
kv = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head * 2
block = kv * 32
units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
m = re.fullmatch(r"(\d+)(KiB|MiB|GiB)", dram)
pool = int(m.group(1)) * units[m.group(2)] * 2 // block
fit = json.load(open(f"{out}/conductor.json"))["conductor_prefill_cost_fitted_s"]
args = ["--prefill", prefill, "--decode", decode, "--block-size", "32",
        "--kv-bytes-per-token", str(kv), "--local-cache-blocks", str((1 << 30) // block),
        "--pool-blocks", str(pool)]
for term in ("fixed", "linear", "quadratic"):
    if fit.get(term) is not None:
        args += [f"--prefill-{term}-s", repr(fit[term])]
print(" ".join(args))
EOF
# shellcheck disable=SC2046
"$KVPOOL" simulate --trace "$out/slice.jsonl" --compare --time-scale "$SPEED" \
  $(cat "$out/sim-args.txt") >"$out/sim.txt"
echo "simulate $(cat "$out/sim-args.txt") --time-scale $SPEED" >>"$out/load.txt"

python3 - "$out" $POLICIES <<'EOF'
import json, sys
out, policies = sys.argv[1], sys.argv[2:]
print("| policy | served | rejected | failed | TTFT mean ms | p50 | p90 | p99 | predicted p50 ms | observed p50 ms | ratio | median abs error |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
f = lambda v, fmt="{:.0f}": "-" if v is None else fmt.format(v)
for p in policies:
    try:
        s = json.load(open(f"{out}/{p}.json"))
    except (OSError, ValueError):
        print(f"| {p} | (no summary) |")
        continue
    t, e = s["ttft_ms"], s["ttft_prediction"]
    print(f"| {p} | {s['served']} | {s['rejected']} | {s['failed']} | {f(t['mean'])} | {f(t['p50'])} | "
          f"{f(t['p90'])} | {f(t['p99'])} | {f(e['median_predicted_ms'])} | {f(e['median_observed_ms'])} | "
          f"{f(e['median_ratio'], '{:.2f}')} | {f(e['median_abs_error_ratio'], '{:.0%}')} |")
EOF
cat "$out/load.txt" "$out/sim.txt"

#!/usr/bin/env bash
# Runs the cargo-fuzz targets of fuzz/ (one per decoder of outside input; docs/reliability.md,
# "Fuzzing"). Builds them once (stable toolchain, `-s none`: libFuzzer's coverage without a
# sanitizer, debug assertions and overflow checks on), then runs each from its committed
# seeds in fuzz/corpus/<target>/ (read only: new inputs go to a scratch corpus).
#
#   scripts/fuzz.sh --ci                  every target for $KVPOOL_FUZZ_SECONDS (10) seconds,
#                                         two at a time; what CI runs (.ci/run)
#   scripts/fuzz.sh --runs N [TARGET...]  each target (default: all) for N inputs, one at a
#                                         time; prints a table row per target (the long runs
#                                         recorded in docs/reliability.md)
#   scripts/fuzz.sh --seconds S [TARGET...]
#   --jobs N                              run N targets at a time (--ci: 2)
#   KVPOOL_FUZZ_MAX_SECONDS=S             with --runs: stop a target after S seconds anyway
#
# A crash (panic, failed assertion, timeout, out of memory) fails the script; the log names
# the reproducer file, which `cargo fuzz run -s none TARGET FILE` replays. Needs cargo-fuzz
# (scripts/tools.sh). Builds into $CARGO_TARGET_DIR/fuzz (default fuzz/target).
set -euo pipefail
cd "$(dirname "$0")/.."

mode=""
amount=""
jobs=1
targets=()
while (($#)); do
  case "$1" in
    --ci) mode=seconds amount="${KVPOOL_FUZZ_SECONDS:-10}" jobs=2 ;;
    --runs) mode=runs amount="${2:?--runs needs a count}"; shift ;;
    --seconds) mode=seconds amount="${2:?--seconds needs a duration}"; shift ;;
    --jobs) jobs="${2:?--jobs needs a count}"; shift ;;
    -h | --help) sed -n '2,19p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) targets+=("$1") ;;
  esac
  shift
done
if [ -z "$mode" ]; then
  echo "fuzz.sh: give --ci, --runs N or --seconds S (see --help)" >&2
  exit 2
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz.sh: cargo-fuzz is not installed; run scripts/tools.sh" >&2
  exit 1
fi
if ((${#targets[@]} == 0)); then
  mapfile -t targets < <(cargo fuzz list)
fi

target_dir="${CARGO_TARGET_DIR:-$PWD/fuzz/target}/fuzz"
triple="$(rustc -vV | sed -n 's/^host: //p')"
start=$SECONDS
cargo fuzz build -s none --target-dir "$target_dir"
echo "fuzz.sh: built ${#targets[@]} targets in $((SECONDS - start)) s"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
artifacts="${KVPOOL_FUZZ_ARTIFACTS:-$target_dir/artifacts}"

# Run one target; its log goes to $work/<target>.log, its crash inputs to $artifacts/<target>/.
run_one() {
  local t="$1"
  mkdir -p "$work/corpus/$t" "$artifacts/$t"
  local limit=(-max_total_time="$amount") seeds=()
  if [ "$mode" = runs ]; then
    limit=(-runs="$amount")
    [ -z "${KVPOOL_FUZZ_MAX_SECONDS:-}" ] || limit+=(-max_total_time="$KVPOOL_FUZZ_MAX_SECONDS")
  fi
  [ ! -d "fuzz/corpus/$t" ] || seeds=("fuzz/corpus/$t")
  "$target_dir/$triple/release/$t" "$work/corpus/$t" "${seeds[@]}" \
    "${limit[@]}" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$artifacts/$t/" >"$work/$t.log" 2>&1
}

# Summarise a finished target's log: inputs, exec/s, coverage, features.
report() {
  local t="$1" status="$2" log="$work/$1.log" runs speed cov ft
  runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)"
  speed="$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)"
  cov="$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)"
  ft="$(grep -o 'ft: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)"
  if [ "$status" -eq 0 ]; then
    printf '| %s | %s | %s | %s | %s | 0 |\n' "$t" "${runs:-?}" "${speed:-?}" "${cov:-?}" "${ft:-?}"
  else
    echo "fuzz.sh: $t FAILED (exit $status); the end of its log:" >&2
    tail -n 40 "$log" >&2
    local repro
    repro="$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -1)"
    if [ -n "$repro" ]; then
      echo "fuzz.sh: reproducer: $repro (replay: cargo fuzz run -s none $t $repro)" >&2
    fi
  fi
}

echo "| target | inputs | exec/s | cov | ft | crashes |"
echo "| --- | --- | --- | --- | --- | --- |"
failed=0
declare -A pids=()
# Wait for any one running target and report it.
reap() {
  local status=0 done_pid
  wait -n -p done_pid || status=$?
  report "${pids[$done_pid]}" "$status"
  ((status == 0)) || failed=1
  unset "pids[$done_pid]"
}
for t in "${targets[@]}"; do
  while ((${#pids[@]} >= jobs)); do reap; done
  run_one "$t" &
  pids[$!]="$t"
done
while ((${#pids[@]} > 0)); do reap; done
echo "fuzz.sh: ${#targets[@]} targets in $((SECONDS - start)) s (build included)"
exit "$failed"

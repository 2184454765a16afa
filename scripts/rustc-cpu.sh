#!/usr/bin/env bash
# A RUSTC_WRAPPER that measures the build CPU time of every crate: it runs rustc and appends
# one line per invocation, "<crate name> <crate types> <user s> <system s>", to the file named
# by RUSTC_CPU_LOG. CPU time, unlike the unit durations of `cargo build --timings`, does not
# grow when other work shares the cores, so two builds can be compared crate by crate:
#   RUSTC_WRAPPER=$PWD/scripts/rustc-cpu.sh RUSTC_CPU_LOG=/tmp/new.log \
#     CARGO_TARGET_DIR=/tmp/t cargo build --release -p kvpool --bin kvpool
#   scripts/rustc-cpu-report.py /tmp/old.log /tmp/new.log
set -u
name=unknown
kinds=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[$i]}" in
    --crate-name) name="${args[$((i + 1))]}" ;;
    --crate-type) kinds="$kinds${args[$((i + 1))]}," ;;
  esac
done
times="${RUSTC_CPU_LOG:?set RUSTC_CPU_LOG to the log file}.$$"
/usr/bin/time -f "%U %S" -o "$times" "$@"
status=$?
if [ -f "$times" ]; then
  echo "$name ${kinds:-none} $(tail -n 1 "$times")" >> "$RUSTC_CPU_LOG"
  rm -f "$times"
fi
exit "$status"

#!/usr/bin/env bash
# The default suite three times in a row with both cores busy (issue 28): clone COMMIT into
# a fresh directory, start two CPU busy loops at normal priority, run `.ci/run` (the README's
# test command) three times, and write each run's log and a summary line to OUT_DIR.
# Usage: scripts/loaded_suite.sh [COMMIT] [OUT_DIR]
set -u
commit=${1:-HEAD}
out=${2:-/tmp/loaded-suite}
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
d=$(mktemp -d)
mkdir -p "$out"
git clone -q "$repo" "$d" && git -C "$d" checkout -q "$commit" || exit 1
python3 -c "while True: pass" & b1=$!
python3 -c "while True: pass" & b2=$!
trap 'kill $b1 $b2; rm -rf "$d"' EXIT
for i in 1 2 3; do
  echo "run $i start $(date -u +%T) load $(cat /proc/loadavg)" >> "$out/summary.txt"
  start=$(date +%s)
  (cd "$d" && CI=true bash .ci/run) > "$out/run$i.log" 2>&1; rc=$?
  echo "run $i rc=$rc $(( $(date +%s) - start )) s, end load $(cat /proc/loadavg): $(tail -1 "$out/run$i.log")" \
    >> "$out/summary.txt"
done

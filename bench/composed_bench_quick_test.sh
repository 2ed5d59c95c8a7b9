#!/bin/bash
# Runs composed_bench --quick: it exits 1 when a predicted reach does not
# complete or one step more does not run out of memory, and its last line
# must be the JSON object with every prediction verified.
set -euo pipefail
bin="${TEST_SRCDIR}/${TEST_WORKSPACE}/bench/composed_bench"
out="${TEST_TMPDIR}/composed.out"
OPENBLAS_NUM_THREADS=1 "$bin" --quick >"$out" 2>&1 || { cat "$out"; echo "composed_bench --quick failed"; exit 1; }
cat "$out"
last="$(tail -n 1 "$out")"
case "$last" in
  '{"bench":"composed",'*'"verified":true,'*) ;;
  *) echo "last line is not the verified JSON object: $last"; exit 1 ;;
esac
# Both stacks ran a throughput comparison (two points).
[ "$(grep -c 'throughput at seq_len' "$out")" -eq 2 ] || { echo "expected 2 throughput lines"; exit 1; }

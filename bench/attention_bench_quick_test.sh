#!/bin/bash
# Runs attention_bench on the CPU at small shapes (a sequence off the
# 64-row tile, GQA 2): both arithmetics must run, agree within the rounding
# of P (the bench exits 1 otherwise) and end with the JSON line.
set -euo pipefail
bin="${TEST_SRCDIR}/${TEST_WORKSPACE}/bench/attention_bench"
out="${TEST_TMPDIR}/attention.out"
"$bin" --seq_lens=64,130 --heads=4 --kv_heads=2 --head_dim=64 --min_time_s=0 >"$out" 2>&1 ||
  { cat "$out"; echo "attention_bench failed"; exit 1; }
cat "$out"
last="$(tail -n 1 "$out")"
case "$last" in
  '{"bench":"attention",'*'"seq_len":130,"arithmetic":"tensor_core"'*'"failures":0}') ;;
  *) echo "last line is not the JSON object of a run with both arithmetics: $last"; exit 1 ;;
esac

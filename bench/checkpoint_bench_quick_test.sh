#!/bin/bash
# Runs checkpoint_bench on a small model, fp32 and bf16: it exits 1 when
# the two files differ, a load does not give the saved state back, or the
# streamed heap passes the budget's bound (by more than 1 MiB of
# bookkeeping); its last line must be the JSON object saying both held.
set -euo pipefail
bin="${TEST_SRCDIR}/${TEST_WORKSPACE}/bench/checkpoint_bench"
for p in fp32 bf16; do
  out="${TEST_TMPDIR}/checkpoint-$p.out"
  OPENBLAS_NUM_THREADS=1 "$bin" --reps=1 --layers=2 --hidden=64 --experts=4 --expert_ffn=64 --vocab=1000 \
    --precision=$p >"$out" 2>&1 || { cat "$out"; echo "checkpoint_bench --precision=$p failed"; exit 1; }
  cat "$out"
  last="$(tail -n 1 "$out")"
  case "$last" in
    '{"bench":"checkpoint",'*"\"precision\":\"$p\""*'"identical":true,"state_back":true}') ;;
    *) echo "last line is not the JSON object of a run that held: $last"; exit 1 ;;
  esac
done

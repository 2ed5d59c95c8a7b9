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

# --mfu_s: the all-on stack climbs from one quantum (1024 P tokens) to the
# longest context of a 12 MiB cap, in bf16; 60 s is ample here (~6 s), so
# the ladder must reach N_max, each rung longer than the last, at most 4x
# its FLOPs, with every peak within its plan and every loss finite.
mfu="${TEST_TMPDIR}/mfu.out"
OPENBLAS_NUM_THREADS=1 "$bin" --quick --ranks=2 --precision=bf16 --cap_mb=12 --mfu_s=60 --mfu_start=1 >"$mfu" 2>&1 \
  || { cat "$mfu"; echo "composed_bench --mfu_s failed"; exit 1; }
cat "$mfu"
tail -n 1 "$mfu" | python3 -c '
import json, sys
d = json.load(sys.stdin)
assert d["bench"] == "composed_mfu" and d["precision"] == "bf16", d
assert d["bounded"] and d["finite"], "a peak over its plan or a loss not finite"
r = d["rungs"]
assert len(r) >= 3, "expected a ladder of at least 3 rungs, got %d" % len(r)
assert r[0]["seq_len"] == 2048, "the first rung is one quantum: %d" % r[0]["seq_len"]
for a, b in zip(r, r[1:]):
    assert b["seq_len"] > a["seq_len"], (a["seq_len"], b["seq_len"])
    assert b["model_flops"] <= 4 * a["model_flops"] * (1 + 1e-9), (a["seq_len"], b["seq_len"])
for g in r:
    assert 0 < g["peak_bytes"] <= g["planned_bytes"], g
    assert g["step_s"] > 0 and g["tflops"] > 0, g
    # The step of rank 0 by phase (kernels/phase_clock.h): every phase group
    # timed, the layers both ways taking time, and the phases inside the
    # timed step (the clock starts after its start and its last boundary passes
    # before Step returns) covering most of it, up to the rounding in the JSON
    # (four significant digits) and a stream thread waking late.
    ph = g["phases_s"]
    assert sorted(ph) == sorted(["embedding", "forward", "projection", "recompute", "backward",
                                 "grad_reduce", "grad_norm", "optimizer"]), ph
    assert all(v >= 0 for v in ph.values()), ph
    assert ph["forward"] > 0 and ph["backward"] > 0 and ph["projection"] > 0, ph
    assert 0.5 * g["step_s"] <= sum(ph.values()) <= g["step_s"] * 1.01 + 2e-3, (g["step_s"], ph)
assert d["reached_n_max"] and r[-1]["seq_len"] == d["longest_seq_len"] == d["n_max_seq_len"], d
print("mfu ladder: %s tokens in %d rungs, N_max reached" % (d["n_max_seq_len"], len(r)))
' || { echo "composed_bench --mfu_s: its JSON line does not hold"; exit 1; }

# A rung still running at the deadline: the watchdog ends the run then,
# with the JSON line (a rung cut in its timed step would bound the rate).
# The first rung here is N_max of a 24 MiB cap (the start, 30,000, is past
# it): 24,790 tokens at the smallest settings, ~30 s for its two steps on 2
# cores. 5 s cut it (finding N_max takes well under one), and with no rung
# done the run fails (exit 1).
cut="${TEST_TMPDIR}/cut.out"
t0=$(date +%s)
if OPENBLAS_NUM_THREADS=1 "$bin" --quick --ranks=2 --precision=bf16 --cap_mb=24 --mfu_s=5 --mfu_start=30000 >"$cut" 2>&1; then
  cat "$cut"; echo "a ladder with no rung done exited 0"; exit 1
fi
took=$(( $(date +%s) - t0 ))
cat "$cut"
[ "$took" -le 15 ] || { echo "the watchdog did not end the run at its deadline (${took} s)"; exit 1; }
tail -n 1 "$cut" | python3 -c '
import json, sys
d = json.load(sys.stdin)
assert d["rungs"] == [] and d["cut"]["seq_len"] == 24790 == d["n_max_seq_len"], d
assert 0 < d["cut"]["after_s"] <= 5, d["cut"]
' || { echo "the cut run's JSON line does not hold"; exit 1; }

#!/usr/bin/env bash
# plateau_train end to end on one rank (its own launcher, a real rank
# process, the file-store rendezvous): the flags choose the schedules,
# starting from the four baselines as --help says (its flags naming a
# baseline once set nothing, so every run had the demo job's PipelinedLLEP,
# SCO and OffloadStreamAdamW), and --keep_attention keeps the attention
# records (the same losses, a larger checkpoints peak).
set -euo pipefail
train="$1"
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
run() { "$train" --ranks=1 --steps=2 --log_every=1 --batch=2 "$@" 2>&1; }
# The last step line: "step 2/2  loss L  |g| ...  peak SETS[  host SETS]".
last_step() { grep '^step ' <<<"$1" | tail -1; }
loss() { last_step "$1" | sed -n 's/.*  loss \([^ ]*\) .*/\1/p'; }
device_peak() { last_step "$1" | sed 's/  host .*//' | sed -n "s/.* $2=\([0-9.]*\)MiB.*/\1/p"; }

base=$(run) || { echo "$base"; fail "the baseline run"; }
[ -n "$(loss "$base")" ] || { echo "$base"; fail "no step line"; }
# The baselines keep nothing on the host.
last_step "$base" | grep -q '  host ' && { echo "$base"; fail "the default run keeps state on the host"; }

offload=$(run --optimizer_placement=offload_stream) || { echo "$offload"; fail "offload_stream"; }
last_step "$offload" | grep -q 'host optimizer=' || { echo "$offload"; fail "offload_stream kept no optimizer on the host"; }
# Standard EP's worst-case plan, not PipelinedLLEP's bound, by default.
llep=$(run --dispatch=pipelined_llep --chunk_tokens=16) || { echo "$llep"; fail "pipelined_llep"; }
[ "$(device_peak "$llep" dispatch)" != "$(device_peak "$base" dispatch)" ] \
  || { echo "$base"; echo "$llep"; fail "the default dispatch is pipelined_llep's"; }
sco=$(run --checkpoints=sco --sco_host_budget_bytes=1048576) || { echo "$sco"; fail "sco"; }
last_step "$sco" | grep -q 'host checkpoints=' || { echo "$sco"; fail "sco pooled no checkpoint on the host"; }
last_step "$sco" | grep -q 'host optimizer=' && { echo "$sco"; fail "sco alone offloaded the optimizer"; }

# N = 2 x 32 tokens, 2 layers: 3 boundaries of 64 x 64 fp32 (0.05 MiB), and
# 2 records of 64 x (64 + 4) fp32 (0.03 MiB) kept.
kept=$(run --keep_attention=1) || { echo "$kept"; fail "keep_attention"; }
[ "$(loss "$kept")" = "$(loss "$base")" ] || fail "keep_attention changed the loss: $(loss "$kept") vs $(loss "$base")"
[ "$(device_peak "$base" checkpoints)" = "0.05" ] || { echo "$base"; fail "the boundaries' peak"; }
[ "$(device_peak "$kept" checkpoints)" = "0.08" ] || { echo "$kept"; fail "the records' peak"; }

if bad=$(run --keep_attention=2); then
  echo "$bad"
  fail "--keep_attention=2 was accepted"
fi
grep -q -- '--keep_attention: expected 0 or 1, got 2' <<<"$bad" || { echo "$bad"; fail "the refusal's message"; }
echo "PASS"

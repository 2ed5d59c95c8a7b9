#!/usr/bin/env bash
# //tools:device_check_test: tools/device-check's non-GPU parts, here where
# there is no GPU: a dry run (--dry-run, --skip-build: no CUDA build inside a
# test) with a tiny fake step, checking the JSON and the table it writes,
# that a failing step fails the run, and that without a step command the
# missing CUDA step is recorded as not_available rather than passed over;
# then the GPU path with stand-ins (a fake nvidia-smi and --prebuilt fake
# binaries), including the bf16 step stage: passing, refused by the step,
# and reporting the wrong precision; and the optimizers' bf16 stage.
set -euo pipefail
check=tools/device-check
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
# device-check's own scratch directories go here too, not to a shared /tmp
# (a run killed at its timeout leaves them).
export TMPDIR="$tmp"
fail() { echo "device_check_test: FAILED: $*"; exit 1; }

# 1. A dry run with a passing fake step.
"$check" --dry-run --skip-build --out="$tmp/ok" \
  --step-cmd='echo fake step running; echo "{\"status\": \"pass\", \"max_loss_diff\": 0.0, \"ranks\": 1}"' \
  >"$tmp/ok.stdout" 2>&1 || { cat "$tmp/ok.stdout"; fail "dry run exited $?"; }
for f in device-check.json table.txt device-check.log; do
  [ -s "$tmp/ok/$f" ] || fail "no $f in the output directory"
done
[ "$(ls "$tmp/ok" | wc -l)" -le 8 ] || fail "more than the 8 files the device tool brings back"
grep -q '^verdict: dry_run' "$tmp/ok.stdout" || fail "no verdict line in the printed table"
python3 - "$tmp/ok/device-check.json" <<'PY' || fail "device-check.json is not what a dry run writes"
import json, sys
d = json.load(open(sys.argv[1]))
by = {s["stage"]: s for s in d["stages"]}
assert d["mode"] == "dry_run" and d["verdict"] == "dry_run" and d["failed"] == [], d["verdict"]
assert d["preflight"]["gpus"] == 0 and d["preflight"]["no_gpu_reason"], d["preflight"]
assert by["build"]["status"] == "skipped", by["build"]
# What the one GPU call is for comes first: the twin tests, the step, the
# budget's predictions and the GEMM and copy ceilings, the MFU ladder and
# attention_bench, then the sanitizers (the tensor-core kernels' first)
# and the rest.
order = [s["stage"] for s in d["stages"]]
assert len(order) == len(set(order)), [n for n in order if order.count(n) > 1]
at = order.index
sanitizers = [n for n in order if n.startswith("sanitizer:")]
assert max(at(n) for n in order if n.startswith("test:")) < at("step") < at("bench:composed_bench:plan") \
    < at("bench:composed_bench:plan_bf16") < at("bench:sgemm_bench") < at("bench:copy_bench") \
    < at("bench:composed_bench:mfu") < at("bench:attention_bench") < at(sanitizers[0]), order
assert sanitizers[:2] == ["sanitizer:memcheck:tc", "sanitizer:racecheck:tc"], sanitizers
assert at(sanitizers[-1]) < at("bench:ring_dtp_bench") < at("bench:composed_bench:bf16"), order
for t in ("wgmma_probe_test", "cuda_twin_test", "cuda_bf16_twin_test", "cuda_attention_tc_twin_test",
          "cuda_model_twin_test", "nccl_communicator_test"):
    assert by["test:" + t]["status"] == "dry_run", by["test:" + t]
for tool in ("memcheck", "racecheck", "synccheck", "initcheck", "memcheck:attention",
             "racecheck:attention", "memcheck:bf16", "racecheck:bf16",
             "synccheck:bf16", "memcheck:tc", "racecheck:tc", "synccheck:tc", "initcheck:tc"):
    assert by["sanitizer:" + tool]["status"] == "dry_run", tool
assert "cuda_bf16_twin_test" in by["sanitizer:racecheck:bf16"]["detail"], by["sanitizer:racecheck:bf16"]
assert "cuda_attention_tc_twin_test" in by["sanitizer:initcheck:tc"]["detail"], by["sanitizer:initcheck:tc"]
assert by["step"]["status"] == "pass" and by["step"]["data"]["max_loss_diff"] == 0.0, by["step"]
for b in ("sgemm_bench", "copy_bench"):
    assert by["bench:" + b]["status"] == "dry_run"
# The benches' CUDA runs, each with --backend=cuda on one GPU; the composed
# step's N_max is predicted first at the card's cap (85% of it), and the
# step itself runs under a fixed 6 GiB cap (a step at the card's N_max
# outlasts the run).
cuda = ("attention_bench", "ring_dtp_bench", "dispatch_bench", "sco_bench", "optimizer_bench", "optimizer_bench:bf16",
        "step_bench", "step_bench:bf16", "composed_bench:plan", "composed_bench:plan_bf16", "composed_bench",
        "composed_bench:mfu", "composed_bench:bf16")
for b in cuda:
    st = by["bench:" + b]
    assert st["status"] == "dry_run" and "--backend=cuda" in st["detail"], st
# The step and the optimizers in both precisions, each asked for by name.
for b in ("step_bench", "optimizer_bench"):
    assert "--precision=fp32" in by["bench:" + b]["detail"], by["bench:" + b]
    assert "--precision=bf16" in by["bench:%s:bf16" % b]["detail"], by["bench:%s:bf16" % b]
assert "--plan_only" in by["bench:composed_bench:plan"]["detail"]
assert "--plan_only" in by["bench:composed_bench:plan_bf16"]["detail"]
assert "--precision=bf16" in by["bench:composed_bench:plan_bf16"]["detail"]
assert "--cap_mb=0" in by["bench:composed_bench:plan"]["detail"]  # no GPU: no card to size it by
assert "--cap_mb=6144 " in by["bench:composed_bench"]["detail"], by["bench:composed_bench"]
st = by["bench:composed_bench:bf16"]
assert "--precision=bf16" in st["detail"] and "--cap_mb=3072 " in st["detail"] and "--plan_only" not in st["detail"], st
# The MFU ladder: bf16 at the card's cap, its time what is left of the
# budget (a dry run names its most: the stage's 150 s less 10).
st = by["bench:composed_bench:mfu"]
assert "--precision=bf16" in st["detail"] and "--cap_mb=0 " in st["detail"] and "--mfu_s=140 " in st["detail"], st
assert by["bench:auto_settings_bench"]["status"] == "not_available"
PY

# 2. A failing step fails the run and is named.
if "$check" --dry-run --skip-build --out="$tmp/bad" \
     --step-cmd='echo "{\"status\": \"fail\", \"max_loss_diff\": 1.5}"' >"$tmp/bad.stdout" 2>&1; then
  fail "a failing step did not fail the run"
fi
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["verdict"]=="fail" and d["failed"]==["step"], d["failed"]' \
  "$tmp/bad/device-check.json" || fail "the failing step is not recorded"
grep -q 'failed step' "$tmp/bad/table.txt" || fail "the table does not name the failed stage"

# 2a. --only runs the stages it names (after the preflight and the build),
# and refuses, before anything runs, a pattern that names none.
"$check" --dry-run --skip-build --only='bench:composed_bench:mfu,test:wgmma*' --out="$tmp/only" >/dev/null 2>&1 \
  || fail "--only exited $?"
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
names = [s["stage"] for s in d["stages"]]
assert names == ["preflight", "build", "test:wgmma_probe_test", "bench:composed_bench:mfu"], names' \
  "$tmp/only/device-check.json" || fail "--only ran other stages"
rc=0
"$check" --dry-run --skip-build --only='bench:no_such_bench' --out="$tmp/only2" >"$tmp/only2.out" 2>&1 || rc=$?
[ "$rc" -eq 2 ] && grep -q "selects no stage" "$tmp/only2.out" || { cat "$tmp/only2.out"; fail "--only selecting nothing was not refused"; }
[ ! -e "$tmp/only2/device-check.json" ] || fail "--only selecting nothing ran stages"
rc=0
"$check" --dry-run --skip-build --only='bench:composed_bench:mfu,tset:*' --out="$tmp/only3" >"$tmp/only3.out" 2>&1 || rc=$?
[ "$rc" -eq 2 ] && grep -q "'tset:\*' selects no stage" "$tmp/only3.out" || { cat "$tmp/only3.out"; fail "a mistyped --only pattern was not refused"; }

# 3. No step command and no step test (its source is not in this test's
# runfiles, nothing is packed): recorded as not_available.
"$check" --dry-run --skip-build --out="$tmp/none" >"$tmp/none.stdout" 2>&1 || fail "run without a step exited $?"
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
s = [s for s in d["stages"] if s["stage"] == "step"][0]
assert s["status"] == "not_available" and "not yet available" in s["detail"], s' \
  "$tmp/none/device-check.json" || fail "the missing CUDA step is not recorded as not_available"

# 4. The GPU path's plumbing, with stand-ins: an nvidia-smi that lists one
# GPU and --prebuilt binaries (the twin tests and the step test) that write
# gtest's JSON and a bench's JSON line. A passing run passes; a skipped
# test fails it (skips count as failures where a GPU is present).
fake="$tmp/fake"
mkdir -p "$fake/bin" "$fake/lib" "$tmp/path"
cat >"$fake/bin/gtest" <<'SH'
#!/usr/bin/env bash
filter=""
for a in "$@"; do
  case "$a" in --gtest_output=json:*) out="${a#--gtest_output=json:}" ;; --gtest_filter=*) filter="${a#--gtest_filter=}" ;; esac
done
# One case per pattern of a filter (device-check's sanitizer filters name
# each case), one without; FAKE_MISSING_CASE: a pattern that matched nothing.
n=1
[ -n "$filter" ] && n=$(tr ':' '\n' <<<"$filter" | grep -c .)
[ -n "${FAKE_MISSING_CASE:-}" ] && n=$((n - 1))
skip=""
[ -n "${FAKE_SKIP:-}" ] && skip=',{"name":"B","status":"RUN","result":"SKIPPED"}'
# FAKE_ENV: where each test says the wgmma switch it saw; FAKE_SLOW: seconds
# each takes; FAKE_PROBE_FAILS: the wgmma probe's test fails.
[ -n "${FAKE_ENV:-}" ] && echo "$(basename "$0") PLATEAU_TC_WGMMA=${PLATEAU_TC_WGMMA:-unset} CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-unset}" >>"$FAKE_ENV"
[ -n "${FAKE_SLOW:-}" ] && sleep "$FAKE_SLOW"
failures=""
[ -n "${FAKE_PROBE_FAILS:-}" ] && [ "$(basename "$0")" = wgmma_probe_test ] && failures=',"failures":[{"failure":"x"}]'
cases=""
for ((i = 0; i < n; ++i)); do
  [ -n "$cases" ] && cases="$cases,"
  cases="$cases{\"name\":\"A$i\",\"status\":\"RUN\",\"result\":\"COMPLETED\"$([ "$i" -eq 0 ] && echo "$failures")}"
done
[ -z "$cases" ] && skip="${skip#,}"
echo "{\"testsuites\":[{\"name\":\"S\",\"testsuite\":[$cases$skip]}]}" >"$out"
SH
printf '#!/bin/sh\necho table\nif [ -n "$FAKE_BAD_JSON" ]; then echo "{\\"cuda\\": "; else echo %s; fi\n' "'{\"cpu\":{},\"cuda\":{\"gflops\":2}}'" >"$fake/bin/bench"
printf '#!/bin/sh\nif [ "$1" = -L ]; then echo "GPU 0: Fake"; elif [ "$1" = --query-gpu=memory.total ]; then echo 1000; else echo "Fake, 580, Default, 1000 MiB, 0 MiB"; fi\n' >"$tmp/path/nvidia-smi"
# compute-sanitizer's stand-in runs the test it is given and finds nothing;
# FAKE_SANITIZER=refuses answers as on an H200 under gVisor,
# FAKE_SANITIZER=finds as a run that found an error; FAKE_SANITIZER_SLOW:
# seconds each run takes.
cat >"$tmp/path/compute-sanitizer" <<'SH'
#!/usr/bin/env bash
[ -n "${FAKE_SANITIZER_SLOW:-}" ] && sleep "$FAKE_SANITIZER_SLOW"
[ -n "${FAKE_ENV:-}" ] && echo "compute-sanitizer CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-unset}" >>"$FAKE_ENV"
case "${FAKE_SANITIZER:-}" in
  refuses) echo "========= Error: Device not supported. Please refer to the Supported Devices section."; exit 1 ;;
  finds) echo "========= Invalid __global__ write of size 4 bytes"; echo "========= ERROR SUMMARY: 1 error"; exit 1 ;;
esac
while [ $# -gt 0 ]; do case "$1" in --tool|--error-exitcode) shift 2 ;; *) break ;; esac; done
"$@" >/dev/null || exit 1  # the test, which writes its JSON
echo "========= ERROR SUMMARY: 0 errors"
SH
# FAKE_CR: the bench fails after a progress line with a carriage return.
{ echo '#!/bin/sh'; cat <<'SH'
if [ -n "${FAKE_CR:-}" ]; then printf 'progress 10%%\rprogress 100%%\n'; exit 1; fi
SH
  tail -n +2 "$fake/bin/bench"; } >"$fake/bin/bench.new" && mv "$fake/bin/bench.new" "$fake/bin/bench"
chmod +x "$fake/bin/gtest" "$fake/bin/bench" "$tmp/path/nvidia-smi" "$tmp/path/compute-sanitizer"
for t in wgmma_probe_test cuda_twin_test cuda_bf16_twin_test cuda_attention_tc_twin_test cuda_model_twin_test nccl_communicator_test cuda_step_twin_test; do cp "$fake/bin/gtest" "$fake/bin/$t"; done
for b in sgemm_bench copy_bench attention_bench ring_dtp_bench dispatch_bench sco_bench optimizer_bench step_bench composed_bench; do
  cp "$fake/bin/bench" "$fake/bin/$b"
done
# The step's stand-in says which precision it ran (step_bench's JSON line
# names it): the one asked for, unless FAKE_PRECISION overrides it; with
# FAKE_REFUSE it refuses bf16 as a step whose backend does not compute it.
cat >"$fake/bin/step_bench" <<'SH'
#!/usr/bin/env bash
p=fp32
for a in "$@"; do case "$a" in --precision=*) p="${a#--precision=}" ;; esac; done
if [ -n "${FAKE_REFUSE:-}" ] && [ "$p" = bf16 ]; then
  echo "step_bench: UNIMPLEMENTED: the step refused --precision=bf16: precision: bf16 is not computed" >&2
  echo " seq_len     step_s      tok/s   model GF/s  of bf16"  # buffered stdout lands last
  exit 1
fi
echo "{\"bench\":\"step\",\"precision\":\"${FAKE_PRECISION:-$p}\",\"cuda\":{\"gflops\":2}}"
SH
chmod +x "$fake/bin/step_bench"
# The optimizers' stand-in says the precision it was asked for.
cat >"$fake/bin/optimizer_bench" <<'SH'
#!/usr/bin/env bash
p=fp32
for a in "$@"; do case "$a" in --precision=*) p="${a#--precision=}" ;; esac; done
echo "{\"bench\":\"optimizer\",\"precision\":\"$p\",\"cuda\":{\"gflops\":2}}"
SH
chmod +x "$fake/bin/optimizer_bench"
# The composed step's stand-in records its arguments: the cap it was given;
# with --mfu_s it answers as the MFU ladder does.
cat >"$fake/bin/composed_bench" <<SH
#!/usr/bin/env bash
echo "\$*" >>"$tmp/composed.args"
p=fp32
mfu=""
for a in "\$@"; do case "\$a" in --precision=*) p="\${a#--precision=}" ;; --mfu_s=*) mfu=1 ;; esac; done
if [ -n "\$mfu" ]; then
  ph='{"embedding":0.1,"forward":20,"projection":1,"recompute":20,"backward":58,"grad_reduce":0.5,"grad_norm":0.1,"optimizer":0.3}'
  echo "{\"bench\":\"composed_mfu\",\"precision\":\"\$p\",\"ranks\":1,\"mfu\":0.25,\"tflops\":247.3,\"longest_seq_len\":524288,\"n_max_seq_len\":1048576,\"rungs\":[{\"seq_len\":131072,\"mfu\":0.31},{\"seq_len\":524288,\"mfu\":0.25,\"phases_s\":\$ph,\"layer_forward_flops\":4.9e15,\"recompute_skipped_flops\":1.6e15,\"projection_flops\":2e14}]}"
else
  echo "{\"composed\":1,\"precision\":\"\$p\"}"
fi
SH
chmod +x "$fake/bin/composed_bench"
PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --out="$tmp/gpu" >"$tmp/gpu.stdout" 2>&1 \
  || { cat "$tmp/gpu.stdout"; fail "the fake GPU run failed"; }
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
by = {s["stage"]: s for s in d["stages"]}
assert d["mode"] == "gpu" and d["verdict"] == "pass", (d["mode"], d["verdict"], d["failed"])
assert by["test:cuda_twin_test"]["status"] == "pass" and by["test:cuda_twin_test"]["data"]["testsuites"]
assert by["bench:sgemm_bench"]["data"]["cuda"]["gflops"] == 2
for b in ("attention_bench", "ring_dtp_bench", "dispatch_bench", "sco_bench", "optimizer_bench",
          "optimizer_bench:bf16", "step_bench", "step_bench:bf16"):
    assert by["bench:" + b]["status"] == "pass" and by["bench:" + b]["data"]["cuda"]["gflops"] == 2, by["bench:" + b]
# Each step and optimizer run says which precision ran.
for b, p in (("step_bench", "fp32"), ("step_bench:bf16", "bf16"), ("optimizer_bench", "fp32"),
             ("optimizer_bench:bf16", "bf16")):
    st = by["bench:" + b]
    assert st["data"]["precision"] == p and st["detail"].startswith("precision %s, rc=0" % p), st
assert by["bench:composed_bench"]["status"] == "pass" and by["bench:composed_bench"]["data"]["composed"] == 1
assert by["bench:composed_bench:plan"]["status"] == "pass"
for b in ("composed_bench:plan_bf16", "composed_bench:bf16"):
    st = by["bench:" + b]
    assert st["status"] == "pass" and st["data"]["precision"] == "bf16" and st["detail"].startswith("precision bf16"), st
# The MFU ladder leads its row with its answer, and where its longest step
# went: the layers forward (4.9 PFLOP in 20 of 100 s), the recompute with
# the backward (three times that less the 1.6 PFLOP of attention forward a
# kept attention skips, in 78 s) and the projection (0.2 PFLOP in 1 s); then
# the shorter rung that ran at a higher MFU.
st = by["bench:composed_bench:mfu"]
assert st["status"] == "pass" and st["detail"].startswith(
    "MFU 25.0% (247.3 TFLOP/s) at 524288 tokens, N_max 1048576; layers forward 20% at 245, "
    "recompute+backward 78% at 167.9, projection 1% at 200 TFLOP/s; best MFU 31.0% at 131072 "
    "tokens; precision bf16, rc=0"), st
# The packed step test runs on the one fake GPU without its P = 2 case.
assert by["step"]["status"] == "pass" and "P = 2" in by["step"]["detail"], by["step"]' "$tmp/gpu/device-check.json" || fail "the fake GPU run's JSON"
# stages.tsv holds each stage's data itself (a run killed before its
# summary loses its scratch directory, not its figures).
grep -q $'^test:cuda_twin_test\t.*\t{"testsuites":' "$tmp/gpu/stages.tsv" \
  || { cat "$tmp/gpu/stages.tsv"; fail "stages.tsv does not hold the twin test's JSON"; }
grep -q $'^bench:sgemm_bench\t.*\t{"cpu":{},"cuda":{"gflops":2}}$' "$tmp/gpu/stages.tsv" \
  || { cat "$tmp/gpu/stages.tsv"; fail "stages.tsv does not hold the bench's JSON line"; }
# The fake card has 1000 MiB: the two predictions and the MFU ladder get
# 85% of it (the ladder all of its 150 s less 10: the fake stages before it
# take no time), the step its fixed 6 GiB.
[ "$(grep -c -- '--cap_mb=850 ' "$tmp/composed.args")" -eq 3 ] || { cat "$tmp/composed.args"; fail "the predictions' cap"; }
[ "$(grep -c -- '--cap_mb=850 --mfu_s=140 --keep_attention=1 ' "$tmp/composed.args")" -eq 1 ] \
  || { cat "$tmp/composed.args"; fail "the MFU ladder's cap and time, attention kept"; }
[ "$(grep -c -- '--cap_mb=6144 ' "$tmp/composed.args")" -eq 1 ] || { cat "$tmp/composed.args"; fail "the composed step's cap"; }
[ "$(grep -c -- '--precision=bf16 --cap_mb=3072 ' "$tmp/composed.args")" -eq 1 ] || { cat "$tmp/composed.args"; fail "the bf16 composed step's cap"; }
grep -q -- '--plan_only' "$tmp/composed.args" || fail "no N_max prediction run"
# With less of the budget left than the bf16 composed step's limit, that
# optional stage is skipped, not run and cut, and so is the MFU ladder with
# less than its 45 s left: the run still passes.
PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --budget=40 --out="$tmp/short" >/dev/null 2>&1 \
  || { cat "$tmp/short/table.txt"; fail "a short budget failed the run"; }
grep -q 'bench:composed_bench:bf16 *skipped' "$tmp/short/table.txt" || { cat "$tmp/short/table.txt"; fail "the optional stage was not skipped"; }
grep -q 'bench:composed_bench:mfu *skipped .*it needs 45s' "$tmp/short/table.txt" || { cat "$tmp/short/table.txt"; fail "the MFU ladder was not skipped"; }
# A skipped stage says how to run it in a call of its own.
python3 -c '
import json, sys
by = {s["stage"]: s for s in json.load(open(sys.argv[1]))["stages"]}
for name in ("bench:composed_bench:mfu", "bench:composed_bench:bf16"):
    d = by[name]["detail"]
    assert "run it alone: tools/device-check --prebuilt=%s --only=%s --budget=" % (sys.argv[2], name) in d, d' \
  "$tmp/short/device-check.json" "$fake" || fail "a skipped stage does not say how to run it alone"
grep -q 'bench:composed_bench  *pass' "$tmp/short/table.txt" || fail "a stage that must run was skipped"
# A second call for the MFU ladder alone gives it all that is left of its
# budget, not just the stage's 150 s.
: >"$tmp/composed.args"
PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --only=bench:composed_bench:mfu --budget=300 --out="$tmp/mfuonly" >/dev/null 2>&1 \
  || { cat "$tmp/mfuonly/table.txt"; fail "the MFU ladder alone failed"; }
mfu_s=$(sed -n 's/.*--mfu_s=\([0-9]*\).*/\1/p' "$tmp/composed.args")
[ "$(wc -l <"$tmp/composed.args")" -eq 1 ] && [ "${mfu_s:-0}" -gt 250 ] \
  || { cat "$tmp/composed.args"; fail "the MFU ladder alone did not get the budget"; }
if FAKE_SKIP=1 PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --out="$tmp/gpuskip" >/dev/null 2>&1; then
  fail "a skipped twin test on a GPU did not fail the run"
fi
grep -q 'test:cuda_twin_test *fail' "$tmp/gpuskip/table.txt" || fail "the skipped twin test is not marked failed"

# 4a. The bf16 step refused (its backend does not compute bf16): the stage
# fails, saying the precision did not run and quoting the step's refusal;
# the fp32 run still passes. A bench that ran fp32 when asked for bf16
# fails too.
if FAKE_REFUSE=1 PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --out="$tmp/refused" >/dev/null 2>&1; then
  fail "a step that refused bf16 did not fail the run"
fi
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
by = {s["stage"]: s for s in d["stages"]}
assert d["failed"] == ["bench:step_bench:bf16"], d["failed"]
st = by["bench:step_bench:bf16"]
assert st["detail"].startswith("precision bf16 NOT run, rc=1") and "the step refused --precision=bf16" in st["detail"], st
assert by["bench:step_bench"]["status"] == "pass", by["bench:step_bench"]' "$tmp/refused/device-check.json" \
  || fail "the refused bf16 step is not recorded as such"
grep -q 'bench:step_bench:bf16 *fail *[0-9]* *precision bf16 NOT run' "$tmp/refused/table.txt" \
  || { cat "$tmp/refused/table.txt"; fail "the table does not say the bf16 step did not run"; }
if FAKE_PRECISION=fp32 PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --out="$tmp/wrongp" >/dev/null 2>&1; then
  fail "a bf16 run that reported fp32 did not fail the run"
fi
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
st = [s for s in d["stages"] if s["stage"] == "bench:step_bench:bf16"][0]
assert d["failed"] == ["bench:step_bench:bf16"] and "says precision fp32" in st["detail"], (d["failed"], st)' \
  "$tmp/wrongp/device-check.json" || fail "the bf16 run that ran fp32 is not recorded as such"

# 4a. compute-sanitizer refusing the device is not a failure of the
# kernels: the first run is not_available quoting the tool, the rest are
# not tried, and the run passes. A sanitizer that finds an error fails it.
FAKE_SANITIZER=refuses PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --out="$tmp/refuses" >/dev/null 2>&1 \
  || { cat "$tmp/refuses/table.txt"; fail "a sanitizer that refused the device failed the run"; }
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
san = [s for s in d["stages"] if s["stage"].startswith("sanitizer:")]
assert len(san) == 13 and all(s["status"] == "not_available" for s in san), [(s["stage"], s["status"]) for s in san]
assert "refused this device: ========= Error: Device not supported" in san[0]["detail"], san[0]
assert all(s["detail"].startswith("not run: compute-sanitizer refused") for s in san[1:]), san[1]' \
  "$tmp/refuses/device-check.json" || fail "the refusing sanitizer is not recorded as such"
if FAKE_SANITIZER=finds PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --out="$tmp/finds" >/dev/null 2>&1; then
  fail "a sanitizer that found an error did not fail the run"
fi
grep -q 'sanitizer:memcheck  *fail' "$tmp/finds/table.txt" || { cat "$tmp/finds/table.txt"; fail "the sanitizer's finding is not a fail"; }
# A sanitizer run whose cases were skipped (a backend that cannot start
# under the tool skips them and exits 0) ran nothing: a fail, as a skipped
# twin test is.
if FAKE_SKIP=1 PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --only='sanitizer:*' --out="$tmp/sanskip" \
     >/dev/null 2>&1; then
  fail "sanitizer runs whose cases skipped passed"
fi
grep -q 'sanitizer:memcheck  *fail .*1 skipped' "$tmp/sanskip/table.txt" \
  || { cat "$tmp/sanskip/table.txt"; fail "the skipped sanitizer run is not a fail naming the skip"; }
# A filter naming a case its binary no longer has (renamed): fewer cases
# run than the filter names, a fail (tools/device_check_filters_test checks
# the names themselves against the default build).
if FAKE_MISSING_CASE=1 PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --only='sanitizer:*' --out="$tmp/sanmiss" \
     >/dev/null 2>&1; then
  fail "sanitizer runs with a filter case missing passed"
fi
grep -q 'sanitizer:memcheck:bf16  *fail .*1 tests of 2 named' "$tmp/sanmiss/table.txt" \
  || { cat "$tmp/sanmiss/table.txt"; fail "the missing sanitizer case is not a fail naming the count"; }

# 4a. The sanitizers keep to their share of the budget (--sanitizer-s; 120
# s by default): runs that take 6 s each in a share of 20 s: one or two
# run (a second starts while 10 s of the share are left, a third cannot:
# at most 8 are), the others are not_run saying why and how to run them
# alone, the benchmarks after them still run, and the run is incomplete.
# Under --only they get all that is left.
if FAKE_SANITIZER_SLOW=6 PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --sanitizer-s=20 --out="$tmp/share" \
     >/dev/null 2>&1; then
  fail "a run whose sanitizers' share ran out passed"
fi
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
san = [s for s in d["stages"] if s["stage"].startswith("sanitizer:")]
ran = [s for s in san if s["status"] == "pass"]
assert 1 <= len(ran) <= 2 and san[:len(ran)] == ran, [(s["stage"], s["status"]) for s in san]
rest = san[len(ran):]
assert len(rest) >= 11 and all(s["status"] == "not_run" for s in rest), [(s["stage"], s["status"]) for s in rest]
assert rest[0]["detail"].startswith("not run: the sanitizers\x27 share (20 s) was spent, leaving the benchmarks "
    "theirs (run it alone: tools/device-check --prebuilt=%s --only=%s)" % (sys.argv[2], rest[0]["stage"])), rest[0]
by = {s["stage"]: s for s in d["stages"]}
assert by["bench:ring_dtp_bench"]["status"] == "pass", by["bench:ring_dtp_bench"]
assert d["verdict"] == "incomplete" and d["failed"] == [], (d["verdict"], d["failed"])' \
  "$tmp/share/device-check.json" "$fake" || { cat "$tmp/share/table.txt"; fail "the sanitizers' share"; }
FAKE_SANITIZER_SLOW=6 PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --sanitizer-s=10 --only='sanitizer:*:tc' \
  --out="$tmp/shareonly" >/dev/null 2>&1 || { cat "$tmp/shareonly/table.txt"; fail "--only sanitizers were cut to the share"; }

# 4a'. A leading zero is refused (bash's arithmetic reads 08 as octal and
# would end the run without a summary), and a stage whose detail holds a
# carriage return (a bench's progress line) still gets its summary.
for a in --budget=08 --sanitizer-s=08; do
  rc=0
  "$check" --dry-run --skip-build "$a" --out="$tmp/octal" >"$tmp/octal.out" 2>&1 || rc=$?
  [ "$rc" -eq 2 ] && grep -q "must be whole seconds" "$tmp/octal.out" || { cat "$tmp/octal.out"; fail "$a was not refused"; }
done
FAKE_CR=1 PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --only=bench:ring_dtp_bench --out="$tmp/cr" >/dev/null 2>&1 || true
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
assert d["failed"] == ["bench:ring_dtp_bench"], d["failed"]
assert "progress 100%" in d["stages"][-1]["detail"], d["stages"][-1]' \
  "$tmp/cr/device-check.json" || fail "a carriage return in a stage's output broke the summary"

# 4b. Kept within its budget: once it is spent no stage starts; each is
# not_run, saying how to run it alone, and the run is "incomplete" (exit
# 1), not a pass. stages.tsv beside the summary has every stage's line.
if FAKE_SLOW=3 PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --budget=2 --out="$tmp/spent" >/dev/null 2>&1; then
  fail "a run that spent its budget before most stages passed"
fi
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
by = {s["stage"]: s for s in d["stages"]}
assert d["verdict"] == "incomplete" and d["failed"] == [], (d["verdict"], d["failed"])
# The first test stage ran, or (on a loaded machine, the preflight taking
# the 2 s) was not started either; the second cannot have been.
assert by["test:wgmma_probe_test"]["status"] in ("pass", "not_run"), by["test:wgmma_probe_test"]
st = by["test:cuda_twin_test"]
assert st["status"] == "not_run" and st["detail"].startswith("not run: the budget (2 s) was spent (run it alone: "
    "tools/device-check --prebuilt=%s --only=test:cuda_twin_test)" % sys.argv[2]), st
assert "bench:composed_bench" in d["not_run"] and d["seconds"] < 60, (d["not_run"], d["seconds"])  # 33 stages of 3 s had they run' \
  "$tmp/spent/device-check.json" "$fake" || { cat "$tmp/spent/table.txt"; fail "the spent budget is not recorded as such"; }
grep -q '^verdict: incomplete .*not run (the budget or the sanitizers.* share spent)' "$tmp/spent/table.txt" || fail "the table's verdict"
[ "$(wc -l <"$tmp/spent/stages.tsv")" -eq "$(python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["stages"]))' "$tmp/spent/device-check.json")" ] \
  || fail "stages.tsv does not hold every stage"

# 4c. Stopped by a signal mid-run, in a stage that would take 60 s: the
# stage is stopped at once and the stages that ended are summarised.
FAKE_SLOW=60 PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --out="$tmp/stopped" >"$tmp/stopped.out" 2>&1 &
pid=$!
sleep 3
t0=$(date +%s)
kill -TERM "$pid"
if wait "$pid"; then fail "a run stopped by SIGTERM exited 0"; fi
[ $(( $(date +%s) - t0 )) -lt 10 ] || fail "the stopped run took $(( $(date +%s) - t0 )) s to end"
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
assert d["verdict"] == "fail" and "interrupted" in d["failed"], d["failed"]
assert d["stages"][0]["stage"] == "preflight", d["stages"][0]' "$tmp/stopped/device-check.json" \
  || { cat "$tmp/stopped.out"; fail "a stopped run wrote no summary"; }

# 4d. The wgmma probe's test failing on the device turns the wgmma kernels
# off (PLATEAU_TC_WGMMA=0) for every later stage; compute-sanitizer runs
# with lazy module loading.
: >"$tmp/env.log"
if FAKE_ENV="$tmp/env.log" FAKE_PROBE_FAILS=1 PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --out="$tmp/probe" >/dev/null 2>&1; then
  fail "a failing wgmma probe test passed the run"
fi
grep -q '^wgmma_probe_test PLATEAU_TC_WGMMA=unset' "$tmp/env.log" || { cat "$tmp/env.log"; fail "the probe ran with the switch set"; }
grep -q '^cuda_twin_test PLATEAU_TC_WGMMA=0' "$tmp/env.log" || { cat "$tmp/env.log"; fail "later stages kept wgmma on"; }
python3 -c '
import json, sys
st = [s for s in json.load(open(sys.argv[1]))["stages"] if s["stage"] == "test:wgmma_probe_test"][0]
assert st["status"] == "fail" and "later stages run with PLATEAU_TC_WGMMA=0" in st["detail"], st' \
  "$tmp/probe/device-check.json" || fail "the probe stage does not say so"
grep -q '^compute-sanitizer CUDA_MODULE_LOADING=LAZY' "$tmp/env.log" || { cat "$tmp/env.log"; fail "the sanitizer loads eagerly"; }
# Every other stage loads eagerly, as a job's ranks do (on one GPU too: the
# context it makes is what the run measures); a caller's choice is kept.
# The preflight says which.
grep -q '^cuda_twin_test .* CUDA_MODULE_LOADING=EAGER$' "$tmp/env.log" || { cat "$tmp/env.log"; fail "the twin tests load lazily"; }
python3 -c 'import json,sys; assert json.load(open(sys.argv[1]))["preflight"]["module_loading"] == "EAGER"' \
  "$tmp/probe/device-check.json" || fail "the preflight does not say the module loading"
: >"$tmp/env3.log"
CUDA_MODULE_LOADING=LAZY FAKE_ENV="$tmp/env3.log" PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" \
  --only='test:cuda_twin_test' --out="$tmp/callers" >/dev/null 2>&1 || { cat "$tmp/callers/table.txt"; fail "the caller's loading run"; }
grep -q '^cuda_twin_test .* CUDA_MODULE_LOADING=LAZY$' "$tmp/env3.log" || { cat "$tmp/env3.log"; fail "the caller's choice was not kept"; }

# 4e. A bench whose JSON line does not parse fails, not passes.
if FAKE_BAD_JSON=1 PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --out="$tmp/badjson" >/dev/null 2>&1; then
  fail "a malformed JSON line passed"
fi
grep -q 'bench:sgemm_bench *fail .*does not parse' "$tmp/badjson/table.txt" || { cat "$tmp/badjson/table.txt"; fail "the malformed line is not named"; }

# 4f. --prebuilt is the GPU machine's run: no GPU there fails the run (it
# is not a dry run that passes).
mkdir -p "$tmp/nogpu_path"
printf '#!/bin/sh\nexit 0\n' >"$tmp/nogpu_path/nvidia-smi"
chmod +x "$tmp/nogpu_path/nvidia-smi"
if PATH="$tmp/nogpu_path:$PATH" "$check" --prebuilt="$fake" --out="$tmp/nogpu" >/dev/null 2>&1; then
  fail "--prebuilt without a GPU passed"
fi
grep -q 'preflight *fail .*--prebuilt expects a GPU' "$tmp/nogpu/table.txt" || { cat "$tmp/nogpu/table.txt"; fail "the missing GPU is not named"; }

# 4g. A pack with its libraries and binaries as lib.tar.gz and bin.tar.gz
# (what --pack writes): they are unpacked, the libraries first on the
# binaries' library path, and the binaries run from there.
packed="$tmp/packed"
cp -r "$fake" "$packed"
rm -rf "$packed/lib"
mkdir -p "$tmp/libsrc/lib"
echo marker >"$tmp/libsrc/lib/marker"
tar -C "$tmp/libsrc" -czf "$packed/lib.tar.gz" lib
printf '#!/bin/sh\n[ -f "${LD_LIBRARY_PATH%%%%:*}/marker" ] || exit 1\necho %s\n' "'{\"cpu\":{},\"cuda\":{\"gflops\":3}}'" >"$packed/bin/sgemm_bench"
tar -C "$packed" -czf "$packed/bin.tar.gz" bin && rm -rf "$packed/bin"
PATH="$tmp/path:$PATH" "$check" --prebuilt="$packed" --out="$tmp/packedrun" >"$tmp/packed.stdout" 2>&1 \
  || { cat "$tmp/packed.stdout"; fail "the run from a pack with lib.tar.gz and bin.tar.gz failed"; }
grep -q 'bench:sgemm_bench *pass' "$tmp/packedrun/table.txt" || fail "the packed libraries were not on the library path"
grep -q 'test:cuda_twin_test *pass' "$tmp/packedrun/table.txt" || fail "the packed binaries did not run"

# 5. Bad usage.
if "$check" --no-such-flag >/dev/null 2>&1; then fail "an unknown flag was accepted"; fi
# --emulated builds and runs here (tools/device-check --emulated, by hand:
# a bazel build inside a test is not possible); with a pack or a dry run it
# is refused, naming why.
for other in --dry-run --prebuilt="$packed" --pack="$tmp/p"; do
  if "$check" --emulated "$other" >"$tmp/emu.stdout" 2>&1; then fail "--emulated $other was accepted"; fi
  grep -q "not with --prebuilt, --pack or --dry-run" "$tmp/emu.stdout" || { cat "$tmp/emu.stdout"; fail "--emulated $other: no reason"; }
done
echo "device_check_test: PASSED"

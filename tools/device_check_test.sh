#!/usr/bin/env bash
# //tools:device_check_test: tools/device-check's non-GPU parts, here where
# there is no GPU: a dry run (--dry-run, --skip-build: no CUDA build inside a
# test) with a tiny fake step, checking the JSON and the table it writes,
# that a failing step fails the run, and that without a step command the
# missing CUDA step is recorded as not_available rather than passed over.
set -euo pipefail
check=tools/device-check
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
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
for t in ("cuda_twin_test", "cuda_bf16_twin_test", "cuda_model_twin_test", "nccl_communicator_test"):
    assert by["test:" + t]["status"] == "dry_run", by["test:" + t]
for tool in ("memcheck", "racecheck", "synccheck", "initcheck", "memcheck:attention",
             "racecheck:attention"):
    assert by["sanitizer:" + tool]["status"] == "dry_run", tool
assert by["step"]["status"] == "pass" and by["step"]["data"]["max_loss_diff"] == 0.0, by["step"]
for b in ("sgemm_bench", "copy_bench"):
    assert by["bench:" + b]["status"] == "dry_run"
assert by["bench:ring_dtp_bench"]["status"] == "not_available"
PY

# 2. A failing step fails the run and is named.
if "$check" --dry-run --skip-build --out="$tmp/bad" \
     --step-cmd='echo "{\"status\": \"fail\", \"max_loss_diff\": 1.5}"' >"$tmp/bad.stdout" 2>&1; then
  fail "a failing step did not fail the run"
fi
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["verdict"]=="fail" and d["failed"]==["step"], d["failed"]' \
  "$tmp/bad/device-check.json" || fail "the failing step is not recorded"
grep -q 'failed step' "$tmp/bad/table.txt" || fail "the table does not name the failed stage"

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
for a in "$@"; do case "$a" in --gtest_output=json:*) out="${a#--gtest_output=json:}" ;; esac; done
skip=""
[ -n "${FAKE_SKIP:-}" ] && skip=',{"name":"B","status":"RUN","result":"SKIPPED"}'
echo "{\"testsuites\":[{\"name\":\"S\",\"testsuite\":[{\"name\":\"A\",\"status\":\"RUN\",\"result\":\"COMPLETED\"}$skip]}]}" >"$out"
SH
printf '#!/bin/sh\necho table\necho %s\n' "'{\"cpu\":{},\"cuda\":{\"gflops\":2}}'" >"$fake/bin/bench"
printf '#!/bin/sh\nif [ "$1" = -L ]; then echo "GPU 0: Fake"; else echo "Fake, 580, Default, 1 MiB, 0 MiB"; fi\n' >"$tmp/path/nvidia-smi"
chmod +x "$fake/bin/gtest" "$fake/bin/bench" "$tmp/path/nvidia-smi"
for t in cuda_twin_test cuda_bf16_twin_test cuda_model_twin_test nccl_communicator_test cuda_step_twin_test; do cp "$fake/bin/gtest" "$fake/bin/$t"; done
for b in sgemm_bench copy_bench; do cp "$fake/bin/bench" "$fake/bin/$b"; done
PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --out="$tmp/gpu" >"$tmp/gpu.stdout" 2>&1 \
  || { cat "$tmp/gpu.stdout"; fail "the fake GPU run failed"; }
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
by = {s["stage"]: s for s in d["stages"]}
assert d["mode"] == "gpu" and d["verdict"] == "pass", (d["mode"], d["verdict"], d["failed"])
assert by["test:cuda_twin_test"]["status"] == "pass" and by["test:cuda_twin_test"]["data"]["testsuites"]
assert by["bench:sgemm_bench"]["data"]["cuda"]["gflops"] == 2
# The packed step test runs on the one fake GPU without its P = 2 case.
assert by["step"]["status"] == "pass" and "P = 2" in by["step"]["detail"], by["step"]' "$tmp/gpu/device-check.json" || fail "the fake GPU run's JSON"
if FAKE_SKIP=1 PATH="$tmp/path:$PATH" "$check" --prebuilt="$fake" --out="$tmp/gpuskip" >/dev/null 2>&1; then
  fail "a skipped twin test on a GPU did not fail the run"
fi
grep -q 'test:cuda_twin_test *fail' "$tmp/gpuskip/table.txt" || fail "the skipped twin test is not marked failed"

# 5. Bad usage.
if "$check" --no-such-flag >/dev/null 2>&1; then fail "an unknown flag was accepted"; fi
echo "device_check_test: PASSED"

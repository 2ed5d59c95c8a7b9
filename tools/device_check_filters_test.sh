#!/usr/bin/env bash
# //tools:device_check_filters_test: every test case that tools/device-check
# names in a compute-sanitizer filter exists in its binary. A renamed case
# would leave that filter matching nothing on the GPU run; device-check then
# fails the stage (fewer cases than patterns), but only on a GPU, which is
# rare here: this catches it in CI. Lists the cases of the default build's
# binaries (they list without a GPU).
set -euo pipefail
check=tools/device-check
fail() { echo "device_check_filters_test: FAILED: $*"; exit 1; }
eval "$(grep -E '^(san|attn|bf16|tc)_filter=' "$check")"
for pair in "kernels/cuda_twin_test:${san_filter:?}" "kernels/model/cuda_model_twin_test:${attn_filter:?}" \
            "kernels/cuda_bf16_twin_test:${bf16_filter:?}" "kernels/cuda_attention_tc_twin_test:${tc_filter:?}"; do
  bin=${pair%%:*}
  filter=${pair#*:}
  grep -q "bin_of $bin)" "$check" || fail "device-check no longer runs $bin's filter (update this test)"
  IFS=':' read -r -a patterns <<<"$filter"
  for p in "${patterns[@]}"; do
    n=$("$bin" --gtest_list_tests --gtest_filter="$p" | grep -c '^  ' || true)
    [ "$n" -eq 1 ] || fail "$bin: the sanitizer filter's case $p matches $n test cases, not 1"
  done
  echo "$bin: ${#patterns[@]} cases found"
done
echo "device_check_filters_test: passed"

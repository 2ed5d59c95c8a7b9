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
eval "$(grep -E '^[a-z0-9_]+_filter=' "$check")"
# The sanitizer runs' pairs as device-check's case statement makes them:
# `bin=$(bin_of BINARY); filter=$NAME`.
pairs=()
while read -r bin name; do
  pairs+=("$bin:${!name:?device-check names a filter $name it does not define}")
done < <(sed -nE 's/.*bin=\$\(bin_of ([a-z0-9_/]+)\); filter=\$([a-z0-9_]+) ;;.*/\1 \2/p' "$check")
[ "${#pairs[@]}" -eq 4 ] || fail "expected device-check's four sanitizer filters, found ${#pairs[@]}"
for pair in "${pairs[@]}"; do
  bin=${pair%%:*}
  filter=${pair#*:}
  IFS=':' read -r -a patterns <<<"$filter"
  for p in "${patterns[@]}"; do
    n=$("$bin" --gtest_list_tests --gtest_filter="$p" | grep -c '^  ' || true)
    [ "$n" -eq 1 ] || fail "$bin: the sanitizer filter's case $p matches $n test cases, not 1"
  done
  echo "$bin: ${#patterns[@]} cases found"
done
echo "device_check_filters_test: passed"

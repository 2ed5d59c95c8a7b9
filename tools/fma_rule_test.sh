#!/usr/bin/env bash
# //tools:fma_rule_test: runs tools/check-fma on the libraries and PTX files
# among its arguments that are in the runfiles (a cc_library's shared library
# is; its archive, the same code, is not).
set -euo pipefail
opts=()
while [[ "${1:-}" == --libm=* || "${1:-}" == --explicit=* ]]; do opts+=("$1"); shift; done
files=()
for f in "$@"; do
  case "$f" in *.a|*.so|*.ptx) [ -e "$f" ] && files+=("$f") ;; esac
done
[ ${#files[@]} -gt 0 ] || { echo "fma_rule_test: no object or PTX among: $*"; exit 1; }
case " ${files[*]}" in
  *.ptx*) ;;
  *) echo "fma_rule_test: CPU objects only (the CUDA kernels' PTX needs --config=cuda)" ;;
esac
exec tools/check-fma "${opts[@]}" "${files[@]}"

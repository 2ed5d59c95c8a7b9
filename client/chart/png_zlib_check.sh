#!/bin/sh
# png_samples writes PNGs and a zlib stream; python's zlib reads them back.
set -eu
samples="$1" check="$2" frontier="$3"
dir="${TEST_TMPDIR:-$(mktemp -d)}/samples"
mkdir -p "$dir"
"$samples" "$dir"
exec python3 "$check" "$dir" "$frontier"

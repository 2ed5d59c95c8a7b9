#!/usr/bin/env bash
# Installs every Debian 12 package that building and running Plateau need;
# with --tests also what only the tests use (a headless browser), so that
# tools/demo stays light and tools/test gets everything.
# Idempotent: when everything is present it checks and prints one line.
#
#   deploy/install-deps.sh            # build, demo, deploy
#   deploy/install-deps.sh --tests    # ... and the tests' extra tools (tools/test)
set -euo pipefail

with_tests=0
for arg in "$@"; do
  case "$arg" in
    --tests) with_tests=1 ;;
    *) echo "install-deps: unknown argument '$arg' (expected --tests)" >&2; exit 2 ;;
  esac
done

PACKAGES=(
  # toolchain
  build-essential git ca-certificates
  # build system (Debian's Bazel 4.2.3; pulls openjdk-17)
  bazel-bootstrap
  # control plane
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libsqlite3-dev nlohmann-json3-dev
  # tests and benchmarks
  libgtest-dev libgmock-dev libbenchmark-dev
  # CPU backend
  libgloo-dev libopenblas-dev
  # tools/demo shows the /metrics it serves
  curl
  # tests/security_test makes a TLS certificate; operators make theirs with it
  openssl
  # deploy/ and its test: a real Prometheus (and promtool), systemd-analyze
  # for the units, Debian's python3 gRPC for client/python
  prometheus systemd python3-grpcio python3-protobuf
)
if [ "$with_tests" -eq 1 ]; then
  PACKAGES+=(
    # tests/memory_page_test loads /jobs/ID/memory in a real headless browser
    chromium
    # tests/multinode_test makes network namespaces, veth pairs and a bridge
    iproute2
  )
  # tests/deploy_test checks deploy/kubernetes with kubectl's client side;
  # any kubectl will do (Debian 12's kubernetes-client is 1.20).
  if ! command -v kubectl >/dev/null 2>&1; then PACKAGES+=(kubernetes-client); fi
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"

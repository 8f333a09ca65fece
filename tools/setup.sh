#!/usr/bin/env bash
# Installs, idempotently, every Debian package refit builds and runs with. Safe to run many times:
# it does nothing when everything is already there. Both README commands call it first.
set -euo pipefail
packages=(
  bazel-bootstrap bazel-platforms
  g++ pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev libfmt-dev catch2 libabsl-dev
  clang libclang-rt-14-dev
  python3-numpy python3-matplotlib bc
  python3-grpcio python3-protobuf python3-torch python3-pip python3-venv python3-setuptools python3-wheel
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q >/dev/null || true
  $SUDO apt-get install -y -q "${missing[@]}" >/dev/null
fi
[ -x /usr/local/cuda/bin/nvcc ] || echo "setup: note: /usr/local/cuda not found; GPU targets will not build" >&2
exit 0

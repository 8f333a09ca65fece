#!/usr/bin/env bash
# Installs, idempotently, every Debian package refit builds and runs with. Safe to run many times:
# it does nothing when everything is already there. Both README commands call it first.
set -euo pipefail
packages=(
  bazel-bootstrap bazel-platforms
  g++ pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev libfmt-dev catch2 libabsl-dev libssl-dev openssl
  clang libclang-rt-14-dev clang-format-14  # tools/check_format.sh
  python3-numpy python3-matplotlib bc
  python3-grpcio python3-protobuf python3-torch python3-pip python3-venv python3-setuptools python3-wheel
  mypy  # //client/python:mypy_test type-checks the Python package
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

# deploy/k8s/manifests_test.sh (the Kubernetes manifests, validated offline): kubectl renders
# them (Debian's kubernetes-client, only where no kubectl is on PATH: it would replace another
# one), PyYAML reads them, npm's kubernetes-models (pinned) checks them against Kubernetes'
# schemas. Best effort: what is missing, the test reports as SKIPPED.
k8s_missing=()
command -v kubectl >/dev/null || k8s_missing+=(kubernetes-client)
/usr/bin/python3 -c "import yaml" 2>/dev/null || k8s_missing+=(python3-yaml)
if [ ${#k8s_missing[@]} -gt 0 ]; then
  echo "setup: installing ${k8s_missing[*]}" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q >/dev/null || true
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${k8s_missing[@]}" >/dev/null ||
    echo "setup: note: could not install ${k8s_missing[*]}; deploy/k8s validation will skip parts" >&2
fi
k8s_models=/opt/refit/npm
if [ ! -f "$k8s_models/node_modules/kubernetes-models/package.json" ] && command -v npm >/dev/null; then
  echo "setup: installing kubernetes-models@5.1.0 (npm) under $k8s_models" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO mkdir -p "$k8s_models" &&
    $SUDO npm install --prefix "$k8s_models" --no-save --no-audit --no-fund --loglevel=error \
      kubernetes-models@5.1.0 >/dev/null 2>&1 ||
    echo "setup: note: npm could not install kubernetes-models; deploy/k8s schema validation will be skipped" >&2
fi

# daemon/ops/metrics.h (--metrics-listen) links prometheus-cpp; tests/integration/metrics_test.py
# scrapes a live cluster with Prometheus' own server (Debian's prometheus).
metrics_missing=()
for p in prometheus-cpp-dev prometheus; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || metrics_missing+=("$p")
done
if [ ${#metrics_missing[@]} -gt 0 ]; then
  echo "setup: installing ${metrics_missing[*]}" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${metrics_missing[@]}" >/dev/null
fi
exit 0

#!/usr/bin/env bash
# Validates deploy/k8s offline (no cluster): every overlay under deploy/k8s/overlays is rendered
# with `kubectl kustomize`, and each rendered object is
#   1. decoded by kubectl itself, offline (`kubectl label --local --dry-run=client`): the part of
#      a client-side dry run that needs no API server. (`kubectl apply|create --dry-run=client`
#      asks the server for its API groups even with --validate=false, so it cannot run here.)
#   2. validated against the Kubernetes OpenAPI schema of its kind, with npm's kubernetes-models
#      (validate/validate.mjs; installed by tools/setup.sh under /opt/refit/npm). Its schemas
#      check types, required fields and enums; they do not reject unknown fields.
#   3. checked against refitd itself (validate/check_refitd.py): refitd parses every refitd
#      container's arguments and its ConfigMap --config file, so a flag or key refitd does not
#      accept fails here; then runs its start-up checks with the pod's TLS files replaced by
#      certificates tools/gen_certs.sh makes here, so a refitd on a routable address without
#      TLS fails (as refitd refuses it); probes (on --health-listen), socket volume, TLS volumes,
#      coordinator Service and state volume agree.
# Also: the check is shown to catch an unknown flag, an unknown config key and a plaintext
# routable refitd; the image's entrypoint (--node, REFIT_TLS_DIR); the Containerfile's runtime
# packages against `ldd refitd`, its package names.
# A part whose tool is missing is reported as SKIPPED, loudly, with how to install it; kubectl
# missing skips the rendering parts only. Ends with "N passed, N failed, N skipped" for its checks.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -n "${TEST_SRCDIR:-}" ]; then
  root="$TEST_SRCDIR/${TEST_WORKSPACE:-__main__}"
else
  root=$(cd "$here/../.." && pwd)
fi
k8s="$root/deploy/k8s"
refitd="${REFITD:-$root/bazel-bin/daemon/refitd}"
[ -x "$root/daemon/refitd" ] && refitd="$root/daemon/refitd"
models="${REFIT_K8S_MODELS:-/opt/refit/npm/node_modules}"
py=/usr/bin/python3
tmp=$(mktemp -d "${TEST_TMPDIR:-/tmp}/k8s.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
export HOME="$tmp" KUBECONFIG="$tmp/kubeconfig"
: >"$KUBECONFIG"

passed=0 failed=0 skipped=0
pass() { passed=$((passed + 1)); echo "PASS: $*"; }
fail() { failed=$((failed + 1)); echo "FAIL: $*"; }
skip() { skipped=$((skipped + 1)); echo "SKIPPED (not validated): $*"; }

[ -x "$refitd" ] || { echo "FAIL: no refitd binary at $refitd"; echo "0 passed, 1 failed"; exit 1; }

# The flag check must be able to fail: refitd names an unknown flag, and an unknown config key.
out=$("$refitd" --flag-that-does-not-exist --help 2>&1); rc=$?
if [ $rc -eq 2 ] && grep -q "flag-that-does-not-exist" <<<"$out"; then
  pass "refitd refuses an unknown flag, naming it (exit 2: $out)"
else
  fail "refitd did not refuse --flag-that-does-not-exist (exit $rc: $out): the flag check would prove nothing"
fi
echo '{"coordinator": "dns:///x:7070", "key-that-does-not-exist": 1}' >"$tmp/bad.json"
out=$("$refitd" --config "$tmp/bad.json" --help 2>&1); rc=$?
if [ $rc -eq 2 ] && grep -q "key-that-does-not-exist" <<<"$out"; then
  pass "refitd refuses an unknown --config key, naming it"
else
  fail "refitd accepted an unknown --config key (exit $rc: $out)"
fi

# Placeholder TLS files for refitd's start-up check (it must read them): the test CA and node 0's.
certs=""
if command -v openssl >/dev/null; then
  if out=$(bash "$root/tools/gen_certs.sh" "$tmp/certs" 1 2>&1); then
    certs="$tmp/certs"
    pass "tools/gen_certs.sh made a test CA and node 0's certificate"
  else
    fail "tools/gen_certs.sh: $out"
  fi
else
  skip "refitd's start-up check of the TLS flags: openssl not found (Debian's openssl)"
fi

# The entrypoint's --node.
fake="$tmp/fake-refitd"
printf '#!/bin/sh\necho "$@"\n' >"$fake"; chmod +x "$fake"
entry="$root/deploy/refitd-entrypoint.sh"
echo " 7 " >"$tmp/node-index"
check_entry() {  # expected-output env...
  local want=$1; shift
  local got; got=$(env -i PATH=/usr/bin:/bin REFITD="$fake" "$@" sh "$entry" --listen=x:1 2>&1); local rc=$?
  if [ "$got" = "$want" ]; then pass "entrypoint $* -> $got"; else fail "entrypoint $*: got '$got' (exit $rc), want '$want'"; fi
}
check_entry "--node 3 --listen=x:1" REFIT_NODE=3
check_entry "--node 7 --listen=x:1" REFIT_NODE_FILE="$tmp/node-index"
check_entry "--listen=x:1"
if env -i PATH=/usr/bin:/bin REFITD="$fake" REFIT_NODE=abc sh "$entry" >/dev/null 2>&1; then
  fail "entrypoint accepted REFIT_NODE=abc"
else
  pass "entrypoint refuses REFIT_NODE=abc"
fi
mkdir -p "$tmp/tls" && : >"$tmp/tls/node-3.crt" && : >"$tmp/tls/node-3.key"
check_entry "--node 3 --tls-cert $tmp/tls/node-3.crt --tls-key $tmp/tls/node-3.key --listen=x:1" REFIT_NODE=3 REFIT_TLS_DIR="$tmp/tls"
if env -i PATH=/usr/bin:/bin REFITD="$fake" REFIT_NODE=4 REFIT_TLS_DIR="$tmp/tls" sh "$entry" >/dev/null 2>&1; then
  fail "entrypoint accepted REFIT_TLS_DIR without node-4.crt"
else
  pass "entrypoint refuses REFIT_TLS_DIR without this node's certificate"
fi
if env -i PATH=/usr/bin:/bin REFITD="$fake" REFIT_TLS_DIR="$tmp/tls" sh "$entry" >/dev/null 2>&1; then
  fail "entrypoint accepted REFIT_TLS_DIR without a node index"
else
  pass "entrypoint refuses REFIT_TLS_DIR without a node index"
fi
if REFIT_NODE=3 REFITD="$refitd" sh "$entry" --help >/dev/null 2>&1; then
  pass "entrypoint runs the real refitd with --node (refitd --node 3 --help)"
else
  fail "entrypoint with the real refitd failed"
fi

# The Containerfile's runtime stage installs the Debian package of every library refitd links.
if command -v ldd >/dev/null && command -v dpkg >/dev/null; then
  runtime=$(sed -n '/^FROM \${DEBIAN_IMAGE}$/,$p' "$root/deploy/Containerfile")
  missing=""
  for lib in $(ldd "$refitd" | awk '/=>/ {print $3}'); do
    case "$lib" in */libnccl.so*) grep -q "libnccl.so.2" <<<"$runtime" || missing+=" libnccl.so.2"; continue ;; esac
    real=$(readlink -f "$lib")
    pkg=$(dpkg -S "$real" 2>/dev/null || dpkg -S "/usr$real" 2>/dev/null || dpkg -S "$lib" 2>/dev/null)
    pkg=${pkg%%:*}
    case "$pkg" in libc6|libgcc-s1|libstdc++6|zlib1g|"") continue ;; esac  # in every Debian image
    grep -qw -- "$pkg" <<<"$runtime" || missing+=" $pkg($lib)"
  done
  if [ -z "$missing" ]; then pass "Containerfile runtime stage has every library refitd links"; else fail "Containerfile runtime stage lacks:$missing"; fi
else
  skip "Containerfile libraries (no ldd or dpkg)"
fi

# Every package the Containerfile installs exists in the archive this machine's apt reads
# (Debian 12, as the image's base): apt-cache show, offline, from the package lists.
if command -v apt-cache >/dev/null && apt-cache show bash >/dev/null 2>&1; then
  pkgs=$(sed -n '/apt-get install/,/rm -rf/p' "$root/deploy/Containerfile" | sed 's/[\\&]//g' | tr -s ' ' '\n' |
    grep -E '^[a-z0-9][a-z0-9.+-]+$' | grep -vxE 'apt-get|install|rm|update|y|q|no-install-recommends' | sort -u)
  unknown=""
  for p in $pkgs; do apt-cache show "$p" >/dev/null 2>&1 || unknown+=" $p"; done
  if [ -z "$unknown" ]; then
    pass "Containerfile's $(wc -w <<<"$pkgs") packages all in this machine's Debian archive"
  else
    fail "Containerfile names packages apt does not know:$unknown"
  fi
else
  skip "Containerfile package names: apt has no package lists here (apt-get update)"
fi

kubectl=$(command -v kubectl || true)
if [ -z "$kubectl" ]; then
  skip "every overlay: kubectl not found (tools/setup.sh installs Debian's kubernetes-client)"
else
  echo "kubectl: $("$kubectl" version --client 2>/dev/null | head -1)"
  if ! "$py" -c "import yaml" 2>/dev/null; then
    skip "every overlay: $py has no yaml module (Debian's python3-yaml; tools/setup.sh installs it)"
  else
    # A copy with the links resolved: Bazel's runfiles are links, which kustomize does not read.
    cp -rL "$k8s" "$tmp/k8s-tree"
    for overlay in "$tmp/k8s-tree"/overlays/*/; do
      name=$(basename "$overlay")
      if ! "$kubectl" kustomize "$overlay" >"$tmp/$name.yaml" 2>"$tmp/$name.err"; then
        fail "$name: kubectl kustomize: $(grep -v '^# Warning' "$tmp/$name.err")"
        continue
      fi
      "$py" -c 'import json, sys, yaml
json.dump([d for d in yaml.safe_load_all(open(sys.argv[1])) if d], open(sys.argv[2], "w"))' \
        "$tmp/$name.yaml" "$tmp/$name.json" || { fail "$name: rendered YAML does not parse"; continue; }
      count=$("$py" -c 'import json, sys; print(len(json.load(open(sys.argv[1]))))' "$tmp/$name.json")
      pass "$name: rendered, $count objects"
      if out=$("$kubectl" label --local --dry-run=client -o name -f "$tmp/$name.yaml" refit.dev/checked=true 2>&1); then
        pass "$name: kubectl decodes every object offline ($(tr '\n' ' ' <<<"$out"))"
      else
        fail "$name: kubectl cannot decode: $out"
      fi
      if ! command -v node >/dev/null; then
        skip "$name: schema validation: node not found"
      elif [ ! -d "$models/kubernetes-models" ]; then
        skip "$name: schema validation: kubernetes-models not installed at $models (tools/setup.sh installs it from npm)"
      elif out=$(node "$k8s/validate/validate.mjs" "$models" "$tmp/$name.json" 2>&1); then
        pass "$name: every object valid against its Kubernetes schema (kubernetes-models)"
      else
        fail "$name: schema: $(grep -v '^valid' <<<"$out")"
      fi
      if out=$("$py" "$k8s/validate/check_refitd.py" "$refitd" "$tmp/$name.json" "$certs" 2>&1); then
        pass "$name: refitd accepts every flag and config key, starts with TLS; probes, socket, TLS volumes, coordinator agree"
        echo "${out//$'\n'/$'\n'    }" | sed '1s/^/    /'
      else
        fail "$name: refitd check: $(grep -v '^ok' <<<"$out")"
      fi
    done
    # The TLS check must be able to fail: the daemonset overlay with every TLS flag taken out
    # (as the manifests were before TLS) starts refitd on a routable address in plaintext.
    if [ -f "$tmp/daemonset.json" ]; then
      "$py" -c 'import json, sys
objs = json.load(open(sys.argv[1]))
for o in objs:
    spec = o.get("spec", {}).get("template", {}).get("spec", {})
    for c in spec.get("containers", []):
        c["args"] = [a for a in c.get("args", []) if not a.startswith(("--tls-", "--health-listen"))]
        c["env"] = [e for e in c.get("env", []) if e["name"] != "REFIT_TLS_DIR"]
json.dump(objs, open(sys.argv[2], "w"))' "$tmp/daemonset.json" "$tmp/plaintext.json"
      out=$("$py" "$k8s/validate/check_refitd.py" "$refitd" "$tmp/plaintext.json" "$certs" 2>&1); rc=$?
      if [ $rc -ne 0 ] && grep -q "routable address without TLS" <<<"$out" &&
         { [ -z "$certs" ] || grep -q "refitd refuses to start" <<<"$out"; }; then
        pass "a plaintext refitd on a routable address fails the check (and refitd refuses it)"
      else
        fail "the daemonset overlay without TLS passed the check (exit $rc): $out"
      fi
    fi
  fi
fi

echo "${passed} passed, ${failed} failed, ${skipped} skipped"
[ "$failed" -eq 0 ]

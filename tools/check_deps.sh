#!/usr/bin/env bash
# Fails, naming each edge, when a dependency runs the wrong way between the daemon and the clients:
# no non-test target in client/ may depend on daemon/, none in daemon/ on client/. What both need
# lives in common/ (or proto/, plan/). Tests may cross: a daemon test drives the worker library.
# Inside the daemon, its components' folders are layers (daemon/README.md): a non-test target may
# depend only on folders of a lower layer, so coordinator and node, or the two data planes, never
# on each other.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
check() {  # check FROM TO: direct deps of FROM's non-test targets inside TO
  local from=$1 to=$2 edges=""
  local targets
  targets=$(bazel query "kind('cc_library|cc_binary|py_library|py_binary', //$from/...) except attr(testonly, 1, //$from/...)" 2>/dev/null) || {
    echo "check_deps: bazel query of //$from failed" >&2; status=1; return; }
  for t in $targets; do
    for d in $(bazel query "deps($t, 1) intersect //$to/..." 2>/dev/null); do edges+="  $t -> $d"$'\n'; done
  done
  if [ -n "$edges" ]; then
    echo "check_deps: $from/ must not depend on $to/ (move what both need to common/):" >&2
    printf '%s' "$edges" >&2
    status=1
  fi
}
check client daemon
check daemon client

# The daemon's layers, lowest first; //daemon itself (the wiring and refitd) sits above them all.
layers=("base" "security dataplane" "ops" "worker" "dataplane/host dataplane/cuda coordinator node")
layer_of() { local i; for i in "${!layers[@]}"; do [[ " ${layers[$i]} " == *" $1 "* ]] && { echo "$i"; return; }; done; echo -1; }
for i in "${!layers[@]}"; do
  for pkg in ${layers[$i]}; do
    own="kind('cc_library|cc_binary', //daemon/$pkg:*) except attr(testonly, 1, //daemon/$pkg:*)"
    used=$(bazel query "deps($own, 1) intersect //daemon/..." --output=package 2>/dev/null) || {
      echo "check_deps: bazel query of //daemon/$pkg failed" >&2; status=1; continue; }
    for dep in $used; do
      dep=${dep#daemon}; dep=${dep#/}
      [ "$dep" = "$pkg" ] && continue
      j=$(layer_of "$dep")
      if [ -z "$dep" ] || [ "$j" -lt 0 ] || [ "$j" -ge "$i" ]; then
        echo "check_deps: daemon/$pkg/ must not depend on daemon/${dep:-BUILD (the wiring)} (layers, lowest first: ${layers[*]}):" >&2
        bazel query "$own intersect rdeps($own, //daemon/${dep}:*, 1)" 2>/dev/null | sed 's/^/  /' >&2
        status=1
      fi
    done
  done
done
[ $status -eq 0 ] && echo "check_deps: client/ and daemon/ depend on neither's internals; the daemon's folders keep their layers"
exit $status

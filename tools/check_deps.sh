#!/usr/bin/env bash
# Fails, naming each edge, when a dependency runs the wrong way between the daemon and the clients:
# no non-test target in client/ may depend on daemon/, none in daemon/ on client/. What both need
# lives in common/ (or proto/, plan/). Tests may cross: a daemon test drives the worker library.
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
[ $status -eq 0 ] && echo "check_deps: client/ and daemon/ depend on neither's internals"
exit $status

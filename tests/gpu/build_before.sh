#!/usr/bin/env bash
# Builds a refitd that differs from this tree's only in the cuda backend: daemon/cuda_backend.{h,cc}
# as of REV (default: the commit before the split into daemon/cuda/), every other source from this
# tree. For a benchmark that compares the two in one GPU run (tests/gpu/cuda_split.sh). The copy
# lives in .ab/ (a Bazel package that git ignores through .git/info/exclude); prints the binary.
#   bash tests/gpu/build_before.sh [REV]
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=${1:-14b0593^}
grep -qx '/.ab/' .git/info/exclude 2>/dev/null || echo '/.ab/' >>.git/info/exclude
rm -rf .ab && mkdir -p .ab/old/daemon
for f in cuda_backend.h cuda_backend.cc; do git show "$rev:daemon/$f" >.ab/old/daemon/$f; done
cp daemon/daemon.cc daemon/daemon.h daemon/refitd_main.cc .ab/old/daemon/
python3 - <<'PY'
import re
s = open("daemon/BUILD").read()
def deps(name):
    m = re.search(r'cc_library\(\s*name = "%s",.*?deps = \[(.*?)\],?\s*\)' % name, s, re.S)
    return [d if not d.startswith(":") else "//daemon" + d for d in re.findall(r'"([^"]+)"', m.group(1))]
old_backend = ["//daemon:backend", "//daemon:cuda_driver", "//daemon:gpu_ids", "//daemon:logging", "//daemon:memory_refs",
               "//kernels:copy_kernels", "//kernels:network_schedule", "//plan:status",
               "@cuda//:cuda_headers", "@cuda//:cudart_static", "@cuda//:nccl"]
all_deps = sorted(set(d for d in deps("daemon") if d != "//daemon:cuda_backend") | set(old_backend))
q = lambda xs: ", ".join('"%s"' % x for x in xs)
open(".ab/BUILD", "w").write(f'''load("@rules_cc//cc:defs.bzl", "cc_binary", "cc_library")
cc_library(
    name = "daemon_before",
    srcs = ["old/daemon/daemon.cc", "old/daemon/cuda_backend.cc"],
    hdrs = ["old/daemon/daemon.h", "old/daemon/cuda_backend.h"],
    strip_include_prefix = "old",
    deps = [{q(all_deps)}],
)
cc_binary(
    name = "refitd_before",
    srcs = ["old/daemon/refitd_main.cc"],
    deps = [":daemon_before", "//daemon:config", "//daemon:logging"],
)
''')
PY
bazel build //.ab:refitd_before 2>&1 | grep -E "ERROR|error:" && exit 1
echo "$PWD/bazel-bin/.ab/refitd_before"

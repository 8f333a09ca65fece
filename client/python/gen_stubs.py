#!/usr/bin/env python3
"""Generates refit's Python protobuf modules from proto/*.proto into refit/_proto/.

Used by Bazel (a genrule) and by setup.py (pip install ./client/python), so the stubs are made
at build time from the protos and never checked in (gRPC stubs are derived from the service
descriptors at run time: refit/_rpc.py). protoc names the generated imports after
the proto paths ("from proto import layout_pb2"); they are rewritten to the package
("from refit._proto import layout_pb2") so that nothing named `proto` lands on sys.path.

    gen_stubs.py --proto-root DIR --out DIR [--protoc PROTOC]
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

PROTOS = ["proto/layout.proto", "proto/refit.proto"]


def find(tool, explicit):
    path = explicit or shutil.which(tool)
    if not path or not os.path.exists(path):
        sys.exit(f"gen_stubs: {tool} not found: install protoc (Debian: protobuf-compiler; "
                 "bash tools/setup.sh does), or pass --protoc")
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--proto-root", required=True, help="the folder that holds proto/")
    ap.add_argument("--out", required=True, help="where layout_pb2.py and refit_pb2.py go")
    ap.add_argument("--protoc", default="")
    args = ap.parse_args()
    protoc = find("protoc", args.protoc)
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([protoc, f"--proto_path={args.proto_root}", f"--python_out={tmp}", *PROTOS],
                       check=True)
        for name in ["layout_pb2.py", "refit_pb2.py"]:
            with open(os.path.join(tmp, "proto", name)) as f:
                text = f.read()
            text = re.sub(r"^from proto import ", "from refit._proto import ", text, flags=re.M)
            with open(os.path.join(args.out, name), "w") as f:
                f.write(text)


if __name__ == "__main__":
    main()

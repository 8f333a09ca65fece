"""refit's protobuf and gRPC modules, generated from proto/ at build time (gen_stubs.py)."""

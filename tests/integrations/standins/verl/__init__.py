"""Stand-in for `verl`: the checkpoint-engine plugin interface refit's adapter runs against.

Read from volcengine/verl:
  verl/checkpoint_engine/base.py  @ b178a3cd56f58b2d502255daba591e92833930a7 (snapshot of
      2026-01-29): CheckpointEngineRegistry.register/get/new, CheckpointEngine (prepare,
      build_topology, init_process_group, finalize, async send_weights, async receive_weights),
      CheckpointEngineWorker and CheckpointEngineManager.update_weights' order
  verl/workers/engine_workers.py  @ 54d74952e649e4b72c4bfad4c0c4acc2e1694ce5 (stored version):
      import_external_libs(checkpoint_engine_config.custom_backend_module or None), then
      CheckpointEngineRegistry.new(backend, is_master=(rank == 0), bucket_size=..., **engine_kwargs)
  verl/utils/import_utils.py      @ b178a3c: import_external_libs
Ray is replaced by direct calls; nothing of verl's code is copied.
"""

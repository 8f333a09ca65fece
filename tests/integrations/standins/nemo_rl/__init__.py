"""Stand-in for `nemo_rl`: the refit_transport plugin interface refit's adapter runs against.

Read from NVIDIA-NeMo/RL @ 7ea279abfbeb698b092856d0dab61e7cf39bc909 (snapshot of 2026-08-22):
  nemo_rl/utils/checkpoint_engines/base.py: CheckpointEngine and create_checkpoint_engine
      ("module:ClassName", constructed with bucket_size= and the transport's refit_cfg kwargs)
  nemo_rl/weight_sync/checkpoint_engine_weight_synchronizer.py: the order of one refit (init on
      both sides, prepare, init_*_process_group with policy metadata first, send_weights and
      receive_weight_batches together, finalize at shutdown)
  nemo_rl/models/generation/vllm/checkpoint_engine.py: the generation worker loads each batch
  docs/design-docs/checkpoint-engines.md: policy.generation.refit_transport / refit_cfg
Ray is replaced by direct calls; nothing of NeMo-RL's code is copied.
"""

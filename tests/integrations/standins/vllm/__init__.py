"""Stand-in for the `vllm` package: the weight-transfer interfaces refit's adapter runs against.

Read from vllm-project/vllm (stored sources; each file names the path and commit it mirrors):
  vllm/distributed/weight_transfer/base.py     @ 02f250b03f38822ccdb63f27a3005d10ca81f385
  vllm/distributed/weight_transfer/factory.py  @ 047c993cc49c32e9b94f5bf826a9214e163eb982
  vllm/distributed/weight_transfer/nccl_engine.py (call order of a trainer round; the engine's
      start/finish lifecycle) at the version whose NCCLTrainerWeightTransferEngine drives
      start_weight_update -> update_weights -> finish_weight_update
  vllm/plugins/__init__.py                     @ 01425553bdbed63400efa72ff14a8f4ffe20bada
  vllm/config/weight_transfer.py               (backend: a registered name, default "nccl")
  tests/v1/worker/test_gpu_worker_weight_transfer.py (the worker's session guard and failure latch)
Only the parts the adapter touches are here; nothing of vLLM's code is copied.
"""
__version__ = "0.0.0+refit-standin"

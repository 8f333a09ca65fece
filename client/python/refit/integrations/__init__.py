"""refit inside the RL stacks: adapters that plug refit into each stack's own weight-sync interface.

* ``refit.integrations.vllm``: a vLLM ``WeightTransferEngine`` named ``"refit"`` (engine side)
  and a ``TrainerWeightTransferEngine`` (trainer side); ``register()`` is the
  ``vllm.general_plugins`` entry point, so ``--weight-transfer-config '{"backend": "refit"}'``
  selects it.
* ``refit.integrations.sglang``: the SGLang weight-update session (pause, begin, refit, end,
  weight version, continue) over the server's HTTP routes, and the engine-side worker.
* ``refit.integrations.verl``: a verl checkpoint engine ``"refit"`` for
  ``checkpoint_engine.custom_backend_module``.
* ``refit.integrations.nemo_rl``: a NeMo-RL checkpoint engine for
  ``policy.generation.refit_transport: "refit.integrations.nemo_rl:RefitCheckpointEngine"``.

Each module imports its stack only when used, so importing this package needs none of them.
docs/INTEGRATIONS.md is the guide.
"""

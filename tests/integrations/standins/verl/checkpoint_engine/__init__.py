from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry  # noqa: F401

"""Stand-in for `sglang`: the RL weight-update routes refit's SGLang adapter drives.

Read from sgl-project/sglang (stored sources):
  python/sglang/srt/entrypoints/http_server.py @ 9c0549b727fe222444495cea6b369697534d60f0 (stored
      version; routes /pause_generation, /continue_generation, /update_weight_version,
      /get_weight_version, /flush_cache as published there)
  python/sglang/srt/managers/io_struct.py     @ f11d231cea29f76f78aaa524783d6556267e3b58
      (PauseGenerationReqInput.mode: "abort" | "retract" | "in_place";
      UpdateWeightVersionReqInput(new_version: str, abort_all_requests: bool))
The session routes /begin_weight_update and /end_weight_update (BeginWeightUpdateReqInput with
selector="all", EndWeightUpdateReqInput; end runs post_load_weights when load_weights was
bypassed) are NOT in the stored http_server.py: they mirror the issue's description and the
second-hand references to them found in other repositories (NVIDIA-NeMo/RL's SGLang patches,
radixark/miles' weight-update session), not SGLang's own source.
"""

"""Stand-in for vllm/plugins/__init__.py (vllm-project/vllm @ 01425553bdbed63400efa72ff14a8f4ffe20bada):
general plugins are the `vllm.general_plugins` entry points of installed distributions, loaded
once per process ($VLLM_PLUGINS may name the allowed ones) and called with no argument."""
import logging
import os
from importlib.metadata import entry_points

logger = logging.getLogger(__name__)

DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"

plugins_loaded = False


def load_plugins_by_group(group: str) -> dict:
    allowed = os.environ.get("VLLM_PLUGINS")
    allowed_plugins = None if allowed is None else allowed.split(",")
    plugins = {}
    for plugin in entry_points(group=group):
        if allowed_plugins is None or plugin.name in allowed_plugins:
            try:
                plugins[plugin.name] = plugin.load()
            except Exception:
                logger.exception("Failed to load plugin %s", plugin.name)
    return plugins


def load_general_plugins() -> None:
    global plugins_loaded
    if plugins_loaded:
        return
    plugins_loaded = True
    for func in load_plugins_by_group(group=DEFAULT_PLUGINS_GROUP).values():
        func()

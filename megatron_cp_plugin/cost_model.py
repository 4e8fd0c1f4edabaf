"""Deprecated alias of `megatron_cp_plugin.cost` (the cost model's package), kept for existing imports."""
from .cost import *  # noqa: F401,F403
from .cost import __all__  # noqa: F401

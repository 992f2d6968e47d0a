"""kvstream-backend: read spilled prefix KV from several storage tiers at once (KVStream).

``KVStreamBackend`` (the LMCache storage plugin) is imported lazily so that the engine, the
policy modules and the CLI do not import LMCache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["KVStreamBackend", "__version__"]

if TYPE_CHECKING:
    from .adapters.lmcache_plugin import KVStreamBackend


def __getattr__(name: str) -> Any:
    if name == "KVStreamBackend":
        from .adapters.lmcache_plugin import KVStreamBackend

        return KVStreamBackend
    raise AttributeError(name)

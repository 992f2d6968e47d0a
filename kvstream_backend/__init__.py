"""kvstream-backend: read spilled prefix KV from several storage tiers at once (KVStream).

The LMCache entry points are imported lazily, so that the engine, the policy modules and the CLI
do not import LMCache: ``KVStreamBackend`` (the storage plugin of LMCache's in-process engine)
``KVStreamL2Adapter`` with its ``KVStreamL2AdapterConfig`` (an L2 adapter of the
multi-process ``lmcache server``), and ``KVStreamHiCacheStorage`` (the storage backend of
SGLang's HiCache; imports SGLang).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["KVStreamBackend", "KVStreamHiCacheStorage", "KVStreamL2Adapter",
           "KVStreamL2AdapterConfig", "__version__"]

if TYPE_CHECKING:
    from .adapters.l2_adapter import KVStreamL2Adapter, KVStreamL2AdapterConfig
    from .adapters.lmcache_plugin import KVStreamBackend
    from .adapters.sglang_hicache import KVStreamHiCacheStorage


def __getattr__(name: str) -> Any:
    if name == "KVStreamBackend":
        from .adapters.lmcache_plugin import KVStreamBackend

        return KVStreamBackend
    if name in ("KVStreamL2Adapter", "KVStreamL2AdapterConfig"):
        from .adapters import l2_adapter

        return getattr(l2_adapter, name)
    if name == "KVStreamHiCacheStorage":
        from .adapters.sglang_hicache import KVStreamHiCacheStorage

        return KVStreamHiCacheStorage
    raise AttributeError(name)

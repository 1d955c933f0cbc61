"""Captures the model vLLM loads in this process, for CacheBlend (which runs it layer by layer).

LMCache asks users to patch vLLM's worker source for this (and crashes at start when they don't,
LMCache issue #4131). Here the package's `vllm.general_plugins` entry point, which vLLM runs in
every process before it builds the model runner, wraps `load_model` of vLLM's V1 model runners
(the CPU runner overrides it, so both are wrapped) as soon as their modules are imported.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import weakref
from typing import Any

_RUNNERS = {
    "vllm.v1.worker.gpu_model_runner": "GPUModelRunner",
    "vllm.v1.worker.cpu_model_runner": "CPUModelRunner",
}
_model: weakref.ref | None = None


def loaded_model() -> Any | None:
    """The model the last wrapped `load_model` in this process produced, if any."""
    return _model() if _model is not None else None


def model_for_blending(blocks_opaque: bool) -> Any:
    """The model CacheBlend runs layer by layer; raises at start, not at the first request, when
    that cannot work (`blocks_opaque`: vLLM's CPU backend on AMX, whose K layout is unverified)."""
    if blocks_opaque:
        raise RuntimeError("lmcache_triton: enable_blending is not supported by vLLM's CPU backend on AMX CPUs")
    model = loaded_model()
    if model is None:
        raise RuntimeError(
            "lmcache_triton: enable_blending needs the loaded model, which the lmcache_triton vLLM plugin "
            "captures from the model runner's load_model. It did not run: install lmcache-triton in vLLM's "
            "environment (its vllm.general_plugins entry point), keep VLLM_PLUGINS unset or include "
            "'lmcache_triton', and on vLLM 0.33 CUDA use the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
    return model


def _wrap(cls: type) -> None:
    original = cls.__dict__.get("load_model")
    if original is None or getattr(original, "_lmcache_triton_hook", False):
        return

    @functools.wraps(original)
    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        global _model
        out = original(self, *args, **kwargs)
        model = getattr(self, "model", None)
        # unwrap vLLM's CUDA-graph wrappers to the nn.Module with .model.layers
        while model is not None and not hasattr(model, "model") and hasattr(model, "runnable"):
            model = model.runnable
        if model is not None:
            _model = weakref.ref(model)
        return out

    load_model._lmcache_triton_hook = True  # type: ignore[attr-defined]
    cls.load_model = load_model


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps a runner class right after its module executes, without importing it earlier."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in _RUNNERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module: Any) -> None:
            exec_module(module)
            _wrap(getattr(module, _RUNNERS[name]))

        spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Idempotent: wraps the runners already imported, and the others when they are."""
    for name, cls_name in _RUNNERS.items():
        module = sys.modules.get(name)
        if module is not None:
            _wrap(getattr(module, cls_name))
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())

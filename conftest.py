"""Loaded by pytest before any test module.

Without CUDA, in-process tests run the Triton kernels through Triton's interpreter, so the engine
and connector tests exercise the same kernel code a GPU runs. triton.jit reads TRITON_INTERPRET
when a kernel is decorated (the first import of lmcache_triton.kernels), hence here, first.
Tests that start a subprocess drop the variable for the child, which then runs what users run on
a CPU host: the torch path.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

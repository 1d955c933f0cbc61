"""Kernel tests run on CPU through Triton's interpreter when there is no CUDA device.

triton.jit reads TRITON_INTERPRET when a kernel is *decorated*, i.e. when lmcache_triton.kernels is
first imported, so this must run before that import. (If another conftest imports the package
first, `test_triton_path_is_exercised` fails and says so; set the variable there too.)
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"

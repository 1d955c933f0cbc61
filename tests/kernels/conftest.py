"""Kernel tests run on CPU through Triton's interpreter when there is no CUDA device.

triton.jit reads TRITON_INTERPRET when a kernel is *decorated*, i.e. when lmcache_triton.kernels is
first imported, so this must run before that import. (If another conftest imports the package
first, `test_triton_path_is_exercised` fails and says so; set the variable there too.)

On a CUDA host every test that takes the `device` fixture runs natively on the GPU, and is marked
`gpu` as well, so `pytest -m gpu` there is the whole native matrix: these tests at their CI shapes
plus the `gpu`-only cases at larger shapes.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_HERE = Path(__file__).parent


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        return
    for item in items:
        if _HERE in Path(item.path).parents and "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.gpu)

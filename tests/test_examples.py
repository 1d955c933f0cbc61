from pathlib import Path

import pytest

from lmcache_triton.config import LMCacheEngineConfig

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_configs_load(path):
    assert LMCacheEngineConfig.from_file(path).chunk_size == 256

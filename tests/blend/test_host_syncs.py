"""The blend path never waits for the device (issue #16): counted with `HostSyncs`, the torch calls
that would make the host wait on a GPU, over a whole blend on a tiny random Llama.

On a GPU, `test_blend_on_cuda_never_syncs` runs the same blend under torch's own sync detector.
"""

import pytest
import torch

from lmcache_triton.blend import HFLlamaLayerwise, LMCBlender, TensorKVSource, segment_positions
from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.kernels import common, rope_rerotate, selective_write
from lmcache_triton.tools.models import TinyLlamaSpec, build_random_llama, random_prompt
from lmcache_triton.tools.testing import HostSyncs


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import LlamaForCausalLM

    path = build_random_llama(tmp_path_factory.mktemp("tiny-llama"),
                              TinyLlamaSpec(hidden_size=128, num_hidden_layers=4, head_dim=32, seed=3))
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _inputs(model, device="cpu"):
    tokens = [t if t > 5 else 6 for t in random_prompt(70, seed=4)]
    ranges = [(0, 30), (32, 55), (57, 70)]  # three segments, two separators of two tokens
    mask, positions = segment_positions(len(tokens), ranges)
    kv_dim = model.config.num_key_value_heads * model.config.head_dim
    gen = torch.Generator().manual_seed(5)
    cached = [torch.randn(2, len(tokens), kv_dim, generator=gen).to(device)
              for _ in range(model.config.num_hidden_layers)]
    return torch.tensor(tokens), mask, positions, cached


def _run(blender, tokens, mask, positions, cached, syncs=None):
    gen = blender.blend_layers(tokens, TensorKVSource(cached), cached_mask=mask, cached_positions=positions)
    layer = 0
    while True:
        if syncs is not None:
            syncs.step = layer
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value
        layer += 1


@pytest.mark.parametrize("check_layers,ratios", [
    pytest.param([1], [0.15], id="one-check"),
    pytest.param([1, 2], [0.5, 0.3], id="two-checks"),
    pytest.param([0], [0.0], id="ratio0-at-layer0"),
    pytest.param([1], [1.0], id="ratio1"),
])
def test_blend_reads_nothing_back_from_the_device(model, check_layers, ratios, monkeypatch):
    # The launchers' range checks run where they are free, on host tensors; everything here is on
    # the CPU, so take the branch a GPU run takes (the kernels, interpreted, bound indices themselves).
    monkeypatch.setattr(common, "in_host_memory", lambda t: False)
    cfg = LMCacheEngineConfig.from_defaults(blend_recompute_ratios=ratios, blend_check_layers=check_layers)
    blender = LMCBlender(model, cfg)
    tokens, mask, positions, cached = _inputs(model)
    with HostSyncs(host=(tokens, mask, positions)) as syncs:
        res = _run(blender, tokens, mask, positions, cached, syncs)
    assert syncs.calls == [], f"calls that would wait for a GPU, (call, layer): {syncs.calls}"
    # and the selection is what the blender promises: the rows that must be recomputed, plus the budget
    must = set((~mask).nonzero().flatten().tolist()) | {len(tokens) - 1}
    assert must <= set(res.recompute_indices.tolist())


def test_the_counter_sees_what_a_gpu_would_wait_for(model):
    """The counter is not blind: the old blend path's waits, one by one, are each recorded."""
    dev, idx = torch.rand(8), torch.tensor([1, 2])
    for call in (lambda: int(dev.max()), lambda: dev.argmax().item(), lambda: torch.unique(idx),
                 lambda: dev.nonzero(), lambda: dev[dev > 0.5], lambda: dev.tolist(), lambda: dev.cpu(),
                 lambda: bool((dev > 2).any())):
        with HostSyncs() as syncs:
            call()
        assert len(syncs.calls) == 1, syncs.calls
    k = torch.randn(6, 2, 32)
    table = torch.randn(64, 32)
    with HostSyncs() as syncs:  # host positions: the range check is free there, and is made
        rope_rerotate(k, torch.arange(6), torch.arange(6) + 3, table, is_neox=True)
        selective_write(k, k[:2].clone(), torch.tensor([0, 5]))
    assert [c for c, _ in syncs.calls].count("__int__") >= 3


@pytest.mark.gpu
def test_blend_on_cuda_never_syncs(model):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cuda_model = model.to("cuda")
    try:
        cfg = LMCacheEngineConfig.from_defaults(blend_recompute_ratios=[0.15], blend_check_layers=[1])
        blender = LMCBlender(cuda_model, cfg)
        tokens, mask, positions, cached = _inputs(cuda_model, "cuda")
        gen = blender.blend_layers(tokens, TensorKVSource(cached), cached_mask=mask, cached_positions=positions)
        next(gen)  # the request's setup reads the host mask; Triton compiles on first use
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in gen:
                pass
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        model.to("cpu")

"""A load that fails in the middle of a prompt (loading.py's LoadErrors, and what the worker does
with it), on the real engine: a disk tier whose middle chunk fails its checksum when the worker
reads it (with `local_cpu` off, a load whose lookup hold is gone reads the disk). Chunk 0 loads;
chunk 1 and every block after it up to the end of the load are reported for vLLM to recompute,
none before; and nothing the step computed for that request is saved, since its forward ran over
blocks that never received their KV."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from worker_stubs import BLOCK, CHUNK, GEO, Steps
from worker_stubs import real_engine as _real_engine
from worker_stubs import save as _save
from worker_stubs import worker as _worker

from lmcache_triton.integration.vllm.specs import LMCacheConnectorMetadata, LoadSpec, ReqMeta, SaveSpec
from lmcache_triton.kernels import paged_gather
from lmcache_triton.storage.manager import CPU_TIER
from lmcache_triton.tools.testing import make_kv_caches

PROMPT = list(range(1000, 1000 + 4 * CHUNK))
FIRST_BLOCK = 8  # the load's blocks: 8, 9, ... (slots from 8 * BLOCK on)


def _disk_engine(closing, tmp_path, layerwise: bool):
    """A real engine with three chunks of PROMPT on its disk tier only, the middle one's file rotten."""
    engine = _real_engine(closing, layerwise, local_cpu=False, local_disk=str(tmp_path / "disk"),
                          max_local_disk_size=0.01)
    src = make_kv_caches("vllm_cpu", generator=torch.Generator().manual_seed(0), **GEO)
    assert engine.store(PROMPT[:3 * CHUNK], kvcaches=src, slot_mapping=torch.arange(3 * CHUNK)) == 3 * CHUNK
    engine.storage_manager.flush()
    disk = engine.storage_manager.tiers[0]
    keys = [k for _, _, key in engine.token_database.process_tokens(PROMPT[:3 * CHUNK]) for k in engine._object_keys(key)]
    per_chunk = len(keys) // 3
    for key in keys[per_chunk:2 * per_chunk]:  # chunk 1 (each of its layers, layerwise)
        path = disk.path_for(key)
        data = bytearray(path.read_bytes())
        data[-7] ^= 0x5A
        path.write_bytes(bytes(data))
    return engine, src


def _step(load: int, save_from: int | None) -> ReqMeta:
    """The request's step: its 4 chunks in blocks FIRST_BLOCK.., `load` tokens loaded (what the
    lookup reported), saved from `save_from` on."""
    return ReqMeta(req_id="r", token_ids=PROMPT, slot_mapping=torch.arange(FIRST_BLOCK * BLOCK,
                                                                          FIRST_BLOCK * BLOCK + len(PROMPT)),
                   load_spec=LoadSpec(0, load, True),
                   save_spec=None if save_from is None else SaveSpec(save_from, True))


def _run_step(side, layers: int) -> None:
    """vLLM's calls for one step: the loads, each layer's wait and save (layerwise), the step's end."""
    side.start_load_kv(None)
    for layer in range(layers):
        side.wait_for_layer_load(f"layer.{layer}")
        side.save_kv_layer(f"layer.{layer}", None, None)
    _save(side)


def _stored(engine) -> list[bool]:
    """Which of PROMPT's 4 chunks a tier keeps (every layer of it, layerwise)."""
    return [engine.storage_manager.contains(keys, io=True, prefix=True) == len(keys)
            for keys in (engine._object_keys(k) for _, _, k in engine.token_database.process_tokens(PROMPT))]


@pytest.mark.parametrize("layerwise", [False, True], ids=["all-layers", "layerwise"])
def test_a_middle_chunk_that_fails_its_checksum_reports_exactly_its_blocks_and_those_after(
        closing, tmp_path, layerwise):
    engine, src = _disk_engine(closing, tmp_path, layerwise)
    dst = make_kv_caches("vllm_cpu", fill=0, **GEO)
    side = _worker(LMCacheConnectorMetadata(requests=[_step(load=3 * CHUNK, save_from=3 * CHUNK)]), engine, caches=dst)
    closing.append(side)
    _run_step(side, len(dst) if layerwise else 0)
    per_chunk = CHUNK // BLOCK
    assert side.get_block_ids_with_load_errors() == set(range(FIRST_BLOCK + per_chunk, FIRST_BLOCK + 3 * per_chunk)), \
        "chunk 1's blocks and chunk 2's (behind the gap: never loaded) are reported, chunk 0's are not"
    assert engine.get_stats().hit_tokens == CHUNK
    slots = torch.arange(FIRST_BLOCK * BLOCK, FIRST_BLOCK * BLOCK + CHUNK)
    assert torch.equal(paged_gather(dst, slots, "vllm_cpu"), paged_gather(src, torch.arange(CHUNK), "vllm_cpu")), \
        "chunk 0 loaded"
    # chunk 1 was dropped as corrupt; chunk 3, computed in this step over blocks that never got
    # chunks 1 and 2, was not saved
    assert _stored(engine) == [True, False, True, False]
    if not layerwise:  # the scheduler holds the request's blocks for its saves: they are reported done
        assert side.get_finished({"r"}) == {"r"}
    assert engine.storage_manager.usage()[CPU_TIER].used_bytes == 0, "the load left chunks held"


def test_the_step_after_the_failed_load_saves_as_usual(closing, tmp_path):
    """vLLM computes the request again from chunk 1 (the scheduler side sends the chunks from 1 on
    to save): they are stored, chunk 1 afresh."""
    engine, _ = _disk_engine(closing, tmp_path, layerwise=False)
    dst = make_kv_caches("vllm_cpu", fill=0, **GEO)
    side = _worker(LMCacheConnectorMetadata(requests=[_step(load=3 * CHUNK, save_from=3 * CHUNK)]), engine, caches=dst)
    closing.append(side)
    _run_step(side, 0)
    assert side.get_block_ids_with_load_errors()
    side.parent = Steps(LMCacheConnectorMetadata(requests=[replace(_step(0, save_from=CHUNK), load_spec=None)]))
    _run_step(side, 0)
    engine.storage_manager.flush()
    assert _stored(engine) == [True] * 4
    assert side.get_block_ids_with_load_errors() == set()

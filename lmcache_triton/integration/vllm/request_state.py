"""One object per request on the scheduler side (in the spirit of nano-vllm's `Sequence`).

`SchedulerSide` keeps a `RequestState` per request id in one dict. It is created the first time
vLLM asks about the request (`get_num_new_matched_tokens`, or `update_state_after_alloc` when no
lookup came first) and removed by `request_finished` alone: vLLM calls it for every request it
frees (finished, aborted while waiting or while its lookup runs, preempted and then aborted), and
only then lists the id in a step's `finished_req_ids`
(vllm/v1/core/sched/scheduler.py: `_free_request` -> `_connector_finished`). So
`finished_req_ids` frees nothing here, and whether a request holds its blocks for a save cannot
depend on the order in which the two arrive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmcache_triton.integration.vllm.specs import LoadSpec, RequestTracker
from lmcache_triton.keys import ChunkHashes, MMSpan, TokenChain


@dataclass
class RequestState:
    req_id: str
    request: Any = None               # vLLM's Request, from update_state_after_alloc on
    # What the last lookup decided; each lookup (vLLM asks again while the request waits, and
    # after a preemption) decides anew.
    lookup_pending: bool = False      # an asynchronous lookup not answered yet
    uncacheable: bool = False         # declined for a reason that forbids saving too (declines.py)
    declined: str | None = None       # why the connector left it to vLLM (counted once, kept)
    load_spec: LoadSpec | None = None  # sent with the request's next scheduled step, then None
    verify_tokens: int = 0            # a hit vLLM recomputes to check (verify_hit_rate); to the tracker
    # The prompt's token chain and span hashes (what a lookup sends), hashed at its first lookup.
    chain: TokenChain | None = None
    prompt_hashes: ChunkHashes | None = None
    tracker: RequestTracker | None = None  # from its first scheduled step on
    # Saves run after the step (worker.py): a request sent a save keeps its blocks once finished
    # until the workers report its saves done. Layerwise saves finish inside the forward: never set.
    saving: bool = False

    def prompt_chain(self, chunk_size: int, prompt: list[int], spans: list[MMSpan] | None
                     ) -> tuple[TokenChain, ChunkHashes]:
        """The request's chain and its prompt's span hashes, hashed at its first lookup only (the
        questions vLLM repeats while the request waits cost nothing)."""
        if self.chain is None or self.prompt_hashes is None or self.prompt_hashes.num_tokens != len(prompt):
            self.chain = TokenChain(chunk_size, spans)
            self.prompt_hashes = self.chain.chunk_hashes(prompt)
        return self.chain, self.prompt_hashes

    def new_lookup(self) -> None:
        """Forget the last lookup's decisions: this one decides."""
        self.lookup_pending = False
        self.uncacheable = False
        self.load_spec = None
        self.verify_tokens = 0

    def take_load_spec(self) -> LoadSpec | None:
        """The load to send with this step (once)."""
        spec, self.load_spec = self.load_spec, None
        return spec

    def take_verify_tokens(self) -> int:
        tokens, self.verify_tokens = self.verify_tokens, 0
        return tokens

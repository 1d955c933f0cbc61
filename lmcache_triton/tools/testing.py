"""Paged KV caches in vLLM's layouts, filled with random bytes: for the tests, the bench and the demo.

Imports only torch, so the GPU test matrix and the bench run where only torch and triton exist.
"""

from __future__ import annotations

import torch

# vLLM's stride permutations of the packed layout (vllm/v1/kv_cache_layout.py): the physical order
# of (L)ayer, (B)lock, toke(N) in block, (H)ead, (C)hannel in the one allocation holding all layers.
PACKED_ORDERS = ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "LHBNC", "BHLNC")


def fill_random_(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random bytes for any dtype (fp8 and integer caches included), finite for floating types."""
    if t.dtype.is_floating_point and t.element_size() > 1:
        return t.copy_(torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.dtype))
    raw = torch.randint(0, 256, t.shape, generator=generator, dtype=torch.uint8)
    if t.dtype == torch.uint8:
        return t.copy_(raw)
    if t.element_size() == 1:  # float8: keep away from NaN encodings (0x7f/0xff in e4m3fn)
        return t.view(torch.uint8).copy_(raw & 0x7E)
    return t.copy_(raw.to(t.dtype))


def make_kv_caches(layout: str, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                   head_size: int, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                   order: str = "LBNHC", fill: float | None = None,
                   generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Per-layer tensors shaped exactly as vLLM hands them to `register_kv_caches`.

    `order` applies to "vllm_packed": the physical axis order of the single allocation. MLA takes
    `num_kv_heads=1` and `head_size=C`. `fill` sets every element (a sentinel); None fills random.
    """
    nb, bs, h, hs = num_blocks, block_size, num_kv_heads, head_size
    if layout == "vllm_packed":
        if sorted(order) != sorted("LBNHC"):
            raise ValueError(f"order must be a permutation of LBNHC, got {order!r}")
        sizes = {"L": num_layers, "B": nb, "N": bs, "H": h, "C": 2 * hs}
        base = torch.empty([sizes[a] for a in order], dtype=dtype, device=device)
        # logical per layer: [B, H, N, C]
        logical = base.permute([order.index(a) for a in "LBHNC"])
        caches = [logical[i] for i in range(num_layers)]
    else:
        shapes = {
            "vllm_cpu": (nb, h, 2 * bs, hs),
            "flash_attn": (2, nb, bs, h, hs),
            "flashinfer": (nb, 2, bs, h, hs),
            "mla": (nb, bs, hs),
        }
        if layout not in shapes:
            raise ValueError(f"unknown layout {layout!r}")
        if layout == "mla" and h != 1:
            raise ValueError("mla caches have one head: pass num_kv_heads=1 and head_size=C")
        base = torch.empty((num_layers, *shapes[layout]), dtype=dtype, device=device)
        caches = [base[i] for i in range(num_layers)]
    if fill is None:
        fill_random_(base, generator)
    else:
        base.view(torch.uint8).fill_(int(fill)) if dtype.itemsize == 1 and not dtype.is_floating_point else base.fill_(fill)
    return caches


def random_slot_mapping(num_tokens: int, *, num_blocks: int, block_size: int, device: str | torch.device = "cpu",
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """Slots of `num_tokens` tokens as vLLM assigns them: whole blocks picked at random, in order
    within each block (slot = block_id * block_size + offset)."""
    blocks_needed = -(-num_tokens // block_size)
    if blocks_needed > num_blocks:
        raise ValueError(f"{num_tokens} tokens need {blocks_needed} blocks of {block_size}, only {num_blocks} exist")
    blocks = torch.randperm(num_blocks, generator=generator)[:blocks_needed]
    slots = (blocks[:, None] * block_size + torch.arange(block_size)[None, :]).reshape(-1)[:num_tokens]
    return slots.to(device=device, dtype=torch.int64)


def stop_session(proc, grace_s: float = 20.0) -> None:
    """Stops a server started with `start_new_session=True` and everything it started: SIGTERM to
    its process group (vLLM shuts its engine processes down on it), then SIGKILL to what is left."""
    import os
    import signal
    import subprocess

    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class HostSyncs(torch.overrides.TorchFunctionMode):
    """Records the torch calls that make the host wait for the device when their tensor is on a GPU:
    reading values (`item`, `int()`, `float()`, `bool()`, `tolist`, `numpy`), copies to the host
    (`cpu`; not `.to(device)`, which a CPU run cannot tell from a copy to the GPU), and ops whose
    output size depends on the values (`nonzero`, `unique`, `masked_select`, indexing by a bool
    mask, one-argument `where`, `repeat_interleave` without `output_size`). On a CPU they cost nothing, but they are where a GPU run would wait, so a CPU
    test can count them. Calls on the tensors in `host` (the caller's inputs, in host memory
    anyway) are not recorded. `calls` lists (function name, step) with `step` set by the caller.
    """

    _READS = {"item", "tolist", "numpy", "cpu", "__int__", "__float__", "__bool__", "__index__",
              "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "nonzero_static"}

    def __init__(self, host: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self._host = {id(t) for t in host}
        self.calls: list[tuple[str, object]] = []
        self.step: object = None

    @staticmethod
    def _is_mask(index: object) -> bool:
        items = index if isinstance(index, tuple) else (index,)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)

    def _waits(self, name: str, args: tuple, kwargs: dict) -> bool:
        if args and isinstance(args[0], torch.Tensor) and id(args[0]) in self._host:
            return False
        if name in self._READS:
            return True
        if name in ("__getitem__", "__setitem__"):
            return len(args) > 1 and self._is_mask(args[1])
        if name == "where":
            return len(args) + len(kwargs) == 1
        if name == "repeat_interleave":
            return "output_size" not in kwargs and not (args and isinstance(args[-1], int) and len(args) == 2)
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if self._waits(name, args, kwargs):
            self.calls.append((name, self.step))
        return func(*args, **kwargs)

"""What the engine knows about the model whose KV it caches."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LMCacheEngineMetadata:
    """Model facts that shape every chunk and are part of every key.

    kv_shape is `(num_layers, 2 or 1, chunk_size, num_kv_heads, head_size)`: 2 for K and V,
    1 for MLA (one latent vector per token, `num_kv_heads == 1`, `head_size == C`).
    """

    model_name: str
    world_size: int
    worker_id: int
    kv_dtype: torch.dtype
    kv_shape: tuple[int, int, int, int, int]
    use_mla: bool = False
    # Everything else that changes a token's KV for this engine and is not in the fields above:
    # model revision, quantization, rope overrides, KV cache dtype, the cache's block format
    # (vLLM's AMX CPU blocks are not the "vec" blocks). Folded into every key's identity.
    kv_identity: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"metadata model_name must be a non-empty string, got {self.model_name!r}")
        if self.world_size < 1 or not 0 <= self.worker_id < self.world_size:
            raise ValueError(
                f"metadata worker_id must be in [0, world_size), got worker_id={self.worker_id} "
                f"world_size={self.world_size}"
            )
        if not isinstance(self.kv_dtype, torch.dtype):
            raise ValueError(f"metadata kv_dtype must be a torch.dtype, got {self.kv_dtype!r}")
        shape = tuple(int(x) for x in self.kv_shape)
        if len(shape) != 5 or any(x <= 0 for x in shape):
            raise ValueError(
                "metadata kv_shape must be (num_layers, 2 or 1, chunk_size, num_kv_heads, head_size) "
                f"with positive entries, got {self.kv_shape!r}"
            )
        expected_kv = 1 if self.use_mla else 2
        if shape[1] != expected_kv:
            raise ValueError(
                f"metadata kv_shape[1] must be {expected_kv} when use_mla={self.use_mla}, got {shape[1]}"
            )
        if self.use_mla and shape[3] != 1:
            raise ValueError(f"metadata kv_shape[3] (num_kv_heads) must be 1 for MLA, got {shape[3]}")
        object.__setattr__(self, "kv_shape", shape)

    @property
    def num_layers(self) -> int:
        return self.kv_shape[0]

    @property
    def chunk_size(self) -> int:
        return self.kv_shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_shape[3]

    @property
    def head_size(self) -> int:
        return self.kv_shape[4]

    @property
    def hidden_dim_size(self) -> int:
        """Elements per token per layer for K (or for the MLA latent)."""
        return self.kv_shape[3] * self.kv_shape[4]

    @property
    def dtype_name(self) -> str:
        return str(self.kv_dtype).removeprefix("torch.")

    def bytes_per_token(self) -> int:
        """Bytes of KV one token occupies across all layers."""
        return self.num_layers * self.kv_shape[1] * self.hidden_dim_size * self.kv_dtype.itemsize

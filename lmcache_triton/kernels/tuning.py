"""Tuned tile configs of the paged copy kernels, read from a JSON file written by `bench.kernels --tune`.

The file (default ``~/.cache/lmcache_triton/kernel_tuning.json``, or ``$LMCACHE_TRITON_TUNING_FILE``):

    {"version": 2, "device": "NVIDIA H100 80GB HBM3", "triton": "3.9.0",
     "configs": {"gather/device/4096/2": {"BLOCK_T": 4, "BLOCK_D": 1024, "num_warps": 4},
                 "gather/pinned/4096/2": {...}, ...}}

Keys are ``direction/placement/hidden/element_size``. The placement is where the chunk lives:
``device`` (in the cache's device memory) or ``pinned`` (pinned host memory read or written by the
kernel over PCIe, zero-copy, with a capped grid: paged_copy.zero_copy_max_programs); the best tile
differs between the two. Sizes are constexprs only, never the token count, so a tuned config never
causes a recompile as request lengths change.

``device`` is the name of the GPU the file was tuned on (:func:`device_name`; ``cpu`` for the CPU
path); it is required. A file tuned on another GPU model than the one a launch runs on is not
applied there: one warning, the heuristic is used (a tile is right on every GPU, only its speed is
the other GPU's).

Version 1 files (keys ``direction/hidden/element_size``) are read, as placement ``device``: the
version-1 tuner timed device-resident chunks only, so that is exactly what they measured, and
refusing them would throw a valid tuning away on upgrade. Their ``device`` is checked as in version
2; one naming no device (the format did not require it; the tuner always wrote it) is applied on no
GPU, with the same one warning. `save` writes version 2 only.

The file is read once, lazily, on the first launch; a missing default file is the normal case
(silently: the heuristic applies). A file that is corrupt, invalid, or named by the environment
variable but missing falls back to the heuristic with one warning. Importing this module reads
nothing.

The tuner (`bench.kernels --tune`) chooses with :func:`pick`: a tile whose output differs from the
oracle is rejected, however fast; among the rest the fastest wins.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

ENV_VAR = "LMCACHE_TRITON_TUNING_FILE"
VERSION = 2
READ_VERSIONS = (1, 2)
DIRECTIONS = ("gather", "scatter")
PLACEMENTS = ("device", "pinned")  # the chunk in the cache's device memory / in pinned host memory
_WARPS = (1, 2, 4, 8, 16, 32)
# BLOCK_D >= 16 keeps every tile a whole number of 16-byte vectors (VEC is at most 16 elements);
# the tile cap bounds registers per program (64 Ki elements = 128 KiB of bf16 at 32 warps).
_MIN_BLOCK_D = 16
_MAX_TILE_ELEMS = 65536


@dataclass(frozen=True)
class TileConfig:
    block_t: int
    block_d: int
    num_warps: int

    def __post_init__(self) -> None:
        for name in ("block_t", "block_d", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a positive power of two, got {v!r}")
        if self.block_d < _MIN_BLOCK_D:
            raise ValueError(f"block_d must be >= {_MIN_BLOCK_D}, got {self.block_d}")
        if self.block_t * self.block_d > _MAX_TILE_ELEMS:
            raise ValueError(f"block_t * block_d must be <= {_MAX_TILE_ELEMS}, got {self.block_t * self.block_d}")
        if self.num_warps not in _WARPS:
            raise ValueError(f"num_warps must be one of {_WARPS}, got {self.num_warps}")

    def to_json(self) -> dict[str, int]:
        return {"BLOCK_T": self.block_t, "BLOCK_D": self.block_d, "num_warps": self.num_warps}

    @classmethod
    def from_json(cls, d: object) -> TileConfig:
        if not isinstance(d, dict) or set(d) != {"BLOCK_T", "BLOCK_D", "num_warps"}:
            raise ValueError(f"a config must be {{'BLOCK_T', 'BLOCK_D', 'num_warps'}}, got {d!r}")
        return cls(d["BLOCK_T"], d["BLOCK_D"], d["num_warps"])


def config_key(direction: str, hidden: int, element_size: int, placement: str = "device") -> str:
    """``direction/placement/hidden/element_size``, e.g. ``gather/device/4096/2``."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    return f"{direction}/{placement}/{int(hidden)}/{int(element_size)}"


_device_names: dict[torch.device, str] = {}


def device_name(device: torch.device) -> str:
    """The name a tuning file records and is matched against: the CUDA device's name
    (``torch.cuda.get_device_name``), ``cpu`` for anything else."""
    name = _device_names.get(device)
    if name is None:
        name = _device_names[device] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return name


def tuning_file() -> Path:
    env = os.environ.get(ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lmcache_triton" / "kernel_tuning.json"


def parse_file(payload: object) -> tuple[str, dict[str, TileConfig]]:
    """Validate a decoded tuning file: (the device it was tuned on, "" if a version-1 file names
    none; its configs under version-2 keys). Raises ValueError naming what is wrong."""
    if not isinstance(payload, dict):
        raise ValueError("the tuning file must hold a JSON object")
    version = payload.get("version")
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise ValueError(f"version must be one of {READ_VERSIONS}, got {version!r}")
    device = payload.get("device", "" if version == 1 else None)
    if not isinstance(device, str) or (version != 1 and not device):
        raise ValueError(f"device must name the GPU the file was tuned on, got {device!r}")
    configs = payload.get("configs")
    if not isinstance(configs, dict):
        raise ValueError("configs must be an object of 'direction/placement/hidden/element_size' -> config")
    out = {}
    for key, value in configs.items():
        parts = key.split("/") if isinstance(key, str) else []
        if version == 1 and len(parts) == 3:
            parts.insert(1, "device")   # a version-1 key: tuned with device-resident chunks
        if (len(parts) != 4 or parts[0] not in DIRECTIONS or parts[1] not in PLACEMENTS
                or not all(p.isdigit() for p in parts[2:])):
            expected = ("'gather|scatter/<hidden>/<element size>'" if version == 1 else
                        "'gather|scatter/device|pinned/<hidden>/<element size>'")
            raise ValueError(f"bad config key {key!r}: expected {expected}")
        try:
            out["/".join(parts)] = TileConfig.from_json(value)
        except ValueError as e:
            raise ValueError(f"configs[{key!r}]: {e}") from None
    return device, out


def parse(payload: object) -> dict[str, TileConfig]:
    """The configs of a decoded tuning file (:func:`parse_file`)."""
    return parse_file(payload)[1]


def load_file(path: Path) -> tuple[str, dict[str, TileConfig]]:
    return parse_file(json.loads(Path(path).read_text()))


def load(path: Path) -> dict[str, TileConfig]:
    return load_file(path)[1]


def save(configs: dict[str, TileConfig], path: Path | None = None, **meta: str) -> Path:
    """Write configs (and metadata: ``device``, required, see :func:`device_name`; the triton
    version) atomically, in the current version."""
    path = Path(path) if path is not None else tuning_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"version": VERSION, **meta, "configs": {k: v.to_json() for k, v in sorted(configs.items())}}
    parse(payload)  # never write what the reader would reject
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(path)
    return path


_lock = threading.Lock()
_loaded: dict[str, TileConfig] | None = None
_tuned_on: str | None = None        # the loaded file's device; None: any (no file, or `using`)
_mismatch_warned = False
# Changes whenever what `lookup` answers may change: launch plans made before are stale then.
_generation = 0


def generation() -> int:
    return _generation


def _load_once() -> dict[str, TileConfig]:
    global _loaded, _tuned_on
    if _loaded is None:
        with _lock:
            if _loaded is None:
                path = tuning_file()
                configs: dict[str, TileConfig] = {}
                tuned_on = None
                if path.exists() or os.environ.get(ENV_VAR):
                    try:
                        tuned_on, configs = load_file(path)
                    except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
                        warnings.warn(f"lmcache_triton: ignoring kernel tuning file {path} ({e}); "
                                      f"using the built-in tile heuristic", RuntimeWarning, stacklevel=3)
                _tuned_on, _loaded = tuned_on, configs
    return _loaded


def _other_device(configs: dict[str, TileConfig], running: str | None) -> bool:
    """Whether the loaded configs were tuned on another device than ``running`` (warned once)."""
    global _mismatch_warned
    tuned_on = _tuned_on
    if not configs or running is None or tuned_on is None or tuned_on == running:
        return False
    if not _mismatch_warned:
        _mismatch_warned = True
        warnings.warn(f"lmcache_triton: not applying kernel tuning file {tuning_file()}: tuned on "
                      f"{tuned_on or 'an unnamed device'!r}, running on {running!r}; using the built-in "
                      f"tile heuristic (run `python -m bench.kernels --tune` on this GPU)",
                      RuntimeWarning, stacklevel=3)
    return True


def lookup(direction: str, hidden: int, element_size: int, placement: str = "device",
           device_name: str | None = None) -> TileConfig | None:
    """The tuned config for this key, or None (then the launcher's heuristic applies): also None
    where the file was tuned on another device than ``device_name`` (None: not checked)."""
    configs = _load_once()
    if _other_device(configs, device_name):
        return None
    return configs.get(config_key(direction, hidden, element_size, placement))


def reset() -> None:
    """Forget the loaded file (tests, and `bench.kernels --tune` after writing a new one)."""
    global _loaded, _tuned_on, _generation, _mismatch_warned
    with _lock:
        _loaded = _tuned_on = None
        _mismatch_warned = False
        _generation += 1


@contextlib.contextmanager
def using(configs: dict[str, TileConfig]) -> Iterator[None]:
    """Inside the block the launchers read exactly ``configs`` (the file is not read): how the
    tuner runs one candidate. Afterwards what was loaded before is back."""
    global _loaded, _tuned_on, _generation
    with _lock:
        before, _loaded = (_loaded, _tuned_on), dict(configs)
        _tuned_on = None    # the candidates are for the device that runs them
        _generation += 1
    try:
        yield
    finally:
        with _lock:
            _loaded, _tuned_on = before
            _generation += 1


@dataclass(frozen=True)
class Trial:
    config: TileConfig
    ms: float            # median time; inf when rejected
    rejected: str = ""   # why it was never timed: what differed from the oracle, or the exception
    raised: bool = False  # rejected for an exception (e.g. a tile the compiler cannot build), not a wrong output


def pick(key: str, candidates: Iterable[TileConfig], check: Callable[[], str | None],
         time_ms: Callable[[], float]) -> tuple[TileConfig | None, list[Trial]]:
    """The fastest candidate for ``key`` whose output is right, and every trial.

    Under each candidate (:func:`using`), ``check()`` runs the launcher once and compares its output
    with the oracle: None if bit-exact, else what differs. Only then is the candidate timed with
    ``time_ms()``. A wrong output, or an exception in either (a tile the compiler cannot build), is
    a rejection, reported in the trials and never selected: speed never excuses a wrong copy.
    None when every candidate was rejected.
    """
    trials = []
    for cfg in candidates:
        with using({key: cfg}):
            try:
                problem = check()
                trial = Trial(cfg, math.inf, problem) if problem else Trial(cfg, float(time_ms()))
            except Exception as e:  # noqa: BLE001 - any failure rejects this candidate only
                trial = Trial(cfg, math.inf, f"{type(e).__name__}: {e}", raised=True)
        trials.append(trial)
    ok = [t for t in trials if not t.rejected]
    return (min(ok, key=lambda t: t.ms).config if ok else None), trials


__all__ = ["ENV_VAR", "PLACEMENTS", "TileConfig", "Trial", "config_key", "device_name", "tuning_file", "parse",
           "parse_file", "load", "load_file", "save", "lookup", "reset", "using", "pick"]

"""What every bench result row carries: device, commit, time; and where rows are written."""

from __future__ import annotations

import json
from collections.abc import Callable
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

# One matplotlib import for the benches and the demo (the package cannot import bench/).
from lmcache_triton.tools.vllm_demo import PlotUnavailable as MatplotlibMissing  # noqa: F401
from lmcache_triton.tools.vllm_demo import pyplot

RESULTS = Path(__file__).resolve().parent / "results"


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def context() -> dict[str, str]:
    return {"device": device_name(), "commit": commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "torch": torch.__version__}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `repeats` calls of fn, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def make_timer(cuda: bool, repeats: int) -> Callable[[Callable[[], object]], float]:
    """A function giving the median seconds of fn(): triton's do_bench on CUDA, wall clock on CPU."""
    if cuda:
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=5, rep=max(20, repeats * 5),
                                                  return_mode="median") / 1e3
    return lambda fn: median_seconds(fn, repeats)


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def progress(iterable, *, total: int | None = None, desc: str = ""):
    """A tqdm bar over `iterable` when tqdm is importable (it comes with vLLM), else one plain line
    per item: long runs must show they are alive without making tqdm a dependency."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        yield from tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)
        return
    total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
    for i, item in enumerate(iterable, 1):
        print(f"  {desc} {i}/{total if total is not None else '?'}", flush=True)
        yield item


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): no numpy needed, and p99 of a few samples is the max."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, -(-len(s) * q // 100) - 1))
    return s[int(k)]




def plot_bars(path: Path, title: str, groups: dict[str, dict[str, float]], ylabel: str, log: bool = False) -> Path:
    """Grouped bars: groups = {x label: {series name: value}} (series absent from a group are skipped);
    `log`: a logarithmic y axis (values that differ by orders of magnitude)."""
    plt = pyplot()
    series = list(dict.fromkeys(s for g in groups.values() for s in g))
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(min(14.0, max(6.0, 0.4 * len(groups) * max(1, len(series)))), 4.5))
    for i, s in enumerate(series):
        xs = [j + i * width for j, g in enumerate(groups.values()) if s in g]
        ys = [g[s] for g in groups.values() if s in g]
        ax.bar(xs, ys, width, label=s)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(groups))], list(groups), fontsize=8)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.set_title(f"{title}\n{context()['device']}", fontsize=9)
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

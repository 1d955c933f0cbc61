"""What every bench result row carries: device, commit, time; and where rows are written."""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

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


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path

"""The Grafana dashboard's main panels, drawn from a real Prometheus over a benchmark run.

    python -m bench.dashboard [--out docs/dashboard.png] [bench.e2e args, e.g. --users 4 --rounds 4]

Starts Debian's `prometheus` (scraping every second) and `python -m bench.e2e --configs
lmcache_triton` with the connector's metrics on a free port (`LMCACHE_PROMETHEUS_PORT`), then asks
Prometheus for each main panel of examples/grafana/lmcache_triton.json with a `query_range` over
the run (the panels' own PromQL, `$__rate_interval` read as --rate-window) and draws them with
matplotlib into one PNG. `Prometheus` here is also what tests/e2e/test_prometheus_e2e.py
starts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "examples" / "grafana" / "lmcache_triton.json"
# The panels drawn, by title, in reading order (two per row).
MAIN_PANELS = (
    "Hit ratio: lookup vs retrieve",
    "Lookups: requests and entire misses",
    "Prompt tokens: hits and misses by reason",
    "Tokens loaded and stored",
    "Store / retrieve throughput (while busy)",
    "Latency p50 / p99",
    "Tier usage and capacity",
    "Held chunks and expired leases",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A real Prometheus server on 127.0.0.1:`port` scraping `targets` (host:port, /metrics) every
    `interval`, with its data under `workdir`. A context manager: the server is killed on exit."""

    def __init__(self, targets: list[str], workdir: Path, *, port: int | None = None, interval: str = "1s",
                 binary: str | None = None, job: str = "lmcache_triton") -> None:
        self.binary = binary or shutil.which("prometheus")
        if self.binary is None:
            raise FileNotFoundError("no `prometheus` binary: apt-get install prometheus (Debian/Ubuntu)")
        self.targets, self.workdir, self.interval, self.job = targets, Path(workdir), interval, job
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(
            f"global:\n  scrape_interval: {self.interval}\n  scrape_timeout: {self.interval}\n"
            f"  evaluation_interval: {self.interval}\n"
            f"scrape_configs:\n  - job_name: {self.job}\n    static_configs:\n"
            f"      - targets: {json.dumps(self.targets)}\n")
        self.log = self.workdir / "prometheus.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"prometheus not ready in 30 s: {self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def api(self, path: str, **params) -> dict:
        """GET /api/v1/`path` with `params`; the `data` of a successful answer."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:  # a PromQL error: say which query and why
            raise ValueError(f"{params}: {e.read().decode()[:500]}") from e
        if body.get("status") != "success":
            raise ValueError(f"{params}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query (at `at`, a Unix time, or now): [{"metric": {...}, "value": [t, "v"]}]."""
        return self.api("query", query=expr, **({} if at is None else {"time": at}))["result"]

    def value(self, expr: str, at: float | None = None) -> float:
        """The one value of an instant query that yields one series."""
        result = self.query(expr, at)
        if len(result) != 1:
            raise AssertionError(f"{expr}: expected one series at {at}, got {result}")
        return float(result[0]["value"][1])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """[{"metric": {...}, "values": [[t, "v"], ...]}]."""
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def sample_times(self, metric: str, window: str = "1h") -> list[float]:
        """When `metric` was scraped (every series, as stored): the span a run's data covers."""
        data = self.api("query", query=f"{metric}[{window}]")["result"]
        return sorted({float(t) for series in data for t, _ in series["values"]})

    def wait_scraped(self, timeout: float = 30.0) -> None:
        """Until every target has been scraped successfully once."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            up = self.query(f'up{{job="{self.job}"}}')
            if len(up) == len(self.targets) and all(s["value"][1] == "1" for s in up):
                return
            time.sleep(0.5)
        raise TimeoutError(f"{self.targets} not scraped in {timeout} s")


# ---------------------------------------------------------------- the picture

def panel_queries(dashboard: dict, titles: tuple[str, ...], rate_window: str) -> list[tuple[dict, list]]:
    """The dashboard's panels named `titles` with their targets' PromQL made concrete: every
    model and rank, `$__rate_interval` = `rate_window`."""
    panels = {p["title"]: p for p in dashboard["panels"] if p.get("type") == "timeseries"}
    out = []
    for title in titles:
        panel = panels[title]
        targets = [(t["expr"].replace("$__rate_interval", rate_window).replace("$model", ".*")
                    .replace("$rank", ".*"), t.get("legendFormat", "")) for t in panel["targets"]]
        out.append((panel, targets))
    return out


def _legend(fmt: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or json.dumps(labels)


_UNITS = {"percentunit": (1, "ratio"), "reqps": (1, "requests/s"), "Bps": (1e9, "GB/s"), "s": (1e-3, "ms"),
          "bytes": (2**20, "MiB"), "short": (1, "")}


def draw(prom: Prometheus, start: float, end: float, out: Path, rate_window: str = "5s",
         title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = json.loads(DASHBOARD.read_text())
    panels = panel_queries(dashboard, MAIN_PANELS, rate_window)
    rows = -(-len(panels) // 2)
    fig, axes = plt.subplots(rows, 2, figsize=(13, 3.0 * rows), sharex=True)
    for ax, (panel, targets) in zip(axes.flat, panels):
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        scale, label = _UNITS.get(unit, (1, unit))
        for expr, fmt in targets:
            for series in prom.query_range(expr, start, end, 1):
                t = [float(ts) - start for ts, _ in series["values"]]
                v = [float(x) / scale for _, x in series["values"]]
                ax.plot(t, v, label=_legend(fmt, series["metric"]), linewidth=1.4,
                        linestyle="--" if "capacity" in fmt else "-")
        ax.set_title(panel["title"], fontsize=10)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    for ax in axes[-1]:
        ax.set_xlabel("seconds into the run", fontsize=8)
    fig.suptitle(title or "lmcache_triton Grafana dashboard (examples/grafana/lmcache_triton.json), "
                 "drawn from Prometheus query_range", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    p.add_argument("--rate-window", default="5s", help="what $__rate_interval stands for (scrapes are 1 s apart)")
    p.add_argument("--keep", type=Path, help="keep Prometheus' data and logs in this folder")
    args, e2e_args = p.parse_known_args(argv)
    metrics_port = free_port()
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="lmct-dashboard-"))
    env = {**os.environ, "LMCACHE_PROMETHEUS_PORT": str(metrics_port)}
    load = [os.getloadavg()[0]]
    with Prometheus([f"127.0.0.1:{metrics_port}"], workdir / "prometheus") as prom:
        print(f"prometheus on {prom.url}, scraping 127.0.0.1:{metrics_port} every second", flush=True)
        run = subprocess.run([sys.executable, "-m", "bench.e2e", "--configs", "lmcache_triton", *e2e_args],
                             cwd=ROOT, env=env)
        if run.returncode != 0:
            raise SystemExit(f"the benchmark run failed (exit {run.returncode})")
        load.append(os.getloadavg()[0])
        times = prom.sample_times("lmcache_triton_lookup_requests_total")
        if not times:
            raise SystemExit("prometheus scraped no lmcache_triton metrics")
        start, end = times[0], times[-1]
        out = draw(prom, start, end, args.out,
                   rate_window=args.rate_window,
                   title=f"lmcache_triton dashboard over `bench.e2e --configs lmcache_triton` ({end - start:.0f} s, "
                         f"scraped every 1 s by Prometheus; host load {load[0]:.1f} -> {load[1]:.1f} on "
                         f"{os.cpu_count()} cores)")
    if args.keep is None:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()

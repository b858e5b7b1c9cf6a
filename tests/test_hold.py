"""Runs that let their rows go (`vd.loop.Hold`): a recording summarises them and a replay measures them a
block at a time, so memory stays flat in steps; what either stores or reports must not depend on where
the blocks fall."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import vd.loop
from vd.loop import DrafterFeed, Hold, run_verify
from vd.models import load_model
from vd.replayer import ReplaySettings, replay

PLUGINS = Path(__file__).parent / "plugins"  # (not imported from conftest: tests/workflow has one too)


def test_a_held_run_lets_whole_steps_go_and_loses_no_row():
    m = load_model("tiny-llama-mtp", device="cpu", dtype="float32")
    prompt = m.encode("rows that leave the run")
    whole = run_verify(m, prompt, 3, 7, DrafterFeed(3, 7))
    blocks: list[tuple[str, int, torch.Tensor]] = []
    row_bytes = m.vocab_size * 4
    held = run_verify(m, prompt, 3, 7, DrafterFeed(3, 7),
                      hold=Hold(5 * row_bytes, lambda kind, start, rows: blocks.append((kind, start, rows.clone()))))
    assert held.layout == whole.layout and held.steps == whole.steps
    assert len(blocks) >= 3 and held.held_bytes() <= 5 * row_bytes + 3 * row_bytes + 2 * row_bytes
    blocks += held.held()
    for kind, rows in whole.rows_by_kind().items():
        mine = [(start, t) for k, start, t in blocks if k == kind]
        assert [s for s, _ in mine] == list(np.cumsum([0] + [t.shape[0] for _, t in mine])[:-1])
        assert torch.equal(torch.cat([t for _, t in mine]), rows), kind
        if kind == "verify":  # whole steps
            assert all(t.shape[0] % 3 == 0 for _, t in mine)
    with pytest.raises(AssertionError, match="let rows go"):
        held.rows_by_kind()


@pytest.mark.parametrize("limit_rows", [5, 1 << 20])
def test_each_row_is_handed_on_once_as_its_step_is_logged_and_stays_held(limit_rows):
    """A hold's ``each`` (a recording's writer processes) gets every row once, in order, as the run logs its
    step, whether or not the run lets rows go meanwhile; the rows it gets are still the run's to let go."""
    m = load_model("tiny-llama-mtp", device="cpu", dtype="float32")
    prompt = m.encode("rows handed on")
    whole = run_verify(m, prompt, 3, 7, DrafterFeed(3, 7)).rows_by_kind()
    handed: list[tuple[str, int, torch.Tensor]] = []
    settled: list[tuple[str, int, torch.Tensor]] = []
    steps: list[int] = []
    held = run_verify(m, prompt, 3, 7, DrafterFeed(3, 7), on_step=steps.append,
                      hold=Hold(limit_rows * m.vocab_size * 4, lambda *a: settled.append((*a[:2], a[2].clone())),
                                each=lambda *a: handed.append((*a[:2], a[2].clone(), len(steps)))))
    assert any(s == 0 for *_, s in handed) and handed[-1][-1] == 6  # step 0's rows before step 0 ticked
    for rows_of in (handed, settled + held.held()):
        for kind, rows in whole.items():
            mine = sorted([(start, t) for k, start, t, *_ in rows_of if k == kind], key=lambda x: x[0])
            assert [s for s, _ in mine] == list(np.cumsum([0] + [t.shape[0] for _, t in mine])[:-1])
            assert torch.equal(torch.cat([t for _, t in mine]), rows), kind
    assert bool(settled) == (limit_rows == 5)


def _arrays(path) -> dict[str, np.ndarray]:
    root = zarr.open_group(str(path), mode="r")
    out = {}
    for k in ("k2", "k3", "k4"):
        for name, a in root[k].arrays():
            out[f"{k}/{name}"] = a[...]
    return out


@pytest.mark.parametrize("feed", ["reference", "mtp"])
def test_recording_with_a_small_hold_stores_what_a_whole_run_stores(cli, tmp_path, monkeypatch, feed):
    model = "tiny-llama-mtp" if feed == "mtp" else "tiny-llama"
    args = ["--model", model, "--steps", "6", "--feed", feed, "--allow-thin"]
    assert cli("record", tmp_path / "whole.zarr", *args)[0] == 0
    monkeypatch.setattr(vd.loop, "CPU_HOLD_BYTES", 1)
    assert cli("record", tmp_path / "held.zarr", *args)[0] == 0
    whole, held = _arrays(tmp_path / "whole.zarr"), _arrays(tmp_path / "held.zarr")
    assert whole.keys() == held.keys() and any(n.endswith("digests") for n in whole)
    for name in whole:
        if not name.endswith("step_ms"):
            assert np.array_equal(whole[name], held[name], equal_nan=True), name


def test_replay_with_a_small_hold_reports_what_a_whole_run_reports(tiny_golden, tmp_path, monkeypatch):
    monkeypatch.setenv("VD_PERTURB_STEP", "5")
    settings = ReplaySettings(model=f"{PLUGINS / 'perturb.py'}:factory")
    whole = replay(tiny_golden, settings)
    monkeypatch.setattr(vd.loop, "CPU_HOLD_BYTES", 1)
    held = replay(tiny_golden, settings)
    assert whole.verdict == held.verdict == "FAIL"
    for a, b in zip(whole.verify, held.verify):
        ca, cb = a.comparisons[0].comparison.to_json(), b.comparisons[0].comparison.to_json()
        assert ca == cb and ca["mismatched_step_list"] == [5]
        assert a.control.fired and b.control.fired
    fa, fb = whole.failure_rows, held.failure_rows
    assert fb is not None and (fa.k, fa.kind, fa.step) == (fb.k, fb.kind, fb.step) == (2, "verify", 5)
    assert np.array_equal(fa.candidate, fb.candidate) and np.array_equal(fa.golden, fb.golden)
    assert replay(tiny_golden).verdict == "PASS"


def test_rows_held_when_the_last_step_is_issued_are_left_to_on_last():
    """A comparison (or a summary) queued behind the last step takes every row still held then: the run lets
    none of them go after it, so no row is handled twice."""
    m = load_model("tiny-llama", device="cpu", dtype="float32")
    prompt = m.encode("the last step")
    whole = run_verify(m, prompt, 2, 6, _greedy_feed(m, prompt, 2, 6))
    settled, at_last = [], []
    held = run_verify(m, prompt, 2, 6, _greedy_feed(m, prompt, 2, 6),
                      hold=Hold(1, lambda kind, start, rows: settled.append((kind, start, rows.clone()))),
                      on_last=lambda run, last: at_last.extend(run.held(last)))
    assert held.hold is None and settled and at_last
    for kind, rows in whole.rows_by_kind().items():
        mine = [(s, t) for k, s, t in settled + at_last if k == kind]
        assert torch.equal(torch.cat([t for _, t in sorted(mine, key=lambda x: x[0])]), rows), kind


def _greedy_feed(m, prompt, k, steps):
    from vd.loop import ReferenceFeed, continuation

    return ReferenceFeed(continuation(m, prompt, steps * k + 1))

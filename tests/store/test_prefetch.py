"""The prefetcher: a golden's small arrays read and its files hashed in units, on a thread (while a model
loads), before a replay's first run (`ready`) or when a K is judged, giving what reading in line gives; an
error kept for its own K. Driven here on the CPU (``ahead=True``); the GPU tests drive it before real runs."""

import time

import numpy as np
import pytest
import torch
from golden_edit import chunk, edit_meta, flip_byte

from vd.errors import GoldenCorruptError
from vd.store import Prefetcher, open_golden

CPU = torch.device("cpu")


def _same_side(a, b) -> None:
    assert a.log.same_steps(b.log) and np.array_equal(a.digests, b.digests) and a.layout == b.layout
    for kind in a.counts:
        assert all(np.array_equal(a.stats(kind)[n], b.stats(kind)[n]) for n in a.stats(kind))


def test_ready_runs_every_unit_and_gives_what_reading_in_line_does(tiny_golden):
    p = Prefetcher(open_golden(tiny_golden), CPU, ahead=True, files=True)
    hashes = len(open_golden(tiny_golden).manifest) + 1  # a unit a file, and the files' listing first
    # 7 units per group (3 K's and decode), the listing first; the listing's unit queues the hashes after them
    assert len(p.units) == 4 * 7 + 1 and p.units[0].kind == "sizes"
    p._run(p.units[0], "drain")
    assert [u.kind for u in p.units][4 * 7:] == ["hash"] * (hashes - 1)
    p.ready()  # as a replay does before its first run
    assert not p.units and p.summary()["drain"]["units"] == len(p.timeline) == 4 * 7 + hashes
    p.check_files()
    inline = open_golden(tiny_golden)
    for k in inline.groups:
        _same_side(p.side(k), inline.side(k))
    assert len(p.timeline) == 4 * 7 + hashes  # nothing more was read for the sides


def test_a_thread_reads_ahead_until_stopped(tiny_golden):
    p = Prefetcher(open_golden(tiny_golden), CPU, ahead=True)
    p.start_thread()
    deadline = time.monotonic() + 30
    while p.units and time.monotonic() < deadline:
        time.sleep(0.01)
    p.pause()
    assert not p.units and {who for who, _, _ in p.timeline} == {"thread"}
    assert p.side(3).k == 3 and not [t for t in p.timeline if t[0] == "drain"]


def test_what_is_left_runs_when_a_k_is_judged(tiny_golden):
    p = Prefetcher(open_golden(tiny_golden), CPU, ahead=True)
    side = p.side(4)
    assert side.k == 4 and {who for who, _, _ in p.timeline} == {"drain"}
    assert all(u.k != 4 for u in p.units) and any(u.k == 2 for u in p.units)  # only K=4's were run


def test_an_error_is_kept_for_its_own_k(tiny_copy):
    flip_byte(tiny_copy / "k3" / "digests" / "c" / "0" / "0")
    p = Prefetcher(open_golden(tiny_copy), CPU, ahead=True)
    p.ready()
    with pytest.raises(GoldenCorruptError, match="k3/digests: chunk c/0/0 fails its CRC32C checksum"):
        p.side(3)
    assert p.side(2).k == 2 and p.side(4).k == 4


def test_nothing_is_read_ahead_on_the_cpu_or_for_a_golden_without_digests(tiny_golden, rows_golden):
    assert not Prefetcher(open_golden(tiny_golden), CPU).units
    p = Prefetcher(open_golden(rows_golden), CPU, ahead=True)
    assert not p.units
    _same_side(p.side(2), open_golden(tiny_golden).side(2))  # its digests computed from its rows


def test_rows_are_not_read_ahead_but_when_a_comparison_asks(tiny_copy):
    chunk(tiny_copy, 2, "logits", 0).unlink()
    edit_meta(tiny_copy, lambda m: None)  # as if written without it: the manifest would refuse it at open
    p = Prefetcher(open_golden(tiny_copy), CPU, ahead=True)
    p.ready()
    assert p.side(2).k == 2
    with pytest.raises(GoldenCorruptError, match="k2/logits.hi: chunk c/0/0/0 is missing"):
        p.side(2).host_rows("verify", np.array([0]))


@pytest.mark.parametrize("damaged", [False, True])
def test_files_are_hashed_by_the_thread_and_a_damaged_one_raises_at_check_files(tiny_copy, damaged):
    """Every file of the manifest is a unit of its own, queued by the listing's unit and run by the thread after
    the K's units; `check_files` runs what is left and raises the first damaged file found, naming it."""
    golden = open_golden(tiny_copy)
    big = max(golden.manifest, key=lambda key: golden.manifest[key][0])
    if damaged:
        flip_byte(tiny_copy / big)
    p = Prefetcher(open_golden(tiny_copy), CPU, files=True)  # the CPU: files only, the K's read when asked
    assert [u.kind for u in p.units] == ["sizes"]  # its hash units are queued by the listing's own unit
    p.start_thread()
    deadline = time.monotonic() + 30
    while p.units and time.monotonic() < deadline:
        time.sleep(0.01)
    if damaged:
        with pytest.raises(GoldenCorruptError, match=f"{big} does not match the golden's manifest"):
            p.check_files()
    else:
        p.check_files()
        assert p.summary()["thread"]["units"] == len(golden.manifest) + 1 and not p.units

"""The prefetcher: a golden's small arrays read in units, in the time a run hands over, on a thread, or when
a K is judged, giving what reading in line gives; an error kept for its own K. Driven here on the CPU
(``ahead=True``); the GPU tests drive it beside real runs."""

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


def test_units_run_in_the_idle_time_handed_over_and_give_what_reading_in_line_does(tiny_golden):
    p = Prefetcher(open_golden(tiny_golden), CPU, ahead=True)
    assert p.units and p.idle(0.0) is True and not p.timeline  # no time, no unit; units left
    while p.idle(30.0):  # as a run's steps would, until nothing is left
        pass
    assert not p.units and {who for who, _, _ in p.timeline} == {"idle"}
    # 7 units per group: three K's and the decode group
    assert p.idle(30.0) is False and p.summary()["idle"]["units"] == len(p.timeline) == 4 * 7
    inline = open_golden(tiny_golden)
    for k in inline.groups:
        _same_side(p.side(k), inline.side(k))


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
    while p.idle(30.0):
        pass
    with pytest.raises(GoldenCorruptError, match="k3/digests: chunk c/0/0 fails its CRC32C checksum"):
        p.side(3)
    assert p.side(2).k == 2 and p.side(4).k == 4


def test_nothing_is_read_ahead_on_the_cpu_or_for_a_golden_without_digests(tiny_golden, rows_golden):
    assert not Prefetcher(open_golden(tiny_golden), CPU).units
    p = Prefetcher(open_golden(rows_golden), CPU, ahead=True)
    assert not p.units and p.idle(30.0) is False
    _same_side(p.side(2), open_golden(tiny_golden).side(2))  # its digests computed from its rows


def test_rows_are_not_read_ahead_but_when_a_comparison_asks(tiny_copy):
    chunk(tiny_copy, 2, "logits", 0).unlink()
    edit_meta(tiny_copy, lambda m: None)  # as if written without it: the manifest would refuse it at open
    p = Prefetcher(open_golden(tiny_copy), CPU, ahead=True)
    while p.idle(30.0):
        pass
    assert p.side(2).k == 2
    with pytest.raises(GoldenCorruptError, match="k2/logits.hi: chunk c/0/0/0 is missing"):
        p.side(2).host_rows("verify", np.array([0]))


def test_a_files_hash_is_expected_to_take_time_in_proportion_to_its_size(tiny_golden, monkeypatch):
    """A file's hash unit is run in a run's idle time only when its size fits (a 40 MB file must not delay
    the steps of a 1 ms verify); the rest are hashed when the files are checked."""
    import vd.store.prefetch as prefetch

    class Slow(dict):  # hashing at 1 MB a second, whatever the units measure
        def __setitem__(self, key, value):
            if key != "hash/byte":
                super().__setitem__(key, value)

    monkeypatch.setattr(prefetch, "_EXPECT", Slow({"hash/byte": 1e-6}))
    p = Prefetcher(open_golden(tiny_golden), CPU, ahead=True, files=True)
    hashes = [u for u in p.units if u.kind == "hash"]
    cut = sorted(u.nbytes for u in hashes)[len(hashes) // 2]  # half the files fit the windows below
    for _ in range(500):
        p.idle(prefetch.UNIT_S + 1e-6 * (cut + 100))  # windows that fit the smaller files' hashes
    left = [u for u in p.units if u.kind == "hash"]
    ran = [u for u in hashes if u not in left]
    assert ran and all(u.nbytes <= cut + 100 for u in ran)  # no larger file was started in a window ...
    assert left and left[0].nbytes > cut + 100  # ... the first of them waits, and the units behind it
    p.check_files()  # the rest, now
    assert not [u for u in p.units if u.kind == "hash"]


@pytest.mark.parametrize("damaged", [False, True])
def test_large_files_are_hashed_on_a_thread_of_their_own(tiny_copy, monkeypatch, damaged):
    """Files of `BIG_FILE` bytes or more are checked by a thread (reading and hashing let go of the
    interpreter lock) while the small ones wait for idle time; `check_files` waits for it and raises what it
    found."""
    import vd.store.prefetch as prefetch

    golden = open_golden(tiny_copy)
    sizes = sorted(size for size, _ in golden.manifest.values())
    monkeypatch.setattr(prefetch, "BIG_FILE", sizes[len(sizes) // 2])
    big = max(golden.manifest, key=lambda key: golden.manifest[key][0])
    if damaged:
        flip_byte(tiny_copy / big)
    p = Prefetcher(open_golden(tiny_copy), CPU, ahead=True, files=True)
    small = [u for u in p.units if u.kind == "hash"]
    assert small and all(u.nbytes < prefetch.BIG_FILE for u in small)
    if damaged:
        with pytest.raises(GoldenCorruptError, match=f"{big} does not match the golden's manifest"):
            p.check_files()
    else:
        p.check_files()
        hashed = [t for t in p.timeline if t[0] == "hasher"]
        assert len(hashed) == sum(size >= prefetch.BIG_FILE for size, _ in golden.manifest.values())
        assert p.summary()["hasher"]["units"] == len(hashed)

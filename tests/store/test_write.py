"""Writing a golden: what lands on disk, plain zarr's view of it, and publishing that never loses a golden."""

import numpy as np
import pytest
import zarr
from store_data import PROMPT, V, k_data, meta, write, write_as_run

from vd.dtypes import to_storage
from vd.errors import GoldenError, GoldenExistsError
from vd.store import FORMAT_VERSION, GoldenWriter, open_golden
from vd.store import format as F
from vd.store.local import finish_removals


def test_round_trip_and_plain_zarr(tmp_path):
    path = tmp_path / "g.zarr"
    rows = write(path, ks=(2, 3))
    g = open_golden(path)
    assert g.prompt == PROMPT and g.ks == [2, 3] and g.meta["format_version"] == FORMAT_VERSION == 7
    assert g.meta["complete"] is True and g.meta["rows"] == {"stored": True}
    for k in (2, 3):
        got = g.verify_rows(k)
        assert all(np.array_equal(got[kind], rows[k][kind]) for kind in rows[k])
        log = g.checked_log(k)
        assert log.bootstrap == 5 and log.committed_is_greedy is True and log.same_steps(k_data(k)[1])
    # Plain zarr, without vd, opens every array; a value's bytes are its low plane then its high plane.
    root = zarr.open_group(path, mode="r")
    hi, lo = root["k2/logits.hi"], root["k2/logits.lo"]
    assert (hi.dtype, hi.shape, lo.shape) == (np.uint8, (3, 2, V), (3, 2, V, 1))
    assert [c.to_dict()["name"] for c in hi.metadata.codecs] == ["bytes", "zstd", "crc32c"]
    assert [c.to_dict()["name"] for c in lo.metadata.codecs] == ["bytes", "crc32c"]
    bits = (hi[...].astype(np.uint16) << 8) | lo[..., 0]
    assert np.array_equal(bits.reshape(-1, V), rows[2]["verify"])
    assert list(root["prompt"][:]) == PROMPT
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary files left behind"


@pytest.mark.parametrize("hold", [1, 1 << 30])
def test_rows_written_as_a_run_lets_them_go_store_what_a_whole_k_does(tmp_path, monkeypatch, hold):
    """`KRows` (rows written in parts as a run's hold lets them go, as the recorder does; slices of one chunk
    with the smallest ``SLICE_BYTES``) and `GoldenWriter.add` (a whole K) store the same golden, drafter
    rows included."""
    import vd.store.write as W

    monkeypatch.setattr(W, "SLICE_BYTES", hold)
    layout, log, rows = k_data(3, steps=3, drafted=True)
    with GoldenWriter(tmp_path / "s.zarr", background=True) as w:
        tensors = write_as_run(w)
        w.publish(meta((3,), feed="mtp"), PROMPT)
    with GoldenWriter(tmp_path / "w.zarr", background=False) as w:
        w.add(layout, log, rows, drafts=np.zeros((3, 2), np.int32))
        w.publish(meta((3,), feed="mtp"), PROMPT)
    a, b = open_golden(tmp_path / "s.zarr"), open_golden(tmp_path / "w.zarr")
    assert set(a.verify_rows(3)) == set(tensors) == {"prefill", "verify", "draft"}
    assert all(np.array_equal(a.verify_rows(3)[kind], to_storage(t)) for kind, t in tensors.items())
    assert all(np.array_equal(a.verify_rows(3)[kind], b.verify_rows(3)[kind]) for kind in tensors)
    assert a.meta["manifest"] == b.meta["manifest"]  # the same files, byte for byte


@pytest.mark.parametrize("pool", [False, True])
def test_a_prompt_written_ahead_is_the_one_published(tmp_path, pool):
    """`GoldenWriter.write_prompt` writes the prompt as later work (with writer processes, in a run's hand-overs;
    without, at once); the golden holds it, and a publish naming another prompt is refused, nothing placed."""
    from vd.store.processes import WriterPool

    procs = WriterPool(1) if pool else None
    try:
        with GoldenWriter(tmp_path / "g.zarr", pool=procs) as w:
            w.write_prompt(PROMPT)
            assert bool(w._later) == pool  # queued for a run's hand-overs only with processes
            write_as_run(w, hand=pool)
            w.publish(meta((3,), feed="mtp"), PROMPT)
        assert open_golden(tmp_path / "g.zarr").prompt == PROMPT
        with GoldenWriter(tmp_path / "h.zarr", pool=procs) as w:
            w.write_prompt(PROMPT)
            write_as_run(w)
            with pytest.raises(ValueError, match="not the one written ahead"):
                w.publish(meta((3,), feed="mtp"), [*PROMPT, 1])
        assert not (tmp_path / "h.zarr").exists()
    finally:
        if procs is not None:
            procs.close()


def test_refuses_overwrite_and_refresh_replaces(tmp_path):
    path = tmp_path / "g.zarr"
    first = write(path, seed=1)
    with pytest.raises(GoldenExistsError, match="--refresh"):
        write(path, seed=2)
    assert np.array_equal(open_golden(path).verify_rows(2)["verify"], first[2]["verify"])
    second = write(path, seed=2, refresh=True)
    assert np.array_equal(open_golden(path).verify_rows(2)["verify"], second[2]["verify"])
    finish_removals()  # the replaced version is removed beside the caller
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.zarr"]


@pytest.mark.parametrize("name", ["notes", "notes.zip"])
def test_refresh_never_replaces_what_is_not_a_golden(tmp_path, name):
    precious = tmp_path / name
    if name.endswith(".zip"):
        precious.write_text("not a zip")
    else:
        precious.mkdir()
        (precious / "keep.txt").write_text("mine")
    with pytest.raises(GoldenError, match="not a vd golden"):
        write(precious, refresh=True)
    if name.endswith(".zip"):
        assert precious.read_text() == "not a zip"
    else:
        assert (precious / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("background", [False, True])
def test_a_failed_write_leaves_the_old_golden(tmp_path, background):
    path = tmp_path / "g.zarr"
    old = write(path, seed=1)
    layout, log, rows = k_data(2, seed=2)
    rows["verify"] = rows["verify"][:-1]  # one row short: the write fails midway
    with pytest.raises(ValueError):
        with GoldenWriter(path, refresh=True, background=background) as w:
            w.add(layout, log, rows)
            w.publish(meta(), PROMPT)
    assert np.array_equal(open_golden(path).verify_rows(2)["verify"], old[2]["verify"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.zarr"]


def test_row_arrays_are_chunked_one_step_a_chunk(tmp_path):
    write(tmp_path / "g.zarr", ks=(3,), drafted=True)
    root = zarr.open_group(tmp_path / "g.zarr", mode="r")
    assert root["k3/logits.hi"].chunks == (1, 3, V) and root["k3/draft_logits.hi"].chunks == (1, 2, V)
    assert root["k3/prefill.hi"].chunks == (F.prefill_chunks(len(PROMPT), V, 2), V)
    assert root["k3/drafts"][...].shape == (3, 2)


@pytest.mark.parametrize("shape, dtype, chunks, compressor", [
    ((16, 2, 49152), "u1", (1, 2, 49152), "zstd"), ((16, 2, 49152, 1), "u1", (1, 2, 49152, 1), None),
    ((3,), "<i4", (3,), None), ((0, 4), "<f8", (1, 4), None), ((7, 2), "<i8", (7, 2), None)])
def test_array_documents_are_the_ones_zarr_writes(shape, dtype, chunks, compressor):
    """`vd.store.nodes.array` fills a document dumped once per kind: the bytes are those of zarr's own document
    for that array, written as zarr writes it."""
    import json

    from vd.store import nodes

    held: dict = {}
    root = zarr.create_group(zarr.storage.MemoryStore(held), zarr_format=3)
    root.create_array("a", shape=shape, dtype=dtype, chunks=chunks, compressors=nodes.CODECS[compressor](),
                      fill_value=0)
    theirs = json.loads(held["a/zarr.json"].to_bytes())
    assert nodes.array(shape, dtype, chunks, compressor) == json.dumps(theirs, indent=2).encode()

"""The zarr golden store: round trip, plain-zarr readability, integrity checks and safe publishing."""

import json
from pathlib import Path

import numpy as np
import pytest
import zarr

from vd.errors import (
    GoldenCorruptError,
    GoldenError,
    GoldenExistsError,
    GoldenNotFoundError,
    NotAGoldenError,
)
from vd.golden import FORMAT_VERSION, KRecord, open_golden, to_float, to_storage, write_golden

DATA = Path(__file__).parent / "data"


def _record(k=2, s=3, v=8, p=4, seed=0) -> KRecord:
    rng = np.random.default_rng(seed)
    return KRecord(
        k=k, bootstrap=5, tokens=rng.integers(0, v, (s, k)).astype(np.int32),
        accepted=np.array([k - 1, 0, 1][:s], dtype=np.int32),
        prefill=rng.integers(0, 2**16, (p, v)).astype(np.uint16),
        logits=rng.integers(0, 2**16, (s, k, v)).astype(np.uint16),
        step_ms=rng.random(s), committed_is_greedy=True,
    )


def _meta(ks=(2,), s=3, v=8):
    return {"model": {"spec": "x", "name": "x", "fingerprint": "sha256:0"}, "forward": "eager", "dtype": "bfloat16",
            "device": "cpu", "k": list(ks), "steps": s, "vocab_size": v,
            "logits": {"dtype": "bfloat16", "encoding": "uint16 bits"}}


def test_round_trip_and_plain_zarr(tmp_path):
    rec = _record()
    write_golden(tmp_path / "g.zarr", _meta(), [1, 2, 3, 4], [rec])
    g = open_golden(tmp_path / "g.zarr")
    r = g.runs[2]
    assert g.prompt == [1, 2, 3, 4] and r.bootstrap == 5 and r.committed_is_greedy is True
    for name in ("tokens", "accepted", "prefill", "logits", "step_ms"):
        np.testing.assert_array_equal(getattr(r, name), getattr(rec, name))
    assert g.meta["format_version"] == FORMAT_VERSION and g.meta["complete"] is True
    # Plain zarr, without vd, opens every array.
    root = zarr.open_group(tmp_path / "g.zarr", mode="r")
    assert root["k2/logits"].dtype == np.uint16 and root["k2/logits"].shape == (3, 2, 8)
    np.testing.assert_array_equal(root["k2/logits"][:], rec.logits)
    assert list(root["prompt"][:]) == [1, 2, 3, 4]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_bf16_storage_is_bit_exact():
    import torch

    t = torch.tensor([[1.5, -0.0, float("inf"), 3.140625]], dtype=torch.bfloat16)
    bits = to_storage(t)
    assert bits.dtype == np.uint16 and bits.tolist() == [t.view(torch.int16).numpy().view(np.uint16).tolist()[0]]
    np.testing.assert_array_equal(to_float(bits, "bfloat16"), t.float().numpy())


def test_refuses_overwrite_and_refresh_replaces(tmp_path):
    path = tmp_path / "g.zarr"
    write_golden(path, _meta(), [1, 2, 3, 4], [_record(seed=1)])
    with pytest.raises(GoldenExistsError):
        write_golden(path, _meta(), [1, 2, 3, 4], [_record(seed=2)])
    np.testing.assert_array_equal(open_golden(path).runs[2].logits, _record(seed=1).logits)
    write_golden(path, _meta(), [1, 2, 3, 4], [_record(seed=2)], refresh=True)
    np.testing.assert_array_equal(open_golden(path).runs[2].logits, _record(seed=2).logits)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.zarr"]


def test_refresh_never_replaces_a_non_golden(tmp_path):
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "keep.txt").write_text("mine")
    with pytest.raises(GoldenError, match="not a vd golden"):
        write_golden(precious, _meta(), [1, 2, 3, 4], [_record()], refresh=True)
    assert (precious / "keep.txt").read_text() == "mine"


def test_failed_write_leaves_old_golden(tmp_path):
    path = tmp_path / "g.zarr"
    write_golden(path, _meta(), [1, 2, 3, 4], [_record(seed=1)])
    bad = _record(seed=2)
    object.__setattr__(bad, "logits", "not an array")  # make the write fail midway
    with pytest.raises(Exception):  # noqa: B017 - any failure must leave the old golden
        write_golden(path, _meta(), [1, 2, 3, 4], [bad], refresh=True)
    np.testing.assert_array_equal(open_golden(path).runs[2].logits, _record(seed=1).logits)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.zarr"]


def _chunk(path: Path) -> Path:
    return path / "k2" / "logits" / "c" / "1" / "0" / "0"


@pytest.fixture
def golden(tmp_path) -> Path:
    path = tmp_path / "g.zarr"
    write_golden(path, _meta(), [1, 2, 3, 4], [_record()])
    return path


def test_flipped_byte_is_corrupt(golden):
    data = bytearray(_chunk(golden).read_bytes())
    data[len(data) // 2] ^= 0x40
    _chunk(golden).write_bytes(bytes(data))
    with pytest.raises(GoldenCorruptError, match="checksum"):
        open_golden(golden)


def test_truncated_chunk_is_corrupt(golden):
    _chunk(golden).write_bytes(_chunk(golden).read_bytes()[:6])
    with pytest.raises(GoldenCorruptError, match="k2/logits"):
        open_golden(golden)


def test_missing_chunk_is_refused_not_zeros(golden):
    _chunk(golden).unlink()
    with pytest.raises(GoldenCorruptError, match="1 of 3 chunks are missing"):
        open_golden(golden)


def test_missing_array_is_corrupt(golden):
    import shutil

    shutil.rmtree(golden / "k2" / "tokens")
    with pytest.raises(GoldenCorruptError, match="tokens"):
        open_golden(golden)


def test_incomplete_and_future_goldens(golden):
    meta_file = golden / "zarr.json"
    doc = json.loads(meta_file.read_text())
    doc["attributes"]["vd"]["complete"] = False
    meta_file.write_text(json.dumps(doc))
    with pytest.raises(GoldenCorruptError, match="incomplete"):
        open_golden(golden)
    doc["attributes"]["vd"].update(complete=True, format_version=FORMAT_VERSION + 1)
    meta_file.write_text(json.dumps(doc))
    with pytest.raises(GoldenError, match="this vd reads up to"):
        open_golden(golden)
    meta_file.write_text("{ not json")
    with pytest.raises(GoldenCorruptError, match="unreadable"):
        open_golden(golden)


def test_not_goldens(tmp_path):
    with pytest.raises(GoldenNotFoundError):
        open_golden(tmp_path / "absent.zarr")
    (tmp_path / "file.zarr").write_text("hello")
    with pytest.raises(NotAGoldenError):
        open_golden(tmp_path / "file.zarr")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotAGoldenError):
        open_golden(tmp_path / "empty")
    zarr.create_group(tmp_path / "plain.zarr")
    with pytest.raises(NotAGoldenError, match="not a vd golden"):
        open_golden(tmp_path / "plain.zarr")


def test_committed_format_v1_golden_reads_back():
    """A golden of format 1 committed to the repository still reads with today's vd."""
    g = open_golden(DATA / "tiny-llama-v1.zarr")
    assert g.meta["format_version"] == 1
    # Written before vd stored rows with Blosc: zstd chunks read through the same path.
    codecs = zarr.open_group(str(DATA / "tiny-llama-v1.zarr"), mode="r")["k2/logits"].metadata.codecs
    assert [c.to_dict()["name"] for c in codecs] == ["bytes", "zstd", "crc32c"]
    assert g.meta["model"]["spec"] == "tiny-llama"
    assert sorted(g.runs) == [2, 3, 4]
    for k, r in g.runs.items():
        assert r.logits.shape == (g.meta["steps"], k, g.meta["vocab_size"])
        assert r.accepted.max() == k - 1 and r.accepted.min() < k - 1


def test_committed_format_v2_mtp_golden_reads_back():
    """A version-2 golden of the drafter feed, with its MTP arrays, reads back."""
    g = open_golden(DATA / "tiny-llama-mtp-v2.zarr")
    assert g.meta["format_version"] == 2 and g.meta["feed"] == "mtp" and g.meta["mtp"]["source"] == "attached"
    for k, r in g.runs.items():
        s = g.meta["steps"]
        assert r.draft_logits.shape == (s, k - 1, g.meta["vocab_size"]) and r.drafts.shape == (s, k - 1)
        assert r.bootstrap_logits.shape == (1, g.meta["vocab_size"]) and r.decoded is not None
        assert (r.drafts == r.tokens[:, 1:]).all()  # in a drafter golden the head's drafts are what was verified


def test_prefill_rows_are_stored_about_a_megabyte_to_a_chunk(tiny_golden):
    """So a replay's reader reads a long prompt's rows in units that fit a GPU step (FORMAT.md); the
    rows read back whole."""
    from vd.golden import PREFILL_CHUNK_BYTES, prefill_chunks

    assert prefill_chunks((41, 151936), 2) == (3, 151936) and prefill_chunks((41, 128256), 2) == (4, 128256)
    assert prefill_chunks((2, 49152), 2) == (2, 49152) and prefill_chunks((5, 1 << 20), 4) == (1, 1 << 20)
    # At most 10 rows of SmolLM2's vocabulary fit: 21 rows go 7 to a chunk, not 10, 10 and 1 padded to 10.
    assert prefill_chunks((21, 49152), 2) == (7, 49152) and prefill_chunks((11, 49152), 2) == (6, 49152)
    g = zarr.open_group(str(tiny_golden), mode="r")
    arr = g["k2/prefill"]
    rows = PREFILL_CHUNK_BYTES // (arr.shape[1] * 2)
    assert arr.chunks == (min(rows, arr.shape[0]), arr.shape[1])
    assert open_golden(tiny_golden).runs[2].prefill.shape == arr.shape


def test_rows_are_stored_uncompressed_or_blosc_with_a_checksum(tiny_golden, tmp_path):
    """By default a chunk is its values and a CRC32C (read straight into page-locked memory on a GPU
    replay, `vd.golden.codecs`); ``compress`` stores Blosc-LZ4 over bit-shuffled values instead, and
    both read back the same rows."""
    arr = zarr.open_group(str(tiny_golden), mode="r")["k2/logits"]
    assert [c.to_dict()["name"] for c in arr.metadata.codecs] == ["bytes", "crc32c"]
    rec = _record()
    plain, packed = tmp_path / "plain.zarr", tmp_path / "packed.zarr"
    write_golden(plain, _meta(), [1, 2, 3, 4], [rec])
    write_golden(packed, _meta(), [1, 2, 3, 4], [rec], compress=True)
    for name in ("k2/logits", "k2/prefill", "k2/tokens"):
        codecs = [c.to_dict() for c in zarr.open_group(str(packed), mode="r")[name].metadata.codecs]
        assert [c["name"] for c in codecs] == ["bytes", "blosc", "crc32c"]
        assert codecs[1]["configuration"]["cname"] == "lz4" and codecs[1]["configuration"]["shuffle"] == "bitshuffle"
    a, b = open_golden(plain).runs[2], open_golden(packed).runs[2]
    assert np.array_equal(a.logits, rec.logits) and np.array_equal(b.logits, rec.logits)
    assert np.array_equal(a.prefill, b.prefill) and np.array_equal(a.tokens, b.tokens)

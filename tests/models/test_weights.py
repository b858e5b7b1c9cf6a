"""The converted-weights cache (`vd.models.weights`): a GGUF is dequantised once; later loads read the cached
checkpoint, fingerprinted and computing as the converted model does; a damaged entry is converted again."""

import copy
import json
import shutil

import pytest
import torch

from vd.models import checkpoints, load_model, weights
from vd.models.presets import smollm2_path

PROMPT = "The three laws of thermodynamics state that"


@pytest.fixture
def loads(monkeypatch, smollm2):
    """What each load read: the GGUF (a conversion, answered with a copy of the session's converted model
    to spare the 20 s) or a cache entry (read for real)."""
    seen, real = [], checkpoints.from_pretrained

    def from_pretrained(path, dtype):
        seen.append(path)
        if path.suffix == ".gguf":
            return copy.deepcopy(smollm2.model), smollm2._encode.tokenizer
        return real(path, dtype)

    monkeypatch.setattr(checkpoints, "from_pretrained", from_pretrained)
    return seen


def test_a_gguf_is_converted_once_then_read_from_the_cache(smollm2, loads):
    entry = weights.entry_path(smollm2_path(), "bfloat16")
    assert weights.ready(entry)  # the session's first load of the default model wrote it
    info = json.loads((entry / "entry.json").read_text())
    assert info["source"] == str(smollm2_path()) and info["dtype"] == "bfloat16"
    assert info["fingerprint"] == smollm2.identity().fingerprint
    again = load_model("smollm2")
    assert loads == [entry]  # no conversion
    assert again.identity().fingerprint == smollm2.identity().fingerprint
    assert again.identity().details["source"] == str(smollm2_path())  # the golden names the GGUF, not the cache
    ids = smollm2.encode(PROMPT)
    assert again.encode(PROMPT) == ids
    smollm2.reset()
    assert torch.equal(again.forward(ids), smollm2.forward(ids))


def test_a_damaged_entry_is_converted_again(smollm2, loads, tmp_path, monkeypatch):
    monkeypatch.setenv("VD_CACHE_DIR", str(tmp_path / "cache"))
    first = load_model("smollm2")  # converts into this test's cache
    entry = weights.entry_path(smollm2_path(), "bfloat16")
    assert loads == [smollm2_path()] and weights.ready(entry)
    weights_file = entry / "model.safetensors"
    data = bytearray(weights_file.read_bytes())
    data[-1000] ^= 0x40  # one bit of one weight
    weights_file.write_bytes(bytes(data))
    loads.clear()
    second = load_model("smollm2")
    assert loads == [entry, smollm2_path()]  # read, found damaged, converted again
    assert second.identity().fingerprint == first.identity().fingerprint == smollm2.identity().fingerprint
    assert weights.stored_fingerprint(entry) == smollm2.identity().fingerprint
    (entry / "model.safetensors").write_bytes(b"not safetensors")  # unreadable: converted again too
    loads.clear()
    assert load_model("smollm2").identity().fingerprint == smollm2.identity().fingerprint
    assert loads == [entry, smollm2_path()] and weights.ready(entry)


def test_vd_cache_info_and_clear(cli, smollm2, tmp_path, monkeypatch):
    session = weights.entry_path(smollm2_path(), "bfloat16")
    mine = tmp_path / "cache"
    shutil.copytree(session.parent, mine / "weights", copy_function=shutil.copy)
    monkeypatch.setenv("VD_CACHE_DIR", str(mine))
    code, out, err = cli("cache", "info", "--json")
    listed = json.loads(out)
    assert code == 0 and listed["root"] == str(mine) and len(listed["entries"]) >= 1, err
    assert {e["source"] for e in listed["entries"]} == {str(smollm2_path())}
    assert listed["bytes"] > 100e6  # 135 M bf16 parameters
    code, out, err = cli("cache", "info")
    assert code == 0 and str(mine) in out and "bfloat16" in out and " MB" in out
    code, out, err = cli("cache", "clear")
    assert code == 0 and f"removed {len(listed['entries'])} entr" in out and " MB)" in out
    out = cli("cache", "info")[1]  # an empty cache: no size (it said "0.0 MB"), nor a clear's
    assert "0 entries" in out and "MB" not in out and "kB" not in out, out
    assert cli("cache", "clear")[1].startswith("removed 0 entries from ")
    assert json.loads(cli("cache", "info", "--json")[1])["entries"] == []
    monkeypatch.setenv("VD_CACHE", "off")
    assert weights.root() is None and weights.entry_path(smollm2_path(), "bfloat16") is None
    assert "the cache is off" in cli("cache", "info")[1]


@pytest.mark.slow
def test_a_conversion_and_its_cache_entry_compute_the_same_decode_rows(tmp_path, monkeypatch):
    """A machine's first load converts the GGUF; later ones memory-map the cache's safetensors, whose tensors sat
    8 bytes past a 64-byte boundary. On an AMD EPYC (MKL) a one-row matmul rounds by its operands' alignment, so
    a float32 golden recorded by the first load failed every later replay at its decode rows (found by a test
    run on such a host). Both loads now place every weight as PyTorch allocates a tensor."""
    monkeypatch.setenv("VD_CACHE_DIR", str(tmp_path / "cache"))
    fresh = load_model("smollm2", dtype="float32")  # converted (and stored)
    assert weights.ready(weights.entry_path(smollm2_path(), "float32"))
    cached = load_model("smollm2", dtype="float32")  # read from the cache
    rows = []
    for m in (fresh, cached):
        held = [*m.model.parameters(), *m.model.buffers()]
        assert all(t.data_ptr() % checkpoints.ALIGNMENT == 0 for t in held)
        ids = m.encode(PROMPT)
        m.reset()
        m.forward(ids)
        rows.append(torch.cat([m.forward([t]) for t in ids[:6]]))  # one-token decodes
    assert torch.equal(rows[0], rows[1])

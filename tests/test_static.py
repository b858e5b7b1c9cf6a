"""The static-cache forwards on the CPU (`static`; the graphed and compiled ones need CUDA: test_gpu.py),
the generated-weight presets' generator, and the harness pieces issue 4 added (background golden
writer and reader, --k on replay, --deterministic)."""

import json
import time

import numpy as np
import pytest
import torch
import zarr

from vd.golden import open_golden
from vd.models import load_model
from vd.models.hf import build_generated, device_checksum, hash_uniform_
from vd.models.static import capacity_for
from vd.testing import DraftHeadConformance, ModelConformance

FIXTURE_PROMPT = "The three laws of thermodynamics state that"


class TestStaticConformance(ModelConformance, DraftHeadConformance):
    @pytest.fixture
    def model(self):
        m = load_model("tiny-llama-mtp")
        m.set_forward("static")
        return m


def test_static_forwards_offered_by_device():
    fw = load_model("tiny-llama").forwards()
    assert "static" in fw
    assert not {"graphed", "compiled", "compiled-graphed"} & set(fw)  # CUDA only


def test_static_matches_dynamic_sdpa_closely_but_is_its_own_forward():
    """The static forward attends over the whole preallocated cache with an additive mask: the same
    function as SDPA over a growing cache, but not the same arithmetic."""
    m = load_model("tiny-llama")
    prompt = m.encode(FIXTURE_PROMPT)
    rows = {}
    for f in ("sdpa", "static"):
        m.set_forward(f)
        m.reset()
        m.forward(prompt)
        rows[f] = m.forward([1, 2, 3]).float()
    d = (rows["sdpa"] - rows["static"]).abs().max().item()
    assert d < 0.1 * rows["sdpa"].abs().max().item()
    assert rows["sdpa"].argmax(-1).tolist() == rows["static"].argmax(-1).tolist()


@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-qwen2"])
def test_lean_step_does_hf_arithmetic_and_leaves_hf_forwards_alone(spec):
    """vd's lean step (fused GEMMs, one rotary, grouped-query SDPA) against HF's own modules: in fp32 on
    the CPU within float rounding, and building it (fusing the weights into shared storage) changes
    neither the weights' values nor HF's eager forward."""
    from vd.models.static import StaticRunner

    m = load_model(spec, dtype="float32")
    prompt = m.encode(FIXTURE_PROMPT)

    def run(forward):
        m.set_forward(forward)
        m.reset()
        pre = m.forward(prompt)
        step = m.forward([5, 6, 7])
        m.rewind(2)
        return pre, step, m.forward([8, 9])

    eager_before = run("eager")
    hf = StaticRunner(m.model, "static", hidden=False, lean=False)  # HF's modules: same cache, same mask
    rows_hf = []
    with torch.inference_mode():
        hf.reset()
        for toks in (prompt, [5, 6, 7]):
            rows_hf.append(hf.forward(toks)[0])
    lean = run("static")
    stack = m._runner.lean
    assert stack is not None
    eager_after = run("eager")
    for a, b in zip(eager_before, eager_after):
        assert torch.equal(a, b)
    for a, b in zip(rows_hf, lean):
        assert (a - b).abs().max().item() < 1e-4 * a.abs().max().item()
    w = stack.layers[0].wqkv
    q = m.model.model.layers[0].self_attn.q_proj.weight
    assert q.data_ptr() == w.data_ptr()  # the module's weight is a view into the fused tensor
    again = StaticRunner(m.model, "static", hidden=False)
    assert again.lean.layers[0].wqkv.data_ptr() == w.data_ptr()  # a second stack reuses it


def test_lean_step_is_only_for_the_architectures_it_knows():
    from vd.models.lean import unsupported

    assert unsupported(load_model("tiny-llama").model) is None
    assert "DeepseekV3ForCausalLM" in unsupported(load_model("tiny-deepseek-mtp").model)
    m = load_model("tiny-glm4moe-mtp")
    m.set_forward("static")
    assert m._runner.lean is None and "HF transformers' modules" in m.forwards()["static"]


def test_static_capacity_is_enforced_and_prepare_grows_it():
    m = load_model("tiny-llama")
    m.set_forward("static")
    m.prepare(10)
    m.reset()
    m.forward(list(range(200)))
    with pytest.raises(RuntimeError, match="holds 256 positions"):
        m.forward(list(range(60)))
    m.prepare(20)
    assert m.length() == 0  # prepare starts a new sequence (its graph warm-ups write from position 0)
    m.forward(list(range(200)))
    m.prepare(300)
    assert m._runner.kv.capacity == capacity_for(300) == 512
    m.reset()
    assert m.forward(list(range(300))).shape == (300, m.vocab_size)


def test_hash_uniform_is_fixed_and_has_the_asked_spread():
    t = torch.empty(6, dtype=torch.float32)
    hash_uniform_(t, 123, 0.02)
    again = torch.empty(6, dtype=torch.float32)
    hash_uniform_(again, 123, 0.02, chunk=4)  # chunking does not change a value
    assert torch.equal(t, again)
    # Pinned: a change to the generator changes every generated preset's weights and fingerprint.
    assert t.tolist() == pytest.approx(
        [0.019165, 0.0012131, -0.0068359, -9.0122e-05, -0.0042419, -0.019043], rel=0.02, abs=1e-4)
    big = torch.empty(200_000)
    hash_uniform_(big, 7, 0.05)
    assert abs(big.std().item() - 0.05) < 0.001 and abs(big.mean().item()) < 0.001
    assert big.abs().max().item() <= 0.05 * np.sqrt(3) + 1e-6


def test_generated_model_is_reproducible_and_fingerprinted_by_content():
    from transformers import LlamaConfig

    def cfg():
        return LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05)

    a = build_generated(cfg(), seed=3, name="a", device=torch.device("cpu"), dtype=torch.bfloat16)
    b = build_generated(cfg(), seed=3, name="b", device=torch.device("cpu"), dtype=torch.bfloat16)
    c = build_generated(cfg(), seed=4, name="c", device=torch.device("cpu"), dtype=torch.bfloat16)
    assert a.identity().fingerprint == b.identity().fingerprint != c.identity().fingerprint
    with torch.no_grad():
        b.model.lm_head.weight[0, 0] += 1
    b._identity = None
    assert b.identity().fingerprint != a.identity().fingerprint  # the checksum sees one changed weight
    assert device_checksum(torch.tensor([1, 2], dtype=torch.int16)) == 1 * 1 + 2 * 2


def test_record_and_replay_static_with_k_and_determinism(cli, tmp_path):
    path = tmp_path / "s.zarr"
    code, out, err = cli("record", path, "--model", "tiny-llama-mtp", "--feed", "mtp", "--forward", "static",
                         "--prompt", FIXTURE_PROMPT, "--deterministic", "--steps", "8", "--allow-thin")
    assert code == 0, err
    meta = open_golden(path).meta
    assert meta["graphs"] == "eager" and meta["determinism"]["applied"]["deterministic_algorithms"] is True
    assert meta["determinism"]["settings"]["deterministic_algorithms"] is True
    torch.use_deterministic_algorithms(False)  # replay must apply it again by itself
    code, out, err = cli("replay", path, "--k", "3", "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert [v["k"] for v in r["verify"]] == [3]
    c = r["verify"][0]["comparisons"][0]
    assert c["prefill_equal"] and c["mismatched_steps"] == 0 and c["draft_mismatched_steps"] == 0
    assert r["determinism"]["applied"]["deterministic_algorithms"] is True
    assert r["determinism"]["replayed"]["deterministic_algorithms"] is True
    assert r["graphs"] == "eager" and r["variants"][0]["graphs"] == "eager"
    assert set(r["phases"]) == {"open", "setup", "prepare", "run", "wait_golden", "compare", "control", "finish"}
    assert r["phases"]["run"] > 0 and all(v >= 0 for v in r["phases"].values())
    torch.use_deterministic_algorithms(False)
    code, out, err = cli("replay", path, "--k", "5")
    assert code == 2 and "no verify width [5]" in err


def test_lazy_golden_reports_corruption_when_used(tiny_golden, tmp_path):
    import shutil

    from vd.errors import GoldenCorruptError

    copy = tmp_path / "g.zarr"
    shutil.copytree(tiny_golden, copy)
    chunk = next(p for p in (copy / "k3" / "logits").rglob("*") if p.is_file() and p.name != "zarr.json")
    chunk.write_bytes(chunk.read_bytes()[:5])
    g = open_golden(copy, lazy=True)  # cheap: metadata and prompt only
    assert g.runs[2].k == 2
    with pytest.raises(GoldenCorruptError, match="k3/logits"):
        g.runs[3]


def test_step_logs_in_the_metadata_start_a_replay_and_are_checked(tiny_copy):
    from vd.errors import GoldenCorruptError

    meta = open_golden(tiny_copy).meta
    assert meta["logs"]["3"]["accepted"] == open_golden(tiny_copy).runs[3].accepted.tolist()
    doc_path = tiny_copy / "zarr.json"
    doc = json.loads(doc_path.read_text())
    doc["attributes"]["vd"]["logs"]["3"]["accepted"][0] ^= 1  # the copy now disagrees with the arrays
    doc_path.write_text(json.dumps(doc))
    g = open_golden(tiny_copy, lazy=True)
    # The replay starts on the metadata's copy (no array read), which the loader then checks.
    assert g.log(3).accepted.tolist() == doc["attributes"]["vd"]["logs"]["3"]["accepted"]
    with pytest.raises(GoldenCorruptError, match="step log in the metadata disagrees"):
        g.runs[3]
    with pytest.raises(GoldenCorruptError, match="k3: the step log"):
        open_golden(tiny_copy)


def _reader(path):
    """A `vd.reader.GoldenReader` over a lazily opened golden, on the CPU (no pinned memory, no stream:
    the same units, the upload a copy)."""
    from vd.reader import GoldenReader

    g = open_golden(path, lazy=True)
    return g, GoldenReader(g.runs._src, g.runs._known, torch.device("cpu"))


def _same_as_inline(path, reader):
    inline = open_golden(path, lazy=True)
    for k in inline.runs:
        a, b = inline.runs[k], reader.record(k)
        for name in ("prefill", "logits", "tokens", "accepted", "step_ms", "bootstrap_logits", "drafts",
                     "draft_logits"):
            assert np.array_equal(getattr(a, name), getattr(b, name)) if getattr(a, name) is not None \
                else getattr(b, name) is None, name
        rows = reader.device_rows(k)
        for name, arr in a.rows_by_kind().items():
            assert np.array_equal(rows[name].numpy(), arr.view(rows[name].numpy().dtype)), name


def test_golden_reader_in_idle_time_gives_what_reading_in_line_does(rows_golden):
    """Units run in the time a run hands over (`idle`), in order, as far as each is expected to fit;
    the rest when a K is asked for."""
    tiny_golden = rows_golden
    g, reader = _reader(tiny_golden)
    assert reader.idle(0.0) is True  # units left: the run should keep handing its time over
    assert not reader.timeline  # no time, no unit
    reader.expect.update({"alloc": 0.0, "open": 60.0})
    with torch.inference_mode():  # a run calls idle in inference mode, a replay drains outside it
        reader.idle(30.0)
    assert [(w, kind) for w, kind, _ in reader.timeline] == [("idle", "alloc")]  # an open would not fit
    reader.expect["open"] = 0.0
    assert not reader.idle(30.0)  # as a run's steps would
    assert {w for w, _, _ in reader.timeline} == {"idle"} and not reader.units and reader.idle(30.0) is False
    _same_as_inline(tiny_golden, reader)

    g, reader = _reader(tiny_golden)
    _same_as_inline(tiny_golden, reader)  # everything read on demand, one unit per chunk
    chunks = sum(zarr.open_group(str(tiny_golden), mode="r")[f"k{k}/{a}"].nchunks for k in (2, 3, 4)
                 for a in ("prefill", "logits"))
    assert sum(kind.startswith("read") for _, kind, _ in reader.timeline) == chunks


def test_golden_reader_allocates_up_front_and_one_slow_unit_moves_its_mean_little(rows_golden, monkeypatch):
    """`allocate` runs every K's allocation before a run (slow when torch holds no page-locked block);
    a unit 50x slower than usual raises its kind's expected time 1.6x at most, so it does not keep the
    units behind it out of every later step's idle time."""
    import vd.reader as R

    tiny_golden = rows_golden
    g, reader = _reader(tiny_golden)
    reader.allocate()
    assert [(w, kind) for w, kind, _ in reader.timeline] == [("prefetch", "alloc")] * 3
    assert all(u.kind != "alloc" for u in reader.units) and all(reader.ks[k].host for k in (2, 3, 4))
    monkeypatch.setattr(R, "_EXPECT", {})
    g, reader = _reader(tiny_golden)
    reader.expect["open"] = 1e-3
    clock = iter([0.0, 0.05, 1.0, 1.0])  # the unit's start and end, then the idle call's bookkeeping
    monkeypatch.setattr(R.time, "perf_counter", lambda: next(clock, 2.0))
    reader._run(reader.units[1], "idle")  # an open taking 50 ms
    assert reader.expect["open"] == R._EXPECT["open"] == pytest.approx(0.7e-3 + 0.3 * 3e-3)


def test_golden_reader_of_a_golden_with_digests_reads_no_rows(tiny_golden):
    """With row digests the reader reads each K's step log, prompt and digests, checks the log and makes
    the comparison side (`vd.gold.ByDigest`, its digests on the device and its report figures made); no
    row, no buffer (a replay reads rows only where a candidate's digests differ)."""
    from vd.gold import ByDigest, _by_kind
    from vd.golden import Source

    g, reader = _reader(tiny_golden)
    assert {u.kind for u in reader.units} == {"small", "check", "gold"}
    assert reader.idle(30.0) is False and not reader.units
    src = Source(tiny_golden)
    src.meta, src.prompt = g.meta, g.prompt
    inline = open_golden(tiny_golden)
    for k in (2, 3, 4):
        gold, (d2, st2) = reader.gold(k), src.summaries(k)
        assert isinstance(gold, ByDigest) and gold._device is not None and set(gold._figures) == set(gold.counts)
        assert np.array_equal(gold.digests, d2) and np.array_equal(gold.digests, inline.runs[k].digests)
        assert np.array_equal(gold._device[0].numpy(), d2.astype(np.float64))
        stored = _by_kind(st2, gold.counts)
        assert all(np.array_equal(gold.stats(n, None)[s], stored[n][s]) for n in gold.counts for s in stored[n])
        assert np.array_equal(reader.log(k).tokens, inline.runs[k].tokens)
        assert not reader.ks[k].host and not reader.ks[k].device


def test_golden_reader_reads_chunk_files_as_zarr_does(tiny_golden, tmp_path):
    """The direct path (`vd.reader.Chunks`) against zarr's read, for vd's uncompressed and Blosc chunks
    and the Zstd chunks of older goldens, with a last chunk past the array's end; a codec chain it does
    not know reads through zarr."""
    from zarr.codecs import Crc32cCodec, GzipCodec, ZstdCodec

    from vd.golden import codecs as vd_codecs
    from vd.reader import Chunks

    data = zarr.open_group(str(tiny_golden), mode="r")["k3/prefill"][...]
    assert data.shape[0] % 8  # in chunks of 8 rows the last runs past the end
    for name, codecs, direct in (("plain", vd_codecs(False), True), ("blosc", vd_codecs(True), True),
                                 ("zstd", [ZstdCodec(level=1), Crc32cCodec()], True), ("gzip", [GzipCodec()], False)):
        zarr.create_array(zarr.storage.LocalStore(tmp_path / name), name="k3/a", data=data, chunks=(8, data.shape[1]),
                          compressors=codecs, fill_value=0)
        c = Chunks(tmp_path / name, "k3/a", "x")
        assert c.direct is direct
        out = np.zeros_like(data)
        for i, j in c.ranges():
            c.read(i, j, out[i:j])
        assert np.array_equal(out, data)


def test_golden_reader_thread_and_drafter_arrays(rows_golden):
    from pathlib import Path

    tiny_golden = rows_golden
    g, reader = _reader(tiny_golden)
    reader.start_thread()
    for _ in range(600):
        if not reader.units:
            break
        time.sleep(0.05)
    assert not reader.units and {w for w, _, _ in reader.timeline} == {"thread"}
    _same_as_inline(tiny_golden, reader)
    mtp = Path(__file__).parent / "data" / "tiny-llama-mtp-v2.zarr"  # bootstrap and draft rows, drafts
    g, reader = _reader(mtp)
    reader.idle(30.0)
    _same_as_inline(mtp, reader)


def test_golden_reader_keeps_an_error_for_its_k(rows_golden):
    from vd.errors import GoldenCorruptError

    tiny_copy = rows_golden
    chunk = next(p for p in (tiny_copy / "k3" / "logits").rglob("*") if p.is_file() and p.name != "zarr.json")
    chunk.write_bytes(chunk.read_bytes()[:5])
    g, reader = _reader(tiny_copy)
    reader.idle(30.0)  # reads past the broken chunk: K=3's error is kept, K=4 still read
    assert reader.record(2).k == 2 and reader.record(4).k == 4
    for ask in (reader.record, reader.device_rows):
        with pytest.raises(GoldenCorruptError, match="k3/logits"):
            ask(3)
    missing = next(p for p in (tiny_copy / "k4" / "prefill").rglob("*") if p.is_file() and p.name != "zarr.json")
    missing.unlink()
    g, reader = _reader(tiny_copy)
    with pytest.raises(GoldenCorruptError, match=r"k4/prefill: chunk c/\d/0 is missing"):
        reader.device_rows(4)
    flipped = tiny_copy / "k2" / "logits" / "c" / "1" / "0" / "0"  # read straight into place, then checked
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x40
    flipped.write_bytes(bytes(data))
    g, reader = _reader(tiny_copy)
    with pytest.raises(GoldenCorruptError, match="k2/logits: chunk c/1/0/0 fails its CRC32C checksum"):
        reader.record(2)
    g, reader = _reader(tiny_copy)
    with pytest.raises(GoldenCorruptError, match=r"k3/logits: chunk c/\d+/0/0 holds 1 bytes, expected \d+"):
        reader.record(3)


def test_prompt_tokens_in_the_metadata_are_checked(tiny_copy):
    from vd.errors import GoldenCorruptError

    doc_path = tiny_copy / "zarr.json"
    doc = json.loads(doc_path.read_text())
    assert doc["attributes"]["vd"]["prompt_tokens"] == open_golden(tiny_copy).prompt
    doc["attributes"]["vd"]["prompt_tokens"][0] += 1
    doc_path.write_text(json.dumps(doc))
    g = open_golden(tiny_copy, lazy=True)  # zarr.json only: the replay would start on this prompt ...
    assert g.prompt[0] == doc["attributes"]["vd"]["prompt_tokens"][0]
    with pytest.raises(GoldenCorruptError, match="prompt in the metadata disagrees"):
        g.runs[2]  # ... and the first K's rows refuse it

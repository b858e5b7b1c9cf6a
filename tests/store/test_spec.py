"""FORMAT.md is a specification: a reader written from it alone (tests/spec_reader.py, which imports nothing
from vd) recomputes every derived value of every committed golden (formats 1 to 6) and of goldens recorded
here (the reference and the drafter feed, as a directory and as a zip file, one with a non-ASCII prompt; a
slim form, a replay's candidate and each committed golden migrated), and finds what each stores: every row's
digest and statistics, every accept count and the other step rules, every manifest entry, the golden ID and
the content digest. vd is used only to write goldens (through its command line), never to read them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import spec_reader as S

TESTS = Path(__file__).parent.parent
DATA = TESTS / "data"
SPEC = (TESTS.parent / "FORMAT.md").read_text()
COMMITTED = {1: "tiny-llama-v1.zarr", 2: "tiny-llama-mtp-v2.zarr", 3: "tiny-llama-mtp-v3.zarr",
             4: "tiny-llama-mtp-v4.zarr", 5: "tiny-llama-mtp-v5.zarr", 6: "tiny-llama-v6.zarr"}
NON_ASCII = "Größe, Wärme und Entropie — 熵增 🔥: "
MTP = ("--model", "tiny-llama-mtp", "--feed", "mtp", "--prompt", "The three laws of thermodynamics state that")
RECORDED = {  # name: the recording's arguments
    "reference.zarr": ("--model", "tiny-llama"),
    "reference.zip": ("--model", "tiny-llama", "--prompt", NON_ASCII),
    "mtp.zarr": MTP,
    "mtp.zip": MTP,
    "traced.zarr": ("--model", "tiny-llama", "--trace"),
    "traced-mtp.zip": (*MTP, "--trace"),
}


@pytest.fixture(scope="module")
def made(cli, tmp_path_factory) -> dict[str, Path]:
    """Goldens written here by vd's command line: each feed as a directory and as a zip file, a slim form, a
    replay's candidate, and each committed golden of an earlier format migrated to the current one."""
    where = tmp_path_factory.mktemp("spec")
    out = {}
    for name, args in RECORDED.items():
        out[name] = where / name
        code, _, err = cli("record", out[name], *args, "--steps", "4", "--k", "2,3")
        assert code == 0, err
    out["slim.zarr"] = where / "slim.zarr"
    code, _, err = cli("slim", out["mtp.zarr"], out["slim.zarr"])
    assert code == 0, err
    out["candidate.zarr"] = where / "candidate.zarr"
    code, _, err = cli("replay", out["reference.zarr"], "--save-candidate", out["candidate.zarr"])
    assert code == 0, err
    for version, name in COMMITTED.items():
        if version < 7:
            out[f"migrated-v{version}.zarr"] = where / f"migrated-v{version}.zarr"
            code, _, err = cli("migrate", DATA / name, out[f"migrated-v{version}.zarr"])
            assert code == 0, err
    return out


def _goldens() -> list:
    return ([pytest.param(("committed", name), id=f"v{v}-{name}") for v, name in COMMITTED.items()]
            + [pytest.param(("made", name), id=name) for name in (*RECORDED, "slim.zarr", "candidate.zarr")]
            + [pytest.param(("made", f"migrated-v{v}.zarr"), id=f"migrated-v{v}") for v in COMMITTED if v < 7])


@pytest.fixture
def golden(request) -> S.Golden:
    where, name = request.param
    return S.Golden(DATA / name if where == "committed" else request.getfixturevalue("made")[name])


def test_the_reader_imports_nothing_from_vd():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import spec_reader; "
            "bad = sorted(m for m in sys.modules if m == 'vd' or m.startswith('vd.') or m == 'torch'); "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code, str(TESTS)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- the formulas' test vectors, as FORMAT.md lists them ---------------------------------------------------------
SPLITMIX = {1: 0xE220A8397B1DCDAF, 2: 0x6E789E6AA1B965F4, 3: 0x06C45D188009454F, 6: 0x53CB9F0C747EA2EA,
            7: 0x2C829ABE1F4532E1, 12: 0xC2D326E0055BDEF6}
WEIGHTS = {20: [[926218, 452489, 27717, 1018043, 111512, 343225], [182313, 809025, 257623, 998276, 415726, 798002]],
           19: [[463109, 226244, 13858, 509021, 55756, 171612], [91156, 404512, 128811, 499138, 207863, 399001]]}
BITS = {2: 20, 512: 20, 152064: 20, 262144: 20, 262145: 19, 304128: 19, 1 << 20: 18, 1 << 23: 15}
EXAMPLE_ROW = np.array([[0x3F80, 0xC000]], dtype="<u2")  # bfloat16 [1.0, -2.0]
EXAMPLE_DIGEST = [12069583616, -5899404416, -3770327680, 193553024, -4998515712, -7494999168]
EXAMPLE_STATS = [0.0, 1.0, 3.0, 2.0, 0.9525741338729858]


def _in_spec(value) -> bool:
    return re.search(rf"(?<![0-9A-Za-z]){re.escape(str(value))}(?![0-9A-Za-z])", SPEC) is not None


def test_the_digest_weights_are_the_test_vectors_format_md_lists():
    for i, z in SPLITMIX.items():
        assert S.splitmix64(i) == z and _in_spec(f"0x{z:016x}"), i
    for bits, rows in WEIGHTS.items():
        assert S.weights(2, bits).tolist() == rows
        assert all(_in_spec(w) for row in rows for w in row), bits
    for words, bits in BITS.items():
        assert S.digest_bits(words) == bits, words
    assert S.row_digests(EXAMPLE_ROW, 20).tolist() == [EXAMPLE_DIGEST]
    assert S.row_stats(EXAMPLE_ROW, "bfloat16").tolist() == [EXAMPLE_STATS]
    assert all(_in_spec(d) for d in EXAMPLE_DIGEST) and _in_spec(EXAMPLE_STATS[-1])


@pytest.mark.parametrize("value", [
    {"b": 1, "a": [True, False, None], "é": "x"},
    "quote \" backslash \\ slash / controls \b\f\n\r\t\x00\x1f del \x7f é ß — 熵 🔥 \ud7ff \ue000 \uffff",
    [0, -1, 2**53, 1.0, 0.1, -2.5, 1e-05, 0.0001, 1e16, 1234567890123456.0, 1.5e300, float("inf"), float("-inf")],
    {"nested": {"z": [], "y": {}, "x": [{"b": 2, "a": 1}]}},
])
def test_canonical_json_is_written_as_format_md_says(value):
    """The rules FORMAT.md gives (sorted keys, ASCII only with lowercase \\u escapes, surrogate pairs, the short
    escapes, how numbers are written) write what vd's serialiser (Python's json) writes."""
    assert S.canonical(value) == json.dumps(value, sort_keys=True, separators=(",", ":"))
    assert S.canonical(value, ", ", ": ") == json.dumps(value, sort_keys=True)


# -- every golden ------------------------------------------------------------------------------------------------
def _walk_keys(value, path=""):
    """(path, key) of every object key in ``value``, except keys that are data (file names, K values)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if path.split(".")[-1] not in ("manifest", "logs", "left_greedy", "step_ms", "control"):
                yield path, k
            yield from _walk_keys(v, f"{path}.{k}" if path else k)
    elif isinstance(value, list):
        for v in value:
            yield from _walk_keys(v, path)


def _documented() -> set[str]:
    return {word for code in re.findall(r"`([^`\n]+)`", SPEC) for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code)}


@pytest.mark.parametrize("golden", _goldens(), indirect=True)
def test_format_md_names_every_key(golden):
    documented = _documented()
    run = golden.run or {}
    keys = [*_walk_keys(golden.meta), *_walk_keys(run, "vd_run")]
    for k in golden.groups:
        keys += [(f"k{k}", key) for key in golden.k_attrs(k)]
    missing = sorted({f"{path}.{key}" if path else key for path, key in keys if key not in documented})
    assert not missing, f"{golden.path}: keys FORMAT.md does not name: {missing}"


def _small_arrays(g, k: int, prompt: list[int]) -> dict:
    """The small arrays FORMAT.md gives K's group of golden ``g``: name -> (shape, data type)."""
    s = g.steps_of(k)
    small = {"tokens": ((s, k), "int32"), "accepted": ((s,), "int32")}
    if g.version < 5:
        small["step_ms"] = ((s,), "float64")
    if g.drafted_at(k):
        small["drafts"] = ((s, k - 1), "int32")
    total = len(prompt) + s * k + (1 + s * (k - 1) if g.drafted_at(k) else 0)
    if g.version >= 3:
        small.update(digests=((total, 6), "int64"), stats=((total, 5), "float64"))
    trace = g.meta.get("trace") or {}
    points = trace.get("decode") if k == 1 else trace.get("points")  # (the decode rows traced: "decode" lists them)
    if points:
        t, m = len(prompt) + (1 if g.drafted_at(k) else 0) + s * k, len(points)
        small.update(trace_digests=((t, m, 6), "int64"), trace_stats=((t, m, 2), "float32"))
    return small


def _row_arrays(g, k: int, prompt: list[int]) -> dict:
    """The logits-row arrays FORMAT.md gives K's group of golden ``g``: name -> shape."""
    s, v = g.steps_of(k), g.vocab
    rows = {"prefill": (len(prompt), v), "logits": (s, k, v)}
    if g.drafted_at(k):
        rows.update(bootstrap_logits=(1, v), draft_logits=(s, k - 1, v))
    return rows


def _check_small(g, k: int, small: dict) -> None:
    for name, (shape, dtype) in small.items():
        doc = g.zarr_doc(f"k{k}/{name}")
        assert (tuple(doc["shape"]), doc["data_type"]) == (shape, dtype), name
        assert doc["chunk_grid"]["configuration"]["chunk_shape"] == [max(x, 1) for x in shape], name
        assert [c["name"] for c in doc["codecs"]] == (["bytes", "zstd", "crc32c"] if g.version <= 2
                                                      else ["bytes", "crc32c"]), name


def _check_rows(g, k: int, rows: dict, prompt: list[int]) -> None:
    n = S.STORAGE[g.logical].itemsize
    for name, shape in rows.items():
        chunk0 = S.prefill_chunk_rows(len(prompt), g.vocab, n) if name == "prefill" else 1
        if g.version < 4:
            per = [(name, shape, S.STORAGE[g.logical].name)]
        else:
            per = [(f"{name}.hi", shape, "uint8"), (f"{name}.lo", (*shape, n - 1), "uint8")]
        for array, want, dtype in per:
            doc = g.zarr_doc(f"k{k}/{array}")
            assert (tuple(doc["shape"]), doc["data_type"], doc["fill_value"]) == (want, dtype, 0), array
            chunks = doc["chunk_grid"]["configuration"]["chunk_shape"]
            assert chunks == [chunk0, *want[1:]], array
            codecs = [c["name"] for c in doc["codecs"]]
            plain = array.endswith(".lo") or g.version == 3
            assert codecs == (["bytes", "crc32c"] if plain else ["bytes", "zstd", "crc32c"]), array
            if "zstd" in codecs:
                assert doc["codecs"][1]["configuration"]["level"] == 1
            chunk_files = [key for key in g.files if key.startswith(f"k{k}/{array}/c/")]
            assert len(chunk_files) == -(-want[0] // chunks[0]), array  # every chunk written


@pytest.mark.parametrize("golden", _goldens(), indirect=True)
def test_layout_and_codecs_are_format_md_s(golden):
    g = golden
    if g.path.suffix == ".zip":
        with zipfile.ZipFile(g.path) as z:
            assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}
    prompt = g.prompt()
    assert g.array("prompt").dtype == np.int32 and len(prompt) >= 1
    if "prompt_tokens" in g.meta:
        assert g.meta["prompt_tokens"] == prompt
    assert g.meta["format"] == "vd-golden" and 1 <= g.version <= 7
    for k in g.groups:
        attrs = g.k_attrs(k)
        assert attrs["k"] == k and attrs["steps"] == g.steps_of(k)
        small, rows = _small_arrays(g, k, prompt), _row_arrays(g, k, prompt)
        names = {key.split("/")[1] for key in g.files if key.startswith(f"k{k}/") and key.count("/") >= 2}
        expected = set(small)
        if g.rows_stored:
            expected |= {f"{r}{p}" for r in rows for p in ((".hi", ".lo") if g.version >= 4 else ("",))}
        assert names == expected, f"k{k}"
        _check_small(g, k, small)
        if g.rows_stored:
            _check_rows(g, k, rows, prompt)


@pytest.mark.parametrize("golden", _goldens(), indirect=True)
def test_every_row_digest_and_statistic_is_recomputed(golden):
    g = golden
    if not g.rows_stored:
        pytest.skip("a slim golden stores no rows (its digests are checked against its full golden's below)")
    n = S.STORAGE[g.logical].itemsize
    words = g.vocab * n // 2
    bits = S.digest_bits(words)
    if g.version >= 3:
        assert g.meta["digest"] == {"scheme": "vd-linear-int16-f64/1", "lanes": 6, "bits": bits, "words": words}
    for k in g.groups:
        rows = np.concatenate(list(g.rows(k).values()))
        digests, stats = S.row_digests(rows, bits), S.row_stats(rows, g.logical)
        if g.version < 3:
            continue  # stored neither (the content digest below still checks the digests computed here)
        stored_d, stored_s = g.array(f"k{k}/digests"), g.array(f"k{k}/stats")
        bad = np.flatnonzero((digests != stored_d).any(axis=1))
        assert not bad.size, f"k{k}: rows {bad[:5].tolist()} digest otherwise: stored {stored_d[bad[0]].tolist()}, " \
                             f"computed {digests[bad[0]].tolist()}"
        assert np.array_equal(stats[:, :4], stored_s[:, :4]), f"k{k}: argmax, top-1, margin or |logit| differ"
        assert np.array_equal(stored_s.astype(np.float32).astype(np.float64), stored_s), "not float32 values"
        err = np.abs(stats[:, 4] - stored_s[:, 4]) / stored_s[:, 4]
        assert err.max() <= 1e-4, f"k{k}: top-1 probability off by {err.max():.2e} relatively"


def _logs(g: S.Golden) -> dict[int, dict]:
    """Each K's step log from its arrays and group attributes, checked against the metadata's copy."""
    out = {}
    for k in g.groups:
        attrs = g.k_attrs(k)
        log = {"tokens": g.array(f"k{k}/tokens"), "accepted": g.array(f"k{k}/accepted"),
               "bootstrap": attrs["bootstrap"], "decoded": attrs.get("decoded"),
               "committed_is_greedy": attrs.get("committed_is_greedy")}
        copy = (g.meta.get("logs") or {}).get(str(k))
        if g.version >= 6:
            assert copy is not None
        if copy is not None:
            assert copy["tokens"] == log["tokens"].tolist() and copy["accepted"] == log["accepted"].tolist()
            assert (copy["bootstrap"], copy["decoded"], copy["committed_is_greedy"]) == (
                log["bootstrap"], log["decoded"], log["committed_is_greedy"]), f"logs.{k}"
            if g.version < 5:
                assert copy["step_ms"] == g.array(f"k{k}/step_ms").tolist()
            else:
                assert "step_ms" not in copy and len(g.run["step_ms"][str(k)]) == g.steps_of(k)
        out[k] = log
    return out


@pytest.mark.parametrize("golden", _goldens(), indirect=True)
def test_every_accept_count_follows_from_the_rows(golden):
    """The accept rule and the other step rules (FORMAT.md, "Steps and rows"), from the stored rows' argmaxes."""
    g, v = golden, golden.vocab
    candidate = "candidate" in g.meta
    greedy, logs = g.meta["greedy"], _logs(g)
    assert len(greedy) == g.meta["steps"] * max(g.ks) + 1
    thin = []
    if S.DECODE_K in g.groups:
        _check_decode_group(g, logs.pop(S.DECODE_K), greedy, candidate)
    for k, log in logs.items():
        tokens, accepted = log["tokens"], log["accepted"]
        assert ((0 <= accepted) & (accepted <= k - 1)).all() and ((0 <= tokens) & (tokens < v)).all()
        if not ((accepted == k - 1).any() and (accepted < k - 1).any()):
            thin.append(k)
        if g.drafted:
            assert np.array_equal(g.array(f"k{k}/drafts"), tokens[:, 1:])
        else:
            assert log["decoded"] is None
            p = 0
            for s in range(len(tokens)):
                assert tokens[s, 1:].tolist() == S.reference_drafts(greedy, p, s, k, v), f"k{k} step {s}: drafts"
                p += int(accepted[s]) + 1
        if g.meta.get("require_coverage"):
            assert set(accepted.tolist()) == set(range(k))
        committed = S.committed(tokens, accepted, log["decoded"])
        same = committed == greedy[:len(committed)]
        assert log["committed_is_greedy"] == (None if candidate else same), f"k{k}"
        if "left_greedy" in g.meta:
            left = S.left_greedy(tokens, accepted, log["decoded"], greedy)
            assert g.meta["left_greedy"].get(str(k)) == (None if same else left), f"k{k}"
        if not g.rows_stored:
            continue
        rows = g.rows(k)
        verify = S.argmaxes(rows["verify"], g.logical).reshape(len(tokens), k)
        last_prefill = int(S.argmaxes(rows["prefill"][-1:], g.logical)[0])
        if g.drafted:
            draft = S.argmaxes(rows["draft"], g.logical)
            assert (log["decoded"], log["bootstrap"]) == (last_prefill, int(draft[0])), f"k{k}: bootstrap"
            # vd's MTP adapter drafts greedily: each draft is its draft row's argmax.
            assert np.array_equal(draft[1:].reshape(len(tokens), k - 1), g.array(f"k{k}/drafts")), f"k{k}: drafts"
        else:
            assert log["bootstrap"] == last_prefill, f"k{k}: bootstrap"
        assert int(tokens[0, 0]) == log["bootstrap"]
        for s in range(len(tokens)):
            assert accepted[s] == S.accepted_count(tokens[s].tolist(), verify[s].tolist()), f"k{k} step {s}"
            if s + 1 < len(tokens):
                assert tokens[s + 1, 0] == verify[s, accepted[s]], f"k{k} step {s}: next last"
    assert len(g.meta.get("thin") or []) == len(thin)
    assert all(r.startswith(f"verify K={k}: ") for r, k in zip(g.meta.get("thin") or [], thin))


def _check_decode_group(g: S.Golden, log: dict, greedy: list[int], candidate: bool) -> None:
    """The decode group (FORMAT.md, "Decode rows"): one-token decodes of the greedy continuation, accepting
    nothing; its prefill's last row chooses greedy[0], each decode row the next token (a candidate's log
    leaves ``committed_is_greedy`` unset, as for every K)."""
    n = g.meta["decode"]["steps"]
    assert n == g.meta["steps"] * max(g.ks) and log["decoded"] is None
    assert log["committed_is_greedy"] is (None if candidate else True)
    assert log["tokens"].shape == (n, 1) and not log["accepted"].any() and log["bootstrap"] == greedy[0]
    assert log["tokens"][:, 0].tolist() == greedy[:n]
    if g.rows_stored:
        rows = g.rows(S.DECODE_K)
        assert int(S.argmaxes(rows["prefill"][-1:], g.logical)[0]) == greedy[0]
        assert S.argmaxes(rows["verify"], g.logical).tolist() == greedy[1:n + 1]


def _stored_digests(g: S.Golden) -> dict[int, np.ndarray]:
    """Each K group's row digests: stored, or recomputed from the rows where a golden stores none (formats 1, 2)."""
    if g.version >= 3:
        return {k: g.array(f"k{k}/digests") for k in g.groups}
    bits = S.digest_bits(g.vocab * S.STORAGE[g.logical].itemsize // 2)
    return {k: S.row_digests(np.concatenate(list(g.rows(k).values())), bits) for k in g.groups}


@pytest.mark.parametrize("golden", _goldens(), indirect=True)
def test_content_digest_golden_id_and_manifest_are_recomputed(golden, made):
    g = golden
    content = S.content_digest(g.meta, g.prompt(), _logs(g), _stored_digests(g))
    if g.version >= 5:
        assert g.meta["content_digest"] == content
        history = g.meta["history"]
        assert [e["version"] for e in history] == list(range(1, len(history) + 1))
        assert history[-1]["content_digest"] == content
        assert [e["previous"] for e in history] == [None, *(e["content_digest"] for e in history[:-1])]
        assert "created" not in g.meta and not {"host", "time"} & set(g.meta["environment"])
        assert set(g.run) == {"created", "environment", "model_source", "step_ms"}
        assert set(g.run["environment"]) == {"host", "time"}
    if g.version < 6:
        assert g.path.parent == DATA, "only committed goldens are older than format 6"
        migrated = S.Golden(made[f"migrated-v{g.version}.zarr"])
        assert migrated.meta["content_digest"] == content  # a migration keeps the numbers
        return
    assert g.meta["manifest"] == S.manifest(g.files)
    assert set(g.files) - set(g.meta["manifest"]) == {"zarr.json", "run/zarr.json"}
    assert g.meta["golden_id"] == S.golden_id(g.meta) and g.meta["complete"] is True
    if not g.rows_stored:  # slim: the same numbers as its full golden
        full = S.Golden(made["mtp.zarr"])
        assert g.meta["content_digest"] == full.meta["content_digest"]
        assert all(np.array_equal(g.array(f"k{k}/digests"), full.array(f"k{k}/digests")) for k in g.groups)
    if any(ord(c) > 0x7E for c in g.meta.get("prompt_text", "")):
        body = {k: v for k, v in g.meta.items() if k not in ("golden_id", "complete")}
        utf8 = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        assert utf8 != S.canonical(body).encode() and "\\u" in S.canonical(g.meta["prompt_text"])


def test_the_non_ascii_prompt_was_recorded(made):
    g = S.Golden(made["reference.zip"])
    assert g.meta["prompt_text"] == NON_ASCII
    assert g.prompt() == [b % 512 for b in NON_ASCII.encode()]  # tiny-llama: UTF-8 bytes


def test_two_recordings_differ_where_format_md_says(made):
    """The same settings recorded twice on one machine (here as a directory and as a zip file): every file the
    manifest lists is the same, and the root metadata differs only in the history's times and the golden ID."""
    a, b = S.Golden(made["mtp.zarr"]), S.Golden(made["mtp.zip"])
    assert a.meta["manifest"] == b.meta["manifest"] and a.meta["content_digest"] == b.meta["content_digest"]
    assert {k: v for k, v in a.files.items() if k not in S.OUTSIDE} == {k: v for k, v in b.files.items()
                                                                         if k not in S.OUTSIDE}

    def stable(meta):
        return {**{k: v for k, v in meta.items() if k != "golden_id"},
                "history": [{k: v for k, v in e.items() if k != "time"} for e in meta["history"]]}
    assert stable(a.meta) == stable(b.meta)


@pytest.mark.parametrize("name", ["reference.zarr", "mtp.zip"])
def test_the_decode_map_and_its_identical_pairs_are_vd_s(made, cli, name):
    """FORMAT.md's map from verify rows to decode rows, applied by the reader to the stored step logs, and the
    pairs whose stored digests are equal: the counts `vd show` reports for each K."""
    g = S.Golden(made[name])
    logs, greedy = _logs(g), g.meta["greedy"]
    decode = g.array(f"k{S.DECODE_K}/digests")[len(g.prompt()):]  # the decode group's verify rows
    code, shown, err = cli("show", made[name])
    assert code == 0, err
    counts = [line.split("verify vs decode: ")[1].split(" rows bit-identical")[0] for line in shown.splitlines()
              if "verify vs decode: " in line]
    expected = []
    for k in g.ks:
        log = logs[k]
        mapping = S.decode_map(log["tokens"], log["accepted"], log["decoded"], greedy, g.meta["decode"]["steps"])
        digests = g.array(f"k{k}/digests")[len(g.prompt()):][: log["tokens"].size]
        pairs = [(i, j) for i, j in enumerate(mapping) if j >= 0]
        same = sum(np.array_equal(digests[i], decode[j]) for i, j in pairs)
        assert pairs, f"k{k}: no verify row maps to a decode row"
        expected.append(f"{same} of {len(pairs)}")
    assert counts == expected



@pytest.mark.parametrize("name", ["traced.zarr", "traced-mtp.zip"])
def test_the_lm_head_trace_is_the_logits_rows(made, name):
    """A traced golden's LM head point is its logits: its trace rows (the prefill's, the bootstrap decode's, the
    steps', in call order) have the digests and the max |x| of the golden's rows, recomputed from the rows."""
    g = S.Golden(made[name])
    trace = g.meta["trace"]
    assert [tuple(p) for p in trace["points"]][-1] == ("lm_head", "LM head") and trace["stats"] == ["absmax", "norm"]
    assert [tuple(p) for p in trace["decode"]][-1] == ("lm_head", "LM head")  # the decode rows are traced too
    bits = S.digest_bits(g.vocab * S.STORAGE[g.logical].itemsize // 2)
    for k in [1, *g.ks]:
        head = len(trace["decode" if k == 1 else "points"]) - 1
        rows = g.rows(k)
        called = [rows["prefill"]] + ([rows["draft"][:1]] if g.drafted_at(k) else []) + [rows["verify"]]
        ordered = np.concatenate(called)
        d, st = g.array(f"k{k}/trace_digests"), g.array(f"k{k}/trace_stats")
        assert np.array_equal(d[:, head], S.row_digests(ordered, bits)), f"k{k}"
        absmax = np.abs(S.values(ordered, g.logical)).max(axis=1)
        assert np.array_equal(st[:, head, 0], absmax.astype(np.float32)), f"k{k}"
        assert (st[:, :, 1] >= st[:, :, 0] - 1e-6).all()  # a norm is at least the largest |x|

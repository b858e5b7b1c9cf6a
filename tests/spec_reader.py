"""A reader of vd goldens written from FORMAT.md alone: it imports nothing from vd (only zarr, numpy and the
standard library), and recomputes every derived value a golden stores by the formulas FORMAT.md gives (row
digests and statistics, accept counts and the other step rules, the manifest, the golden ID, the content
digest). tests/store/test_spec.py compares what it computes with what each golden stores, so a formula in
FORMAT.md that is wrong, or a golden that breaks it, fails there. Section names below are FORMAT.md's.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import zarr

# -- Layout -------------------------------------------------------------------------------------------------
STORAGE = {"bfloat16": np.dtype("<u2"), "float16": np.dtype("<f2"), "float32": np.dtype("<f4")}
OUTSIDE = ("zarr.json", "run/zarr.json")  # the two files the manifest does not list


DECODE_K = 1  # the decode group's K (Decode rows): no verify width is 1


def decode_map(tokens: np.ndarray, accepted: np.ndarray, decoded: int | None, greedy: list[int],
               decode_steps: int) -> list[int]:
    """For each verify row of a K, step by step, the decode group's row of the same position, or -1 (FORMAT.md,
    "Which decode row is a verify row's")."""
    out, committed = [], [] if decoded is None else [int(decoded)]
    for row, a in zip(tokens.tolist(), accepted.tolist()):
        for i in range(len(row)):
            seen = committed + row[: i + 1]
            m = len(seen)
            out.append(m - 1 if m - 1 < decode_steps and seen == greedy[:m] else -1)
        committed += row[: a + 1]
    return out


class Golden:
    """One golden (a directory or a .zip file): every file's bytes, the root metadata, the run group's
    attributes, and its arrays through zarr."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.files = _files(self.path)
        root = json.loads(self.files["zarr.json"])
        assert root["zarr_format"] == 3 and root["node_type"] == "group"
        self.meta: dict = root["attributes"]["vd"]
        run = self.files.get("run/zarr.json")
        self.run: dict | None = None if run is None else json.loads(run)["attributes"]["vd_run"]
        store = zarr.storage.ZipStore(self.path, mode="r") if self.path.suffix == ".zip" else self.path
        self.group = zarr.open_group(store, mode="r")

    @property
    def version(self) -> int:
        return self.meta["format_version"]

    @property
    def ks(self) -> list[int]:
        """The verify widths."""
        return list(self.meta["k"])

    @property
    def groups(self) -> list[int]:
        """Every K group: the verify widths, then the decode group (K = 1) where the golden stores one."""
        return self.ks + ([DECODE_K] if self.meta.get("decode") is not None else [])

    def steps_of(self, k: int) -> int:
        """Steps of group ``k``: the golden's, or the decode group's ``decode.steps`` (S × max(K))."""
        return self.meta["decode"]["steps"] if k == DECODE_K and k not in self.ks else self.meta["steps"]

    @property
    def drafted(self) -> bool:
        return self.meta.get("feed", "reference") == "mtp"

    def drafted_at(self, k: int) -> bool:
        """Whether group ``k`` holds draft rows (never the decode group)."""
        return self.drafted and k != DECODE_K

    @property
    def logical(self) -> str:
        return self.meta["logits"]["dtype"]

    @property
    def vocab(self) -> int:
        return self.meta["vocab_size"]

    @property
    def rows_stored(self) -> bool:
        return (self.meta.get("rows") or {}).get("stored", True) is not False

    def array(self, rel: str) -> np.ndarray:
        return np.asarray(self.group[rel][...])

    def zarr_doc(self, rel: str) -> dict:
        return json.loads(self.files[f"{rel}/zarr.json"])

    def k_attrs(self, k: int) -> dict:
        return self.zarr_doc(f"k{k}")["attributes"]

    def prompt(self) -> list[int]:
        return self.array("prompt").astype(np.int64).tolist()

    def row_array(self, k: int, name: str) -> np.ndarray:
        """Row array ``name`` of K as its logical dtype's storage (bfloat16 as uint16 bits): from its two byte
        planes since format 4, as one array before."""
        storage = STORAGE[self.logical]
        if self.version < 4:
            return self.array(f"k{k}/{name}").astype(storage)
        hi, lo = self.array(f"k{k}/{name}.hi"), self.array(f"k{k}/{name}.lo")
        n = storage.itemsize
        assert hi.dtype == np.uint8 and lo.dtype == np.uint8 and lo.shape == (*hi.shape, n - 1)
        b = np.empty((*hi.shape, n), dtype=np.uint8)  # a value's little-endian bytes: lo[..., 0 .. n-2], then hi
        b[..., :n - 1], b[..., n - 1] = lo, hi
        return b.view(storage).reshape(hi.shape)

    def rows(self, k: int) -> dict[str, np.ndarray]:
        """K's rows ``[n, V]`` by kind, in layout order: prefill, verify and (drafter feed) draft rows, the
        bootstrap row first among them."""
        v = self.vocab
        out = {"prefill": self.row_array(k, "prefill"), "verify": self.row_array(k, "logits").reshape(-1, v)}
        if self.drafted_at(k):
            out["draft"] = np.concatenate([self.row_array(k, "bootstrap_logits"),
                                           self.row_array(k, "draft_logits").reshape(-1, v)])
        return out


def _files(path: Path) -> dict[str, bytes]:
    """Every file of a golden by key (its path relative to the root, ``/``-separated)."""
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as z:
            names = [i.filename for i in z.infolist() if not i.is_dir()]
            assert len(names) == len(set(names)), f"{path}: duplicate zip members"
            return {n: z.read(n) for n in names}
    out = {}
    for folder, _, names in os.walk(path):
        for name in names:
            full = Path(folder) / name
            out[full.relative_to(path).as_posix()] = full.read_bytes()
    return out


def prefill_chunk_rows(prompt: int, vocab: int, itemsize: int) -> int:
    """Prefill rows a chunk (Chunks): about 8 MiB of raw values, spread evenly over as few chunks as allows."""
    most = max(1, (8 << 20) // (vocab * itemsize))
    chunks = -(-prompt // most)
    return -(-prompt // chunks)


# -- Row digests ---------------------------------------------------------------------------------------------
GAMMA, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MASK = (1 << 64) - 1
LANES = 6


def splitmix64(i: int) -> int:
    """The i-th output (i >= 1) of SplitMix64 seeded with 0: its finaliser applied to ``i * GAMMA mod 2**64``."""
    z = (i * GAMMA) & MASK
    z = ((z ^ (z >> 30)) * MIX1) & MASK
    z = ((z ^ (z >> 27)) * MIX2) & MASK
    return z ^ (z >> 31)


def digest_bits(words: int) -> int:
    """The weight width for rows of ``words`` 16-bit words."""
    return min(20, 38 - (max(words, 2) - 1).bit_length())  # (n - 1).bit_length() = ceil(log2 n) for n >= 2


def weights(words: int, bits: int) -> np.ndarray:
    """``w[j, l]`` for ``j < words``, ``l < 6``: int64 ``[words, 6]``."""
    i = np.arange(1, words * LANES + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):  # uint64 products wrap modulo 2**64, as the formula says
        z = i * np.uint64(GAMMA)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(64 - bits)).astype(np.int64).reshape(words, LANES)


def row_digests(rows: np.ndarray, bits: int) -> np.ndarray:
    """Each row's digest: its bytes as little-endian int16 words ``x`` times the weights, exactly (int64)."""
    x = np.ascontiguousarray(rows).view("<i2").reshape(rows.shape[0], -1).astype(np.int64)
    return x @ weights(x.shape[1], bits)


# -- Row statistics ------------------------------------------------------------------------------------------
def values(rows: np.ndarray, logical: str) -> np.ndarray:
    """Stored rows as their float32 values (exact for the three dtypes)."""
    if logical == "bfloat16":
        return (rows.astype(np.uint32) << 16).view(np.float32)
    return rows.astype(np.float32)


def row_stats(rows: np.ndarray, logical: str) -> np.ndarray:
    """Each row's statistics ``[R, 5]`` float64: argmax, top-1, margin, largest |logit|, top-1 probability."""
    v = values(rows, logical)
    arg = np.argmax(v, axis=1)  # the first index of the largest value
    top1 = v.max(axis=1)
    top2 = -np.partition(-v, 1, axis=1)[:, 1]  # the second of the values sorted descending (a tie: top-1 again)
    margin = top1 - top2  # float32 arithmetic
    absmax = np.abs(v).max(axis=1)
    p = np.float32(1) / np.exp(v - top1[:, None]).sum(axis=1, dtype=np.float32)
    return np.stack([arg.astype(np.float64), top1, margin, absmax, p], axis=1).astype(np.float64)


def argmaxes(rows: np.ndarray, logical: str) -> np.ndarray:
    return np.argmax(values(rows, logical), axis=1)


# -- Steps ---------------------------------------------------------------------------------------------------
def accepted_count(tokens: list[int], argmax: list[int]) -> int:
    """Drafts a verify step accepts: the leading drafts ``tokens[j]`` (j >= 1) equal to row ``j - 1``'s argmax."""
    a = 0
    while a + 1 < len(tokens) and tokens[a + 1] == argmax[a]:
        a += 1
    return a


def reference_drafts(greedy: list[int], p: int, s: int, k: int, vocab: int) -> list[int]:
    """The reference feed's drafts of step ``s`` when ``p`` generated tokens precede its ``last``."""
    out = []
    for j in range(1, k):
        t = greedy[p + j] if p + j < len(greedy) else 0
        out.append((t + 1) % vocab if s % 2 == 1 and j == 1 + s % (k - 1) else t)
    return out


def committed(tokens: np.ndarray, accepted: np.ndarray, decoded: int | None) -> list[int]:
    """The generated sequence a K committed: the bootstrap decode's token (drafter feed), then each step's
    ``last`` and accepted drafts."""
    out = [] if decoded is None else [decoded]
    for row, a in zip(tokens.tolist(), accepted.tolist()):
        out += row[:a + 1]
    return out


def left_greedy(tokens: np.ndarray, accepted: np.ndarray, decoded: int | None, greedy: list[int]) -> int | None:
    """The step whose verify rows first chose another token than the greedy continuation (None: none did)."""
    at = 0 if decoded is None else 1
    for s, (row, a) in enumerate(zip(tokens.tolist(), accepted.tolist())):
        for j, t in enumerate(row[:a + 1]):
            if t != greedy[at + j]:
                return max(s - 1, 0) if j == 0 else s
        at += a + 1
    return None


# -- Canonical JSON ------------------------------------------------------------------------------------------
_SHORT = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _string(s: str) -> str:
    out = ['"']
    for ch in s:
        c = ord(ch)
        if ch in _SHORT:
            out.append(_SHORT[ch])
        elif 0x20 <= c <= 0x7E:
            out.append(ch)
        elif c <= 0xFFFF:
            out.append(f"\\u{c:04x}")
        else:  # a UTF-16 surrogate pair
            c -= 0x10000
            out.append(f"\\u{0xD800 | (c >> 10):04x}\\u{0xDC00 | (c & 0x3FF):04x}")
    out.append('"')
    return "".join(out)


def _float(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return repr(x)  # the shortest decimal that reads back as x (FORMAT.md gives the layout)


def canonical(value, item: str = ",", key: str = ":") -> str:
    """``value`` as canonical JSON (Canonical JSON): keys sorted by code point, ASCII only, no spaces between
    tokens but those the separators ``item`` and ``key`` hold."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list):
        return "[" + item.join(canonical(v, item, key) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + item.join(_string(k) + key + canonical(value[k], item, key) for k in sorted(value)) + "}"
    raise TypeError(f"not a JSON value: {value!r}")


def golden_id(meta: Mapping) -> str:
    body = {k: v for k, v in meta.items() if k not in ("golden_id", "complete")}
    return "sha256:" + hashlib.sha256(canonical(body).encode("ascii")).hexdigest()


def content_digest(meta: Mapping, prompt: list[int], logs: Mapping[int, Mapping], digests: Mapping[int, np.ndarray]
                   ) -> str:
    """``logs``: per K, ``tokens``, ``accepted``, ``bootstrap`` and ``decoded`` as stored."""
    basis = {"model": (meta.get("model") or {}).get("fingerprint"), "head": (meta.get("mtp") or {}).get("fingerprint"),
             "prompt": list(prompt), "dtype": meta["logits"]["dtype"], "vocab": meta["vocab_size"],
             "feed": meta.get("feed", "reference"), "steps": meta["steps"],
             "logs": {str(k): {"tokens": np.asarray(e["tokens"]).tolist(),
                               "accepted": np.asarray(e["accepted"]).tolist(),
                               "bootstrap": e["bootstrap"], "decoded": e["decoded"]} for k, e in sorted(logs.items())}}
    h = hashlib.sha256(canonical(basis, ", ", ": ").encode("ascii"))
    for k in sorted(digests):
        h.update(f"k{k}".encode("ascii"))
        h.update(np.ascontiguousarray(digests[k], dtype="<i8").tobytes())
    return "sha256:" + h.hexdigest()


def manifest(files: Mapping[str, bytes]) -> dict[str, list]:
    return {key: [len(data), hashlib.sha256(data).hexdigest()] for key, data in sorted(files.items())
            if key not in OUTSIDE}

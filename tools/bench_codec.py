"""Benchmark: how small and how fast each candidate codec stores a golden's logits rows, on one thread.

For each golden given (any format: rows as one array of the storage dtype in formats 1 to 3, as byte
planes ``<name>.hi``/``<name>.lo`` since format 4), every row of every K is read and cut into the chunks
the recorder writes: one verify step a chunk for the step arrays, the prefill's rows `prefill_chunks` at a
time. Each candidate then encodes every chunk into the blobs the store would write (one per array: one
for a whole-value codec, one per plane for the plane codecs), each with its CRC32C, and decodes them back.

- ratio: encoded bytes, 4 CRC32C bytes a blob included, over the raw row bytes;
- encode and decode MB/s: raw row bytes (1 MB = 1e6 bytes) over the time of one pass over all chunks,
  median of ``--reps`` passes, the candidates interleaved within each pass; the time covers what the store
  pays for the codec: the plane split or join (numpy), compression, and computing or checking each CRC32C;
- the same speeds from this thread's CPU time (``*_cpu_*``), which leaves out the time other processes
  held the core: the machine's cores may be shared;
- every decoded chunk is checked equal to its original, bit for bit.

Blosc runs on one thread (`numcodecs.blosc.set_nthreads`); zstd and numpy's copies are single-threaded.
Also reported: each plane's order-0 entropy (bits a byte) and the ratios it bounds when bytes are coded
independently (both planes coded, or the high plane coded and the others stored), CRCs left out. Writes
JSON (every timing sample kept) and prints a table:

    python tools/bench_codec.py GOLDEN [GOLDEN ...] --out tools/bench_codec.json --reps 5
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import checkout  # noqa: F401,E402  (the checkout's vd first on sys.path)
import google_crc32c
import numcodecs
import numcodecs.blosc
import numpy as np
import zarr
from figures import cpu_model, load_average, provenance
from numcodecs import Blosc, Zstd

from vd.dtypes import DTYPES
from vd.store import format as F

TARGET_RATIO = 0.62  # format 4's targets on real logits: stored rows at most this fraction of raw bytes,
TARGET_ENCODE_MB_S = 500.0  # encoded at least this fast on one core
FORMAT4 = "planes_hi_zstd1_lo_raw"  # the candidate format 4 stores (`vd.store.format.hi_codecs`)

COLUMNS = {"encode_mb_s": "encode", "decode_mb_s": "decode", "encode_cpu_mb_s": "enc(cpu)",
           "decode_cpu_mb_s": "dec(cpu)"}  # the table's speed columns

Blob = tuple[object, int]  # one stored chunk: its payload (a buffer) and the payload's CRC32C


def seal(payload) -> Blob:
    return payload, google_crc32c.value(payload)


def unseal(blob: Blob):
    payload, crc = blob
    if google_crc32c.value(payload) != crc:
        raise ValueError("CRC32C mismatch")
    return payload


@dataclass(frozen=True, slots=True)
class Candidate:
    """A way to store a chunk: ``encode(chunk)`` gives its blobs, ``decode(blobs, like)`` the chunk back
    (``like``: an array of the chunk's shape and dtype)."""

    name: str
    encode: Callable[[np.ndarray], list[Blob]]
    decode: Callable[[list[Blob], np.ndarray], np.ndarray]


def raw() -> Candidate:
    """The values as they are, then a CRC32C."""
    return Candidate("raw", lambda x: [seal(x)],
                     lambda blobs, like: np.frombuffer(unseal(blobs[0]), like.dtype).reshape(like.shape))


def whole(name: str, codec) -> Candidate:
    """``codec`` over the values' little-endian bytes, then a CRC32C."""
    def decode(blobs, like):
        return np.frombuffer(codec.decode(unseal(blobs[0])), like.dtype).reshape(like.shape)
    return Candidate(name, lambda x: [seal(codec.encode(x))], decode)


def _plane_layout(x: np.ndarray, transposed: bool) -> np.ndarray:
    """The values in the order the planes hold them: as they are, or (transposed) each vocabulary index's
    values of all the chunk's rows together."""
    return x.reshape(-1, x.shape[-1]).T if transposed else x


def planes(name: str, hi, lo=None, transposed: bool = False) -> Candidate:
    """`vd.store.format.split_planes`: the high bytes through ``hi``, the other bytes through ``lo`` (None:
    stored as they are), each plane its own blob with its CRC32C."""
    def encode(x):
        h, low = F.split_planes(_plane_layout(x, transposed))
        h, low = np.ascontiguousarray(h), np.ascontiguousarray(low)
        return [seal(hi.encode(h)), seal(low if lo is None else lo.encode(low))]

    def decode(blobs, like):
        shape = _plane_layout(like, transposed).shape
        h = np.frombuffer(hi.decode(unseal(blobs[0])), np.uint8).reshape(shape)
        low = unseal(blobs[1])
        low = np.frombuffer(low if lo is None else lo.decode(low), np.uint8).reshape(*shape, like.itemsize - 1)
        x = F.join_planes(h, low, like.dtype)
        return np.ascontiguousarray(x.T).reshape(like.shape) if transposed else x
    return Candidate(name, encode, decode)


def candidates(itemsize: int) -> list[Candidate]:
    return [
        raw(),
        whole("zstd1", Zstd(level=1)),
        whole("blosc_zstd1_shuffle", Blosc("zstd", 1, Blosc.SHUFFLE, typesize=itemsize)),
        whole("blosc_lz4_5_bitshuffle", Blosc("lz4", 5, Blosc.BITSHUFFLE, typesize=itemsize)),
        planes("planes_zstd1_both", Zstd(level=1), Zstd(level=1)),
        *(planes(f"planes_hi_zstd{str(lv).replace('-', 'neg')}_lo_raw", Zstd(level=lv)) for lv in (-1, 1, 2, 3)),
        planes("planes_hi_blosc_zstd1_lo_raw", Blosc("zstd", 1, Blosc.NOSHUFFLE, blocksize=1 << 17)),
        # issue 34, target 3: a faster high plane (bit-shuffled, Blosc LZ4 or zstd-1), which vd's reader reads
        planes("planes_hi_blosc_lz4_5_bitshuffle_lo_raw", Blosc("lz4", 5, Blosc.BITSHUFFLE, blocksize=1 << 17)),
        planes("planes_hi_blosc_zstd1_bitshuffle_lo_raw", Blosc("zstd", 1, Blosc.BITSHUFFLE, blocksize=1 << 17)),
        planes("tplanes_hi_zstd1_lo_raw", Zstd(level=1), transposed=True),
    ]


def load_chunks(path: Path) -> tuple[dict, list[np.ndarray]]:
    """A golden's metadata and its rows, every row array of every K, in the chunks the recorder writes."""
    group = zarr.open_group(str(path), mode="r")
    meta = dict(group.attrs["vd"])
    if not F.stored_rows(meta):
        sys.exit(f"{path}: a slim golden stores no rows")
    storage = DTYPES[meta["logits"]["dtype"]].storage
    chunks = []
    for k in meta["k"]:
        kg = group[f"k{k}"]
        for name in F.row_array_names(meta.get("feed") == "mtp"):
            if meta["format_version"] >= F.PLANES_SINCE:
                hi, lo = F.planes(name)
                rows = F.join_planes(kg[hi][...], kg[lo][...], storage)
            else:
                rows = np.asarray(kg[name][...]).view(storage)
            n = F.prefill_chunks(*rows.shape, storage.itemsize) if name == "prefill" else 1
            chunks += [rows[i:i + n] for i in range(0, len(rows), n)]
    return meta, chunks


def entropy(chunks: list[np.ndarray]) -> dict:
    """Order-0 entropy of the high and the other bytes (bits a byte), and the ratios it bounds for coding
    bytes independently: both planes, or the high plane with the other bytes stored."""
    counts = {"hi": np.zeros(256, np.int64), "lo": np.zeros(256, np.int64)}
    for x in chunks:
        h, low = F.split_planes(x)
        counts["hi"] += np.bincount(h.ravel(), minlength=256)
        counts["lo"] += np.bincount(low.ravel(), minlength=256)
    bits = {}
    for plane, c in counts.items():
        p = c[c > 0] / c.sum()
        bits[plane] = float(-(p * np.log2(p)).sum())
    lo_bytes = chunks[0].itemsize - 1
    per_value = 8 * chunks[0].itemsize
    return {"hi_bits_per_byte": bits["hi"], "lo_bits_per_byte": bits["lo"],
            "bound_both_coded": (bits["hi"] + lo_bytes * bits["lo"]) / per_value,
            "bound_hi_coded_lo_raw": (bits["hi"] + lo_bytes * 8) / per_value}


def stored_bytes(blobs: list[list[Blob]]) -> int:
    return sum(memoryview(payload).nbytes + 4 for chunk in blobs for payload, _ in chunk)


def check(c: Candidate, chunks: list[np.ndarray]) -> int:
    """One untimed round trip (also a warm-up): the stored bytes, after checking every chunk comes back."""
    blobs = [c.encode(x) for x in chunks]
    for x, b in zip(chunks, blobs):
        y = c.decode(b, x)
        if y.dtype != x.dtype or y.shape != x.shape or y.tobytes() != x.tobytes():
            sys.exit(f"{c.name}: a chunk does not decode to its original")
    return stored_bytes(blobs)


def timed_pass(c: Candidate, chunks: list[np.ndarray]) -> tuple[tuple[float, float], tuple[float, float]]:
    """(wall, this thread's CPU) seconds to encode every chunk, then the same to decode them all."""
    w0, c0 = time.perf_counter(), time.thread_time()
    blobs = [c.encode(x) for x in chunks]
    w1, c1 = time.perf_counter(), time.thread_time()
    for x, b in zip(chunks, blobs):
        c.decode(b, x)
    return (w1 - w0, c1 - c0), (time.perf_counter() - w1, time.thread_time() - c1)


def bench_golden(path: Path, reps: int) -> dict:
    meta, chunks = load_chunks(path)
    raw_bytes = sum(x.nbytes for x in chunks)
    cands = candidates(chunks[0].itemsize)
    ratio = {c.name: check(c, chunks) / raw_bytes for c in cands}
    samples = {c.name: {f"{op}{clock}_samples": [] for op in ("encode", "decode") for clock in ("", "_cpu")}
               for c in cands}
    for _ in range(reps):
        for c in cands:
            for op, (wall, cpu) in zip(("encode", "decode"), timed_pass(c, chunks)):
                samples[c.name][f"{op}_samples"].append(raw_bytes / 1e6 / wall)
                samples[c.name][f"{op}_cpu_samples"].append(raw_bytes / 1e6 / cpu)
    codecs = {name: summary(ratio[name], s) for name, s in samples.items()}
    f4 = codecs[FORMAT4]
    return {"path": str(path), "model": meta["model"]["name"], "vocab": meta["vocab_size"],
            "format_version": meta["format_version"], "chunks": len(chunks), "raw_mb": raw_bytes / 1e6,
            "entropy": entropy(chunks), "codecs": codecs,
            "format4_targets": {"codec": FORMAT4, "ratio_max": TARGET_RATIO, "encode_min_mb_s": TARGET_ENCODE_MB_S,
                                "ratio_ok": f4["ratio"] <= TARGET_RATIO,
                                "encode_ok": f4["encode_mb_s"] >= TARGET_ENCODE_MB_S}}


def summary(ratio: float, samples: dict[str, list[float]]) -> dict:
    """A candidate's ratio, median speeds (``<op>[_cpu]_mb_s``) and every speed sample."""
    medians = {k.removesuffix("_samples") + "_mb_s": statistics.median(v) for k, v in samples.items()}
    return {"ratio": ratio, **medians, **samples}


def print_table(g: dict) -> None:
    e = g["entropy"]
    print(f"\n{g['path']}: {g['model']}, vocab {g['vocab']}, format {g['format_version']}, "
          f"{g['chunks']} chunks, {g['raw_mb']:.1f} MB raw")
    print(f"  entropy hi {e['hi_bits_per_byte']:.3f} lo {e['lo_bits_per_byte']:.3f} bits/byte; order-0 bound "
          f"{e['bound_both_coded']:.4f} (both coded), {e['bound_hi_coded_lo_raw']:.4f} (hi coded, lo raw)")
    print(f"  {'codec':26s} {'ratio':>7s}" + "".join(f"{h:>10s}" for h in COLUMNS.values()) + "  (MB/s)")
    for name, c in g["codecs"].items():
        print(f"  {name:26s} {c['ratio']:7.4f}" + "".join(f"{c[k]:10.0f}" for k in COLUMNS))
    t = g["format4_targets"]
    print(f"  format 4 ({t['codec']}): ratio <= {t['ratio_max']} {'yes' if t['ratio_ok'] else 'NO'}, "
          f"encode >= {t['encode_min_mb_s']:g} MB/s {'yes' if t['encode_ok'] else 'NO'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("goldens", nargs="+", type=Path, help="golden directories (any format)")
    ap.add_argument("--out", type=Path, default=Path("tools/bench_codec.json"))
    ap.add_argument("--reps", type=int, default=5, help="timed passes per codec (median reported)")
    a = ap.parse_args()
    started = provenance()

    numcodecs.blosc.set_nthreads(1)
    goldens = []
    for path in a.goldens:
        goldens.append(bench_golden(path, a.reps))
        print_table(goldens[-1])
    out = {"command": shlex.join(sys.orig_argv),
           "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           **started, "load_after": load_average(),
           "host": {"platform": platform.platform(), "machine": platform.machine(),
                    "processor": platform.processor(), "cpu_model": cpu_model(), "cpu_count": os.cpu_count()},
           "python": platform.python_version(), "numcodecs": numcodecs.__version__, "numpy": np.__version__,
           "blosc_threads": 1, "format4_hi_codecs": [c.to_dict() for c in F.hi_codecs()],
           "goldens": goldens}
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()

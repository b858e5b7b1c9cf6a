"""The ``zarr.json`` documents of the nodes a golden writer makes, as bytes to write.

Each kind of array vd writes (a dtype and its codecs: `vd.store.format.hi_codecs` or ``plain_codecs``) is
made once per process by zarr itself, in memory, and its document reused with the shape and chunk shape set.
The documents are zarr's, so plain zarr opens every golden (tests/store/test_write.py checks it); making a
K's dozen nodes costs no event-loop round trips (about 2 ms a node through zarr's API, which a recording's
publish paid per K).
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping

import numpy as np
import zarr

from vd.store import format as F

CODECS = {"zstd": F.hi_codecs, None: F.plain_codecs}


@functools.cache
def _template(dtype: str, compressor: str | None) -> dict:
    """zarr's document for a one-value array of ``dtype`` (a numpy dtype string) with vd's codecs."""
    held: dict = {}
    root = zarr.create_group(zarr.storage.MemoryStore(held), zarr_format=3)
    root.create_array("a", shape=(1,), dtype=dtype, chunks=(1,), compressors=CODECS[compressor](), fill_value=0)
    return json.loads(held["a/zarr.json"].to_bytes())


def array(shape: tuple[int, ...], dtype, chunks: tuple[int, ...], compressor: str | None = None) -> bytes:
    """An array's document: ``shape`` of ``dtype`` in ``chunks``, Zstd-compressed when ``compressor`` is
    ``"zstd"``, then CRC32C (`vd.store.chunks.encode_chunk` writes its chunks): `_dump`'s bytes of the
    template with both set, made from the template dumped once with markers where they go (Python's indented
    JSON encoder takes about 0.5 ms a document, a dozen a K, between a recording's runs)."""
    text, (shape_at, chunks_at) = _dumped(np.dtype(dtype).str, compressor)
    return text.replace(_SHAPE, _list(shape, shape_at)).replace(_CHUNKS, _list(chunks, chunks_at)).encode()


_SHAPE, _CHUNKS = '"vd-shape-here"', '"vd-chunk-shape-here"'


@functools.cache
def _dumped(dtype: str, compressor: str | None) -> tuple[str, tuple[int, int]]:
    """The template's document as `_dump` writes it, with markers for its shape and chunk shape, and the
    depth each stands at."""
    doc = copy.deepcopy(_template(dtype, compressor))
    doc["shape"] = _SHAPE[1:-1]
    doc["chunk_grid"]["configuration"]["chunk_shape"] = _CHUNKS[1:-1]
    text = _dump(doc).decode()
    return text, (_depth(text, _SHAPE), _depth(text, _CHUNKS))


def _depth(text: str, marker: str) -> int:
    """The indentation depth (two spaces a level) of the line ``marker`` stands on."""
    line = text[text.rindex("\n", 0, text.index(marker)) + 1:]
    return (len(line) - len(line.lstrip(" "))) // 2


def _list(values: tuple[int, ...], depth: int) -> str:
    """``values`` as `_dump` writes a list of ints whose key stands at ``depth``."""
    return json.dumps([int(n) for n in values], indent=2).replace("\n", "\n" + "  " * depth)


def group(attributes: Mapping | None = None) -> bytes:
    """A group's document with ``attributes`` (JSON values), on one line: Python's indented JSON encoder is
    pure Python, about 0.6 ms for a golden's root document (its metadata and manifest) on this project's CPUs
    and three times that on an H200 host, where the recording waits for it; the unindented one is C, about 7
    times faster. zarr reads either, and no file in a golden's manifest is a group's but its K groups', whose
    bytes are hashed as written."""
    return json.dumps({"attributes": dict(attributes or {}), "zarr_format": 3, "node_type": "group"}).encode()


def _dump(doc: dict) -> bytes:
    return json.dumps(doc, indent=2).encode()  # as zarr writes it (NaN included)

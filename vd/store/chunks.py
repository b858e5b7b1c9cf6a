"""Reading one zarr array of a golden: its ``zarr.json`` and its chunks, each checked.

Arrays vd writes (a plain numeric dtype, chunks along the first axis, default ``/`` chunk keys, bytes
little-endian, optionally Zstd or Blosc, then CRC32C) are read straight from their keys through the
golden's `vd.store.location.Location`: a chunk's bytes, its CRC32C checked, decoded. That is the same for
a directory, a zip file and an object store, costs no event-loop round trip (a GPU replay reads the small
arrays while its model loads: `vd.store.prefetch`), and refuses a missing chunk instead of
reading zeros as zarr 3.1 does. Any other array (a golden rewritten by another zarr tool) is read
through zarr itself, with its chunks counted first.
"""

from __future__ import annotations

import json

import google_crc32c
import numcodecs
import numpy as np
import zarr

from vd.chunkfiles import chunk_key as chunk_key
from vd.chunkfiles import encode_chunk as encode_chunk
from vd.errors import GoldenCorruptError
from vd.store.location import Location

_PLAIN_TYPES = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                "float32", "float64"}
_CHAINS = {("bytes", "crc32c"): None, ("bytes", "zstd", "crc32c"): "zstd", ("bytes", "blosc", "crc32c"): "blosc"}


def node(location: Location, rel: str, where: str) -> dict:
    """The ``zarr.json`` document of the node at ``rel`` (``""``: the root)."""
    data = location.get(f"{rel}/zarr.json" if rel else "zarr.json")
    if data is None:
        raise GoldenCorruptError(f"{where} is missing")
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise GoldenCorruptError(f"{where}/zarr.json is unreadable: {str(e).splitlines()[0]}") from e
    if not isinstance(doc, dict):
        raise GoldenCorruptError(f"{where}/zarr.json is not a JSON object")
    return doc


class Array:
    """One array of a golden at ``rel`` under its location, read along its first axis."""

    def __init__(self, location: Location, rel: str, where: str):
        self.location, self.rel, self.where = location, rel, where
        doc = node(location, rel, where)
        if doc.get("node_type") != "array":
            raise GoldenCorruptError(f"{where} is not an array")
        plain = _plain(doc)
        self.direct = plain is not None
        if plain is not None:
            self.shape, self.dtype, self.chunk, self.codec = plain
        else:
            arr = self._zarr()
            self.shape, self.dtype, self.chunk, self.codec = arr.shape, arr.dtype, arr.chunks, None
            if arr.nchunks_initialized != arr.nchunks:  # zarr would read a missing chunk back as zeros
                raise GoldenCorruptError(f"{where}: {arr.nchunks - arr.nchunks_initialized} of {arr.nchunks} "
                                         "chunks are missing")
        self.step = self.chunk[0] if self.chunk else 1

    def _zarr(self) -> zarr.Array:
        try:
            return zarr.open_array(self.location.store(), path=self.rel, mode="r")
        except Exception as e:  # metadata zarr cannot parse
            raise GoldenCorruptError(f"{self.where}/zarr.json is not array metadata: {str(e).splitlines()[0]}") from e

    def check(self, shape: tuple[int, ...], dtype: np.dtype) -> Array:
        """Refuse an array whose shape or dtype is not the golden's."""
        if tuple(self.shape) != tuple(shape):
            raise GoldenCorruptError(f"{self.where}: shape {tuple(self.shape)}, expected {tuple(shape)}")
        if self.dtype != dtype:
            raise GoldenCorruptError(f"{self.where}: dtype {self.dtype}, expected {dtype}")
        return self

    def read(self, i: int = 0, j: int | None = None) -> np.ndarray:
        """Rows ``i:j`` along the first axis (the whole array by default), every chunk they touch checked."""
        j = self.shape[0] if j is None else j
        if not self.direct:
            try:
                return np.asarray(self._zarr()[i:j])
            except Exception as e:  # checksum mismatch, truncated or undecodable chunk bytes
                raise GoldenCorruptError(f"{self.where}: cannot read its chunks: {str(e).splitlines()[0]}") from e
        if not self.shape or not self.shape[0]:
            return np.empty(self.shape, self.dtype)
        first, last = i // self.step, (max(j, i + 1) - 1) // self.step
        parts = [self._chunk(c) for c in range(first, last + 1)]
        whole = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return whole[i - first * self.step:j - first * self.step]

    def _chunk(self, index: int) -> np.ndarray:
        """Chunk ``index`` (along the first axis) decoded: ``[step, ...]`` values."""
        key = chunk_key(index, len(self.shape))
        data = self.location.get(f"{self.rel}/{key}")
        if data is None:
            raise GoldenCorruptError(f"{self.where}: chunk {key} is missing")
        if len(data) < 4 or google_crc32c.value(data[:-4]) != int.from_bytes(data[-4:], "little"):
            raise GoldenCorruptError(f"{self.where}: chunk {key} fails its CRC32C checksum")
        want = self.step * int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        try:
            raw = (data[:-4] if self.codec is None else numcodecs.Zstd().decode(data[:-4]) if self.codec == "zstd"
                   else numcodecs.Blosc().decode(data[:-4]))
        except Exception as e:  # undecodable bytes
            raise GoldenCorruptError(f"{self.where}: cannot decode chunk {key}: {str(e).splitlines()[0]}") from e
        if len(raw) != want:
            raise GoldenCorruptError(f"{self.where}: chunk {key} holds {len(raw)} bytes, expected {want}")
        return np.frombuffer(bytearray(raw), dtype=self.dtype).reshape(self.step, *self.shape[1:])  # writable


def _plain(doc: dict) -> tuple[tuple[int, ...], np.dtype, tuple[int, ...], str | None] | None:
    """Shape, dtype, chunk shape and compressor of array metadata as vd writes it (`Array`), read from
    its ``zarr.json`` document; None for anything else."""
    try:
        grid, codecs = doc["chunk_grid"], doc["codecs"]
        if (doc.get("zarr_format") != 3 or doc["data_type"] not in _PLAIN_TYPES or grid["name"] != "regular"
                or doc.get("storage_transformers")
                or doc["chunk_key_encoding"] != {"name": "default", "configuration": {"separator": "/"}}):
            return None
        shape = tuple(int(x) for x in doc["shape"])
        chunk = tuple(int(x) for x in grid["configuration"]["chunk_shape"])
        names = tuple(c["name"] for c in codecs)
        if (len(chunk) != len(shape) or any(c < 1 for c in chunk) or any(n < 0 for n in shape)
                or chunk[1:] != shape[1:] or names not in _CHAINS
                or codecs[0].get("configuration", {}).get("endian", "little") != "little"):
            return None
        return shape, np.dtype(doc["data_type"]).newbyteorder("<"), chunk, _CHAINS[names]
    except (KeyError, TypeError, ValueError, AttributeError):
        return None

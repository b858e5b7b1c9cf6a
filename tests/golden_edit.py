"""Editing a golden on disk as the tests need: its rows (as a recording whose model computed other values
would store them, digests and all, or behind its digests' back), its chunk files and its metadata."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zarr

from vd.digest import summarise
from vd.dtypes import to_tensor
from vd.layout import RowLayout
from vd.store import format as F
from vd.store import manifest, open_golden


def chunk(golden: Path, k: int, name: str = "logits", index: int = 0, plane: str = "hi") -> Path:
    """The file of chunk ``index`` (along the first axis) of K's row array ``name``'s ``plane``."""
    arr = Path(golden) / f"k{k}" / f"{name}.{plane}"
    ndim = len(json.loads((arr / "zarr.json").read_text())["shape"])
    return arr.joinpath("c", str(index), *("0" * (ndim - 1)))


def edit_rows(golden: Path, k: int, kind: str, edit: Callable[[np.ndarray], None], *, digests: bool = True,
              sealed: bool = True) -> None:
    """Apply ``edit`` in place to K's rows of ``kind`` as stored (``[R, V]``; bf16 as uint16 bits) and write
    them back; with ``digests``, also that K's digests and statistics, as a recording would have them; with
    ``sealed``, the manifest and ID as well (a golden written so; without it, a golden damaged after)."""
    g = open_golden(golden)
    rows = g.all_rows(k)
    edit(rows[kind])
    root = zarr.open_group(zarr.storage.LocalStore(golden), mode="r+")
    arrays = _arrays(RowLayout(len(g.prompt), g.info.steps, k, g.info.drafted), rows, g.info.vocab)
    for name in F.ROW_ARRAYS[kind]:
        hi, lo = F.split_planes(arrays[name])
        root[f"k{k}/{name}.hi"][...] = hi
        root[f"k{k}/{name}.lo"][...] = lo
    if digests:
        d, s = summarise({n: to_tensor(a) for n, a in rows.items()})
        root[f"k{k}/digests"][...] = d
        root[f"k{k}/stats"][...] = s
    if sealed:
        edit_meta(golden, lambda m: None)


def _arrays(layout: RowLayout, rows: dict[str, np.ndarray], vocab: int) -> dict[str, np.ndarray]:
    """Rows by kind as the row arrays that store them, by name (`vd.store.format.row_shapes`)."""
    s, k = layout.steps, layout.k
    out = {"prefill": rows["prefill"], "logits": rows["verify"].reshape(s, k, vocab)}
    if "draft" in rows:
        out.update(bootstrap_logits=rows["draft"][:1], draft_logits=rows["draft"][1:].reshape(s, k - 1, vocab))
    return out


def _reseal(golden: Path, meta: dict) -> None:
    """The manifest and ID of a golden whose files or metadata were edited, as a writer would make them."""
    meta["manifest"] = manifest.build(Path(golden))
    meta["golden_id"] = manifest.golden_id(meta)


def edit_meta(golden: Path, change: Callable[[dict], None], *, sealed: bool = True) -> None:
    """Apply ``change`` to the golden's vd metadata (its root ``zarr.json``), bypassing every check. With
    ``sealed`` (and a golden that has an ID, format 6), the manifest and ID are made again as a writer would
    (unless ``change`` set them itself): a golden written with this metadata; without it, one edited after."""
    path = Path(golden) / "zarr.json"
    doc = json.loads(path.read_text())
    meta = doc["attributes"]["vd"]
    before = (meta.get("manifest"), meta.get("golden_id"))
    change(meta)
    if sealed and before[1] is not None and isinstance(meta, dict) \
            and (meta.get("manifest"), meta.get("golden_id")) == before:
        _reseal(golden, meta)
    path.write_text(json.dumps(doc))


def restate_content(golden: Path) -> None:
    """Set the golden's content digest (and its history's last version's) to what its logs, row digests and model
    now make, the manifest and ID made again: a golden edited and resealed whole, which vouches for itself (only a
    pin, kept elsewhere, tells it from the one recorded)."""
    g = open_golden(golden, sizes=False)
    content = g.content_digest()
    g.close()

    def restate(m: dict) -> None:
        m["content_digest"] = m["history"][-1]["content_digest"] = content

    edit_meta(golden, restate)


def flip_byte(path: Path, mask: int = 0x10) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= mask
    path.write_bytes(bytes(data))


def damage(path: Path, how: str) -> None:
    """Damage a chunk file: ``flip`` a byte, ``truncate`` it, ``delete`` it, or put a ``directory`` in its
    place."""
    if how == "flip":
        flip_byte(path)
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[:3])
    else:
        path.unlink()
        if how == "directory":
            path.mkdir()


def files(root: Path) -> dict[str, bytes]:
    """Every file of a golden directory by its path inside it, with its bytes (what git would compare)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}

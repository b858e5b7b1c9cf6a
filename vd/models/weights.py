"""A cache of converted weights, so that a GGUF checkpoint is dequantised once per machine, not per process.

Loading a ``.gguf`` file makes transformers dequantise every tensor (about 18–22 s for the default SmolLM2
on a 2-core CPU). The first load of a file in a dtype stores the result as an ordinary checkpoint folder
(``model.safetensors``, ``config.json``, the tokenizer's files, ``entry.json``); every later load of the
same file in that dtype reads that folder, memory-mapped by safetensors (about 0.6 s).

* **Keyed by content**: an entry's name is the SHA-256 of the GGUF file's bytes, with the dtype, the
  transformers version (which does the conversion) and this cache's format, so a changed file or another
  transformers is another entry, never a stale one. The file's hash is remembered by its path, size,
  modification time and inode (``index.json``), so an unchanged file is not hashed again.
* **Never trusted for identity**: a model loaded from an entry is fingerprinted from the weights it
  holds, as any other model (`vd.models.fingerprint.fingerprint`, computed anyway), and that must equal the
  fingerprint stored with the entry when it was written; a damaged entry (one flipped byte) is
  discarded and the file converted again.
* **Where**: ``$VD_CACHE_DIR``, else ``$XDG_CACHE_HOME/vd``, else ``~/.cache/vd``; ``VD_CACHE=off`` turns
  it off. An entry is written to a temporary folder and renamed into place, so concurrent processes
  never see half of one; a cache that cannot be written is skipped (the model loads as without it).
  ``vd cache info`` lists the entries, ``vd cache clear`` removes them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

FORMAT = 1
_INDEX = "index.json"


def root() -> Path | None:
    """The cache's folder (not created here); None when ``VD_CACHE=off``."""
    if os.environ.get("VD_CACHE", "").lower() in ("off", "0", "no", "false"):
        return None
    if os.environ.get("VD_CACHE_DIR"):
        return Path(os.environ["VD_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vd"


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def file_hash(path: Path, where: Path | None) -> str:
    """The SHA-256 of ``path``'s bytes, remembered in the cache's index by the file's path and stat."""
    index = where / _INDEX if where is not None else None
    known = {}
    if index is not None:
        with contextlib.suppress(OSError, ValueError):
            known = json.loads(index.read_text())
    key = _stat_key(path)
    if isinstance(known, dict) and isinstance(known.get(key), str):
        return known[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()
    if index is not None:
        with contextlib.suppress(OSError):
            known = {**(known if isinstance(known, dict) else {}), key: digest}
            _write_atomic(index, json.dumps(known, indent=1).encode())
    return digest


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@dataclass(frozen=True)
class Entry:
    """One converted checkpoint in the cache."""

    path: Path
    source: str
    dtype: str
    transformers: str
    created: str
    nbytes: int
    last_used: float

    @property
    def name(self) -> str:
        return self.path.name


def entry_path(gguf: Path, dtype: str) -> Path | None:
    """Where the converted form of ``gguf`` in ``dtype`` lives (present or not); None with the cache off."""
    where = root()
    if where is None:
        return None
    import transformers

    digest = file_hash(gguf, where)
    key = hashlib.sha256(f"{digest}|{dtype}|{transformers.__version__}|{FORMAT}".encode()).hexdigest()[:32]
    return where / "weights" / key


def ready(entry: Path | None) -> bool:
    """Whether the entry is complete (its ``entry.json`` is written last, inside the renamed folder)."""
    if entry is None or not (entry / "entry.json").is_file():
        return False
    with contextlib.suppress(OSError):
        os.utime(entry / "entry.json")  # last used, for `vd cache info`
    return True


def stored_fingerprint(entry: Path) -> str | None:
    """The fingerprint the entry's weights had when it was written (`vd.models.fingerprint.fingerprint`)."""
    try:
        return json.loads((entry / "entry.json").read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def discard(entry: Path) -> None:
    """Remove a damaged entry (its weights no longer hash to its fingerprint)."""
    gone = entry.parent / f".{entry.name}.discarded-{os.getpid()}"
    with contextlib.suppress(OSError):
        os.rename(entry, gone)  # one step: no process sees half of it
    shutil.rmtree(gone, ignore_errors=True)


def store(entry: Path, model, tokenizer, source: Path, dtype: str, fingerprint: str) -> bool:
    """Write ``model`` (an HF causal LM as converted from ``source``) and its tokenizer as ``entry``; False
    (and nothing left) where the cache cannot be written."""
    import transformers
    from safetensors.torch import save_model

    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the weights are plain tensors now
        (tmp / "config.json").write_text(json.dumps(config, indent=1, default=str))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        info = {"format": FORMAT, "source": str(source), "dtype": dtype, "transformers": transformers.__version__,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "fingerprint": fingerprint}
        (tmp / "entry.json").write_text(json.dumps(info, indent=1))
        try:
            os.rename(tmp, entry)
        except OSError:  # another process wrote it first: theirs is as good
            shutil.rmtree(tmp, ignore_errors=True)
        return True
    except OSError:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return False


def entries() -> list[Entry]:
    """Every complete entry of the cache, most recently used first."""
    where = root()
    folder = where / "weights" if where is not None else None
    out = []
    for d in sorted(folder.iterdir()) if folder is not None and folder.is_dir() else ():
        info_file = d / "entry.json"
        if d.name.startswith(".") or not info_file.is_file():
            continue
        try:
            info = json.loads(info_file.read_text())
        except (OSError, ValueError):
            info = {}
        nbytes = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        out.append(Entry(d, str(info.get("source", "?")), str(info.get("dtype", "?")),
                         str(info.get("transformers", "?")), str(info.get("created", "?")), nbytes,
                         info_file.stat().st_mtime))
    return sorted(out, key=lambda e: -e.last_used)


def clear() -> tuple[int, int]:
    """Remove every entry (and the hash index); how many entries and bytes were removed."""
    where = root()
    if where is None or not where.is_dir():
        return 0, 0
    gone = entries()
    shutil.rmtree(where / "weights", ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        (where / _INDEX).unlink()
    return len(gone), sum(e.nbytes for e in gone)

"""Reading a golden (`open_golden`): its metadata checked, then each K's step log, digests, statistics and
rows on demand, every read checked.

Opening reads only the root ``zarr.json``, whose metadata carries the prompt's tokens and each K's step
log, so a replay can start at once; the arrays those copies came from are read and compared with them
before a K is judged (`Golden.checked_log`). A K's comparison side (`vd.store.side.GoldenSide`) needs
its rows' digests and statistics; a golden written before format 3 (or with a digest scheme this vd does
not compute) has none stored, and they are computed here from its rows. Rows are read only where asked
for, from the golden itself or, for a slim golden, from the full golden named as its rows' source.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from vd import digest as _digest
from vd.dtypes import to_tensor
from vd.errors import GoldenCorruptError, GoldenError, GoldenNotFoundError, NotAGoldenError, UsageError
from vd.layout import RowLayout, StepLog, accepted
from vd.preflight import golden_meta
from vd.store import atomic, manifest
from vd.store import format as F
from vd.store.chunks import Array, node
from vd.store.location import Directory, Location, locate
from vd.store.schema import Info, check_meta, check_run
from vd.store.side import GoldenSide, check_digests, stats_differ


class Golden:
    """An opened golden: its location, metadata (``meta``, checked as ``info``) and prompt tokens, and each
    K's step log, digests, statistics and rows read when first asked for (in the caller's thread)."""

    def __init__(self, location: Location, meta: Mapping, info: Info, prompt: list[int],
                 listed: Mapping[str, list] | None = None):
        self.location, self.meta, self.info, self.prompt = location, meta, info, prompt
        self.manifest = listed  # every file's size and hash (format 6), checked by `check_files`
        self.url = location.url
        self._source: Golden | None = None  # a slim golden's full golden (`with_rows`)
        self._cache: dict = {}

    @property
    def rows_source(self) -> Golden | None:
        """Where this golden's rows are read from: itself, the full golden a slim one names, or None."""
        return self if self.info.rows_stored else self._source

    @property
    def ks(self) -> list[int]:
        """The verify widths."""
        return list(self.info.ks)

    @property
    def groups(self) -> list[int]:
        """Every K group stored: the verify widths, then the decode rows' (`vd.store.format.DECODE_K`) where
        recorded (format 7)."""
        return list(self.info.groups)

    @property
    def decoded(self) -> bool:
        """Whether the golden stores its greedy continuation's decode rows (the ``DECODE_K`` group)."""
        return self.info.decode_steps is not None

    @property
    def logical(self) -> str:
        return self.info.dtype.name

    @property
    def slim(self) -> bool:
        return not self.info.rows_stored

    @property
    def history(self) -> list:
        """The golden's history entries, oldest first (`vd.store.history`; empty before format 5)."""
        h = self.meta.get("history")
        return list(h) if isinstance(h, list) else []

    def content_digest(self) -> str:
        """What the golden's numbers are, as one digest (`vd.store.format.content_digest`), computed from its
        step logs and row digests."""
        def make():
            return F.content_digest(self.meta, self.prompt, {k: self.checked_log(k) for k in self.groups},
                                    {k: self.summary(k)[0] for k in self.groups})
        return self._once("content", make)

    def where(self, k: int) -> str:
        return f"{self.url}/k{k}"

    def layout(self, k: int) -> RowLayout:
        return RowLayout(len(self.prompt), self.info.steps_of(k), k, self.info.drafted_at(k))

    def _once(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    # -- step logs ------------------------------------------------------------------------------------
    def log(self, k: int) -> StepLog:
        """K's step log: the metadata's copy (no array read), or the arrays' where the metadata has none."""
        return self._once(("log", k), lambda: self.meta_logs().get(k) or self.checked_log(k))

    def meta_logs(self) -> dict[int, StepLog]:
        return self._once("meta_logs", lambda: meta_logs(self.meta))

    def array(self, rel: str, shape: tuple[int, ...], dtype: np.dtype) -> Array:
        """The array at ``rel`` (``prompt``, ``k2/tokens``, ...), its shape and dtype checked."""
        return Array(self.location, rel, f"{self.url}/{rel}").check(shape, dtype)

    def small(self, k: int, name: str) -> np.ndarray:
        """K's small array ``name`` (`vd.store.format.small_shapes`)."""
        return self.array(f"k{k}/{name}", F.small_shapes(self.layout(k))[name], F.SMALL_DTYPES[name]).read()

    @property
    def decode_forward(self) -> str | None:
        """The forward that computed the golden's decode rows where it is another than its own (``decode.forward``:
        `vd record --decode-forward`), else None."""
        return (self.meta.get("decode") or {}).get("forward")

    @property
    def traced(self) -> bool:
        """Whether the golden holds module traces (``vd record --trace``)."""
        return self.meta.get("trace") is not None

    def traced_at(self, k: int) -> bool:
        """Whether group ``k`` holds module traces: every K of a traced golden, its decode rows where they were
        traced too (``trace.decode``: goldens recorded with ``--trace`` since the decode rows were)."""
        return self.traced and (k != F.DECODE_K or "decode" in self.meta["trace"])

    def trace_points(self, k: int | None = None) -> list[tuple[str, str]]:
        """The points traced at every K (``k`` None or a K), or at the decode rows (``k`` the decode group)."""
        trace = self.meta["trace"]
        return [(n, w) for n, w in trace["decode" if k == F.DECODE_K else "points"]]

    def trace(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """K's (or the decode rows') module traces: digests ``int64 [T, M, 6]`` and statistics ``float32 [T, M,
        2]``, ``T`` its prefill, bootstrap (drafter feed) and verify rows in call order, ``M`` its traced points."""
        digests, stats = self._trace_arrays(k)
        return digests.read(), stats.read()

    def _trace_arrays(self, k: int) -> tuple[Array, Array]:
        """Group ``k``'s two trace arrays, there and of their shapes and dtypes (their documents read, no chunk)."""
        lay, m = self.layout(k), len(self.trace_points(k))
        rows = lay.prompt + (1 if lay.drafted else 0) + lay.steps * lay.k
        return (self.array(f"k{k}/{F.TRACE_DIGESTS}", (rows, m, 6), np.dtype("<i8")),
                self.array(f"k{k}/{F.TRACE_STATS}", (rows, m, 2), np.dtype("<f4")))

    def check_traces(self) -> None:
        """The module traces the metadata claims there, of their shapes (a replay reads none of them, and would
        pass a golden that lost them), and none it does not claim."""
        listed = self.manifest or {}
        for k in self.groups:
            if self.traced_at(k):
                self._trace_arrays(k)
            elif f"k{k}/{F.TRACE_DIGESTS}/zarr.json" in listed or f"k{k}/{F.TRACE_STATS}/zarr.json" in listed:
                raise GoldenCorruptError(f"{self.url}/k{k} holds module traces its metadata does not declare "
                                         "(trace" + (".decode" if k == F.DECODE_K and self.traced else "") + ")")

    def stored_prompt(self) -> list[int]:
        """The prompt array, checked against the metadata's copy of it."""
        def read():
            stored = self.array("prompt", (len(self.prompt),), np.dtype("<i4")).read().astype(np.int64).tolist()
            if stored != self.prompt:
                raise GoldenCorruptError(f"{self.url}: the prompt in the metadata disagrees with the stored prompt "
                                         "array")
            return stored
        return self._once("prompt", read)

    def log_from(self, k: int, arrays: Mapping[str, np.ndarray]) -> StepLog:
        """K's step log from its group's attributes and step log arrays, checked against the metadata's copy,
        the prompt and the accept counts' range."""
        attrs = self.k_attrs(k)
        copy = self.meta_logs().get(k)
        if "step_ms" not in arrays:  # format 5 keeps timings with the run's other volatile facts
            arrays = {**arrays, "step_ms": np.zeros(0) if copy is None else copy.step_ms}
        log = StepLog(k=k, bootstrap=attrs.get("bootstrap", -1), decoded=attrs.get("decoded"),
                      committed_is_greedy=attrs.get("committed_is_greedy"), **{n: arrays[n] for n in F.STEP_LOG})
        if not isinstance(log.bootstrap, int) or not 0 <= log.bootstrap < self.info.vocab:
            raise GoldenCorruptError(f"{self.where(k)}: bootstrap token {log.bootstrap!r} is not in the vocabulary")
        if ((log.accepted < 0) | (log.accepted > k - 1)).any():
            raise GoldenCorruptError(f"{self.where(k)}/accepted: counts outside 0..{k - 1}")
        if ((log.tokens < 0) | (log.tokens >= self.info.vocab)).any():
            raise GoldenCorruptError(f"{self.where(k)}/tokens: token ids outside the vocabulary")
        if copy is not None and not copy.same_steps(log):
            raise GoldenCorruptError(f"{self.where(k)}: the step log in the metadata disagrees with the stored arrays")
        self.stored_prompt()
        return log

    def k_attrs(self, k: int) -> Mapping:
        return self._once(("attrs", k), lambda: node(self.location, f"k{k}", self.where(k)).get("attributes") or {})

    def checked_log(self, k: int) -> StepLog:
        """K's step log as stored in its arrays, checked (`log_from`)."""
        names = F.step_log_arrays(self.info.version)
        return self._once(("checked", k), lambda: self.log_from(k, {n: self.small(k, n) for n in names}))

    # -- digests, statistics and rows -----------------------------------------------------------------
    def summary(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """K's rows' digests and statistics: as stored, or for a golden without digests this vd computes,
        computed from its rows."""
        def make():
            if self.info.digested:
                return self.small(k, "digests"), self.small(k, "stats")
            return _digest.summarise({kind: to_tensor(a) for kind, a in self.all_rows(k).items()})
        return self._once(("summary", k), make)

    def side(self, k: int, log: StepLog | None = None, summary: tuple[np.ndarray, np.ndarray] | None = None
             ) -> GoldenSide:
        """K's comparison side (made once): its checked step log, digests and statistics, and its rows when
        the golden has a source of them. ``log`` and ``summary`` when already read (`vd.store.prefetch`)."""
        def make():
            source = self.rows_source
            load = None if source is None else (lambda kind, idx: source.read_rows(k, kind, idx))
            d, s = summary if summary is not None else self.summary(k)
            return GoldenSide(log if log is not None else self.checked_log(k), self.layout(k), self.info.vocab, d, s,
                              load, self.where(k), logical=self.logical)
        return self._once(("side", k), make)

    def read_rows(self, k: int, kind: str, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` of ``kind`` as stored in this golden's own arrays (only the chunks holding them)."""
        layout, storage = self.layout(k), self.info.dtype.storage
        out = np.empty((len(idx), self.info.vocab), storage)
        held: dict[tuple[str, int], np.ndarray] = {}
        for i, r in enumerate(np.asarray(idx).tolist()):
            name, a0, within = F.row_address(layout, kind, r)
            if (name, a0) not in held:
                held[(name, a0)] = self._row_block(k, name, a0)
            block = held[(name, a0)]
            out[i] = block if within is None else block[within]
        return out

    def _row_arrays(self, k: int, name: str) -> tuple[Array, ...]:
        """Row array ``name`` of K: its two planes (format 4) or itself (earlier formats), checked."""
        def make():
            layout = self.layout(k)
            shape, storage = F.row_shapes(layout, self.info.vocab)[name], self.info.dtype.storage
            if self.info.version < F.PLANES_SINCE:
                return (self.array(f"k{k}/{name}", shape, storage),)
            hi, lo = F.planes(name)
            return (self.array(f"k{k}/{hi}", shape, np.dtype("u1")),
                    self.array(f"k{k}/{lo}", (*shape, storage.itemsize - 1), np.dtype("u1")))
        return self._once(("rows", k, name), make)

    def _row_block(self, k: int, name: str, a0: int) -> np.ndarray:
        """Entry ``a0`` along row array ``name``'s first axis, as stored."""
        arrays = self._row_arrays(k, name)
        parts = [a.read(a0, a0 + 1)[0] for a in arrays]
        return parts[0] if len(parts) == 1 else F.join_planes(parts[0], parts[1], self.info.dtype.storage)

    def all_rows(self, k: int) -> dict[str, np.ndarray]:
        """Every row of K by kind, as stored, read whole (not checked against digests: `verify_rows`)."""
        if self.rows_source is not self:
            raise GoldenError(f"{self.url} is slim: it stores no rows")
        whole = {}
        for name in F.row_array_names(self.info.drafted_at(k)):
            arrays = self._row_arrays(k, name)
            parts = [a.read() for a in arrays]
            whole[name] = parts[0] if len(parts) == 1 else F.join_planes(parts[0], parts[1], self.info.dtype.storage)
        return F.from_arrays(whole, self.info.vocab)

    def verify_rows(self, k: int) -> dict[str, np.ndarray]:
        """Every row of K read whole and each checked against its stored digest and statistics (`vd show`,
        `vd diff`, `vd verify`)."""
        rows = self.all_rows(k)
        if self.info.digested:
            layout = self.layout(k)
            digests, stats = _digest.summarise({kind: to_tensor(a) for kind, a in rows.items()})

            def name(i: int) -> str:
                for kind, n in layout.counts.items():
                    if i < n:
                        return f"{kind} row {i}"
                    i -= n
                return f"row {i}"
            stored_digests, stored_stats = self.summary(k)
            check_digests(digests, stored_digests, self.where(k), name)
            differ = stats_differ(stats, stored_stats)
            if differ.any():
                raise GoldenCorruptError(f"{self.where(k)}/stats: {int(differ.sum())} row(s) disagree with the stored "
                                         f"rows (first: {name(int(np.flatnonzero(differ)[0]))})")
        return rows

    def check_files(self) -> None:
        """Every stored byte checked (``vd verify``, and a replay on a thread beside its model): against the
        manifest since format 6; before it, every chunk against its checksum and every row against its digest
        (formats 1 and 2 have checksums only). The full golden a slim one reads its rows from is checked too."""
        if self.manifest is not None:
            for key in self.manifest:
                self.check_file(key)
            self.check_traces()
        else:
            self.check_contents()
        if self.rows_source is not None and self.rows_source is not self:
            self.rows_source.check_files()

    def check_whole(self) -> None:
        """Everything `vd verify` checks: every file (`check_files`), then the contents (`check_contents`), which
        before format 6 (no manifest) `check_files` has checked already."""
        self.check_files()
        if self.manifest is not None:
            self.check_contents()

    def check_contents(self) -> None:
        """Every K's stored step log checked (against the metadata's copy, the vocabulary and the accept-count
        range), every row against its digest (a slim golden: its digests and statistics read), a traced golden's
        module traces there and of their shape, and the prompt array against its copy."""
        self.stored_prompt()
        for k in self.groups:
            self.checked_log(k)
            if self.traced_at(k):
                self.trace(k)  # (their chunks read and checked too)
            if self.slim:
                self.summary(k)
            else:
                self.verify_rows(k)
            self._check_accepts(k)
        stored = self.meta.get("content_digest")
        if stored is not None and stored != self.content_digest():
            raise GoldenCorruptError(f"{self.url}: metadata field 'content_digest' is {stored}, not what its step "
                                     f"logs and row digests make ({self.content_digest()})")

    def _check_accepts(self, k: int) -> None:
        """K's accept counts against its verify rows' argmaxes (as stored beside their digests): each the drafts
        that stand where the row before each is its argmax (`vd.layout.accepted`), as the recording counted them. Not
        a candidate's, which keeps the golden's counts; nor at a row whose largest |logit| is not finite."""
        if "candidate" in self.meta:
            return
        log = self.checked_log(k)
        stats = self.layout(k).split(self.summary(k)[1])["verify"]  # (not `side`: it would hold this golden)
        top = stats[:, _digest.STATS.index("argmax")].astype(np.int64)
        finite = np.isfinite(stats[:, _digest.STATS.index("absmax")])
        for s, (tokens, n) in enumerate(zip(log.tokens.tolist(), log.accepted.tolist())):
            rows = slice(s * k, s * k + k)
            if finite[rows].all() and accepted(tokens, top[rows].tolist()) != n:
                raise GoldenCorruptError(f"{self.where(k)}: step {s} accepted {n} draft(s) of {tokens}, and its rows' "
                                         f"argmaxes {top[rows].tolist()} accept {accepted(tokens, top[rows].tolist())}")

    def check_sizes(self) -> None:
        """Every file the manifest lists there at its size, and no other (`vd.store.manifest.check_sizes`): what
        `open_golden` checks unless told not to (a replay's reader checks it first, while the model loads)."""
        if self.manifest is not None:
            manifest.check_sizes(self.location.sizes(), self.manifest, self.url, self.location.get)

    def check_file(self, key: str) -> None:
        """One file of the manifest read and checked against its size and hash (one it does not list: refused)."""
        listed = None if self.manifest is None else self.manifest.get(key)
        if listed is None:  # a file the metadata names (``compiled``) that no manifest lists
            raise GoldenCorruptError(f"{self.url}/{key} is not in the golden's manifest")
        manifest.check_hashes(self.location.get, {key: listed}, self.url)

    def close(self) -> None:
        """Let go of the golden's files (and its rows' source's): a refresh may then remove this version."""
        self.location.close()
        if self.rows_source is not None and self.rows_source is not self:
            self.rows_source.close()

    def with_rows(self, source: Golden) -> Golden:
        """This (slim) golden with its rows read from ``source``, the full golden it was made from: the same
        recording, row for row (every K's digests equal)."""
        if not self.slim:
            raise UsageError(f"--rows names the rows of a slim golden; {self.url} stores its own")
        if source.slim:
            raise GoldenError(f"--rows {source.url} is slim too: name the full golden")
        same = (source.prompt == self.prompt and source.info.groups == self.info.groups
                and source.info.steps == self.info.steps and source.info.vocab == self.info.vocab
                and source.logical == self.logical and source.info.feed == self.info.feed)
        if not same or any(not np.array_equal(source.summary(k)[0], self.summary(k)[0]) for k in self.groups):
            raise GoldenError(f"--rows {source.url} is not the golden {self.url} was made from (its rows' digests "
                              "differ)")
        self._source = source
        self._cache = {key: v for key, v in self._cache.items() if not (isinstance(key, tuple) and key[0] == "side")}
        return self


def recording_difference(a: Golden, b: Golden) -> str | None:
    """What two goldens' recordings asked differently (``steps (4 vs 5)``), None where they asked the same:
    the prompt's tokens, the verify widths, the steps, the vocabulary, the dtype and the feed."""
    checks: list[tuple[str, Any, Any]] = [("prompt tokens", a.prompt, b.prompt)] + [
        (key, a.meta.get(key), b.meta.get(key)) for key in ("k", "steps", "vocab_size", "dtype", "feed")]
    for what, x, y in checks:
        if x != y:
            shown = (f"{len(x)} vs {len(y)} tokens" if what == "prompt tokens" and len(x) != len(y)
                     else "they differ" if what == "prompt tokens" else f"{x} vs {y}")
            return f"{what} ({shown})"
    return None


def meta_logs(meta: Mapping) -> dict[int, StepLog]:
    """The step logs the metadata carries (``logs``), for a start without reading an array; a malformed
    entry is left out (the arrays are read instead)."""
    out = {}
    logs = meta.get("logs")
    for key, e in (logs.items() if isinstance(logs, Mapping) else ()):
        try:
            out[int(key)] = StepLog.from_json(int(key), e)
        except (KeyError, TypeError, ValueError):
            continue
    return out


def _run_meta(location: Location, url: str) -> Mapping:
    """The ``run`` group's volatile facts (format 5): empty where the group is absent."""
    doc = location.get(f"{F.RUN_GROUP}/zarr.json")
    if doc is None:
        return {}
    try:
        run = (json.loads(doc).get("attributes") or {}).get("vd_run")
        if not isinstance(run, Mapping):
            raise ValueError("no vd_run attributes")
    except (ValueError, AttributeError) as e:
        raise GoldenCorruptError(f"{url}/{F.RUN_GROUP}/zarr.json is unreadable: {str(e).splitlines()[0]}") from e
    check_run(run, url)
    return run


def content_digest_at(where: str | os.PathLike) -> str | None:
    """The content digest of the golden at ``where`` (opened, then let go), None where there is none; a golden
    that cannot be opened raises as `open_golden` does."""
    if locate(where).state() != "golden":
        return None
    g = open_golden(where)
    try:
        return g.content_digest()
    finally:
        g.close()


def open_golden(where: str | os.PathLike | Location, *, rows: str | os.PathLike | None = None,
                sizes: bool = True, volatile: bool = True) -> Golden:
    """Open the golden at ``where`` (a directory, a ``.zip`` file or an ``s3://`` URL) and check its metadata;
    raise a `vd.errors.GoldenError` subclass naming what is wrong. Only the root ``zarr.json`` is read here, and
    (``sizes``) the listing of its files checked against the manifest (`Golden.check_sizes`: a missing or
    truncated file, before any model; a replay leaves it to its reader, which checks it while the model loads).
    ``rows``: for a slim golden, the full golden to read its rows from (`Golden.with_rows`). ``volatile``: read the
    run group (format 5: times, host, step timings), refused where it is there but damaged; without it, the golden
    reads as one without the group (a refresh reading the version it replaces, for its history and settings)."""
    location = where if isinstance(where, Location) else locate(where)
    url = location.url
    if isinstance(location, Directory) and atomic.recover(location.target):  # a publish that died mid-way
        location.close()
    doc = location.get("zarr.json")
    if doc is None:
        state = location.state()
        if state == "absent":
            raise GoldenNotFoundError(f"{url} does not exist")
        if isinstance(location, Directory) and not location.path.is_dir():
            raise NotAGoldenError(f"{url} is not a vd golden (a golden is a zarr directory, a .zip file or an "
                                  "s3:// prefix)")
        raise NotAGoldenError(f"{url} is not a vd golden (no zarr.json)")
    meta = golden_meta(doc, url)
    version = meta.get("format_version")
    listed = None
    if isinstance(version, int) and F.MANIFEST_SINCE <= version <= F.FORMAT_VERSION:
        # The metadata as written, hashed to the golden's ID: first, so that an edited field is said to be an edit
        # (checked first, a field the edit made inconsistent was blamed: 'decode' for an edited 'steps').
        listed = manifest.check_meta(meta, url)
    info = check_meta(meta, url)
    if listed is not None and sizes:
        manifest.check_sizes(location.sizes(), listed, url, location.get)  # a missing or truncated file
    if info.version >= F.VOLATILE_SINCE and volatile:
        meta = F.join_volatile(meta, _run_meta(location, url))
    tokens = meta.get("prompt_tokens")
    if isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        prompt = list(tokens)
    else:
        prompt = Array(location, "prompt", f"{url}/prompt").read().astype(np.int64).tolist()
    if not prompt:
        raise GoldenCorruptError(f"{url}: the prompt is empty")
    golden = Golden(location, meta, info, prompt, listed)
    if rows is not None:
        golden.with_rows(open_golden(rows))
    return golden

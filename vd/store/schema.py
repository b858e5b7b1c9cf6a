"""What a golden's metadata may hold (`check_meta`), checked at open before any model is loaded: every field
vd reads, its type, its range and its agreement with the others, so a malformed or hand-edited golden is one
line naming the golden and the field (exit 2) rather than a traceback or a verdict.

Declared sizes are bounded (`LIMITS`) before anything is allocated from them. The step logs the metadata
carries are checked here too (tokens within the vocabulary, accept counts within 0..K-1, shapes); the arrays
they copy are checked against them when read (`vd.store.read.Golden.log_from`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeGuard, TypeVar

from vd.dtypes import DTYPES, LogitsDtype
from vd.errors import GoldenCorruptError, GoldenError, UsageError
from vd.outputs import brief
from vd.preflight import MAX_K
from vd.store import format as F

FEEDS = ("reference", "mtp")
DEVICES = ("cpu", "cuda")
# Bounds on what a golden may declare, checked before anything is allocated from it.
LIMITS = {"vocab_size": 1 << 22, "steps": 1 << 20, "prompt": 1 << 20}
_NAME = re.compile(r"^[A-Za-z0-9_.:+-]{1,64}$")  # a forward's name
_DETERMINISM = ("deterministic_algorithms", "cublas_workspace_config", "bf16_reduced_precision_reduction",
                "fp16_reduced_precision_reduction", "tf32_matmul", "cudnn_deterministic", "cudnn_benchmark")


@dataclass(frozen=True, slots=True)
class Info:
    """The metadata fields vd relies on, checked (`check_meta`); the rest stays in ``Golden.meta``."""

    version: int
    dtype: LogitsDtype
    ks: tuple[int, ...]
    steps: int
    vocab: int
    feed: str
    forward: str
    device: str
    digested: bool  # stores each row's digest in the scheme this vd computes
    rows_stored: bool  # False for a slim golden
    decode_steps: int | None = None  # the decode group's steps (`vd.store.format.DECODE_K`); None: not recorded

    @property
    def drafted(self) -> bool:
        return self.feed == "mtp"

    @property
    def groups(self) -> tuple[int, ...]:
        """The K groups the golden stores: each verify width, then the decode rows' (K = 1) where recorded."""
        return self.ks + ((F.DECODE_K,) if self.decode_steps is not None else ())

    def steps_of(self, k: int) -> int:
        """How many steps group ``k`` holds: the golden's steps, or the decode group's one-token decodes."""
        return self.decode_steps if k == F.DECODE_K and self.decode_steps is not None else self.steps

    def drafted_at(self, k: int) -> bool:
        """Whether group ``k`` holds draft rows: a verify width's of a drafter golden (never the decode group)."""
        return self.drafted and k != F.DECODE_K


_T = TypeVar("_T")


def _field(meta: Mapping, key: str, kind: type[_T], where: str, test: Callable[[_T], object] = lambda v: True,
           want: str = "") -> _T:
    v = meta.get(key)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool or not test(v):
        raise GoldenCorruptError(f"{where}: metadata field {key!r} is {_shown(v)}, expected {want or kind.__name__}")
    return v


def _shown(v: object, most: int = 200) -> str:
    """A metadata value in an error's one line: its repr, cut after ``most`` characters (a forged field can hold
    megabytes)."""
    r = repr(v)
    return r if len(r) <= most else f"{r[:most]}... ({len(r):,} characters)"


def _ints(v: object, low: int, high: int) -> TypeGuard[list[int]]:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and low <= x < high for x in v)


def check_meta(meta: Mapping, where: str) -> Info:
    """Refuse metadata a golden of a known version cannot have, naming the field; else its `Info`."""
    version = meta.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > F.FORMAT_VERSION:
        raise GoldenError(f"{where} has golden format {version}; this vd reads formats 1 to {F.FORMAT_VERSION}")
    version = _field(meta, "format_version", int, where, lambda v: v >= 1, f"1 to {F.FORMAT_VERSION}")
    if meta.get("complete") is not True:
        raise GoldenCorruptError(f"{where} is incomplete (its recording never finished)")
    logits = meta.get("logits")
    logical = logits.get("dtype") if isinstance(logits, Mapping) else None
    if not isinstance(logical, str) or logical not in DTYPES:
        raise GoldenCorruptError(f"{where}: unknown logits dtype {logical!r}")
    ks = _field(meta, "k", list, where, lambda v: v and all(isinstance(k, int) and not isinstance(k, bool)
                                                            and 2 <= k <= MAX_K for k in v) and len(set(v)) == len(v),
                f"distinct verify widths 2..{MAX_K}")
    steps = _field(meta, "steps", int, where, lambda v: 1 <= v <= LIMITS["steps"],
                   f"a step count of 1 to {LIMITS['steps']}")
    vocab = _field(meta, "vocab_size", int, where, lambda v: 2 <= v <= LIMITS["vocab_size"],
                   f"a vocabulary size of 2 to {LIMITS['vocab_size']}")
    feed = meta.get("feed", "reference")
    if feed not in FEEDS:
        raise GoldenCorruptError(f"{where}: metadata field 'feed' is {feed!r}, expected one of {', '.join(FEEDS)}")
    forward = _field(meta, "forward", str, where, lambda v: _NAME.match(v) is not None, "a forward's name")
    device = _field(meta, "device", str, where, lambda v: v in DEVICES, " or ".join(DEVICES))
    _check_typed(meta, where)
    _check_model(meta, feed, where)
    _check_settings(meta, logical, where)
    _check_tokens(meta, vocab, where)
    decode = _decode_steps(meta, version, steps, tuple(ks), where)
    trace = meta.get("trace")
    if isinstance(trace, Mapping) and "decode" in trace and decode is None:
        raise GoldenCorruptError(f"{where}: metadata field 'trace' lists decode-row points (trace.decode), but the "
                                 "golden stores no decode rows")
    _check_logs(meta, tuple(ks), steps, vocab, version >= F.MANIFEST_SINCE, where, decode)
    if version >= F.VOLATILE_SINCE:
        _check_written(meta, vocab, decode, where)
    scheme = meta.get("digest")
    digested = version >= F.DIGESTS_SINCE and scheme is not None and scheme == F.digest_meta(vocab, logical)
    rows_stored = F.stored_rows(meta)
    if not rows_stored and not digested:
        raise GoldenCorruptError(f"{where}: a slim golden without row digests this vd computes")
    return Info(version, DTYPES[logical], tuple(ks), steps, vocab, feed, forward, device, digested, rows_stored,
                decode)


def _decode_steps(meta: Mapping, version: int, steps: int, ks: tuple[int, ...], where: str) -> int | None:
    """The decode group's step count (``decode.steps``: the golden's steps times its widest K), None where the
    golden stores no decode rows (before format 7, or recorded without); ``decode.forward``, where present, the
    forward that computed them (another than the golden's)."""
    decode = meta.get("decode")
    if decode is None:
        return None
    want = steps * max(ks)
    if version < F.DECODE_SINCE or not isinstance(decode, Mapping) or decode.get("steps") != want \
            or not set(decode) <= {"steps", "forward"} or not isinstance(decode.get("forward", ""), str) \
            or decode.get("forward") in ("", meta.get("forward")):
        raise GoldenCorruptError(f"{where}: metadata field 'decode' is {_shown(decode)}, expected {{\"steps\": "
                                 f"{want}}} and, where another forward than the golden's computed its rows, "
                                 f"\"forward\": its name (format {F.DECODE_SINCE} and later)")
    return want


def _check_written(meta: Mapping, vocab: int, decode: int | None, where: str) -> None:
    """What a golden's writer puts there since format 5 (an edit with the golden ID made again could empty it, and
    `vd history` then said "no history: recorded before format 5"): a history of well-formed versions; and where
    present (a recording's; a golden written through the store's API may leave them out), the environment and the
    greedy continuation (one token past the decode rows' steps)."""
    history = meta.get("history")
    if not isinstance(history, list) or not history or not all(
            isinstance(e, Mapping) and e.get("version") == i + 1 and isinstance(e.get("reason"), str)
            and isinstance(e.get("content_digest"), str) and e["content_digest"].startswith("sha256:")
            for i, e in enumerate(history)):
        raise GoldenCorruptError(f"{where}: metadata field 'history' is {brief(history)}, expected its versions "
                                 "1, 2, ... each with its reason and content digest (format 5 and later)")
    broken = next((i for i in range(1, len(history)) if history[i].get("previous") != history[i - 1]["content_digest"]),
                  None)
    if broken is not None:  # each version names the one it replaced (a migration: its own content digest)
        raise GoldenCorruptError(f"{where}: metadata field 'history': version {broken + 1}'s previous content digest "
                                 f"is {brief(history[broken].get('previous'))}, not version {broken}'s")
    if meta.get("content_digest") != history[-1]["content_digest"]:
        raise GoldenCorruptError(f"{where}: metadata field 'content_digest' is {brief(meta.get('content_digest'))}, "
                                 "not its history's last version's")
    for key, test, want in (("environment", lambda v: isinstance(v, Mapping) and v, "the recording's environment"),
                            ("greedy", lambda v: _ints(v, 0, vocab) and len(v) >= 1
                             and (decode is None or len(v) == decode + 1), "the greedy continuation's token ids")):
        if meta.get(key) is not None and not test(meta[key]):
            raise GoldenCorruptError(f"{where}: metadata field {key!r} is {brief(meta.get(key))}, expected {want} "
                                     "(format 5 and later)")


def _check_model(meta: Mapping, feed: str, where: str) -> None:
    model = meta.get("model")
    if not isinstance(model, Mapping) or not isinstance(model.get("spec"), str) or not model["spec"] \
            or not isinstance(model.get("fingerprint"), str) or not model["fingerprint"]:
        raise GoldenCorruptError(f"{where}: metadata field 'model' lacks its spec or fingerprint")
    if model.get("head") is not None and not isinstance(model["head"], str):
        raise GoldenCorruptError(f"{where}: metadata field 'model.head' is {model['head']!r}, expected a path or null")
    if feed == "mtp" and not (isinstance(meta.get("mtp"), Mapping) and isinstance(meta["mtp"].get("fingerprint"), str)):
        raise GoldenCorruptError(f"{where}: metadata field 'mtp' lacks the draft head's fingerprint")


def _check_settings(meta: Mapping, logical: str, where: str) -> None:
    """The recorded settings a replay applies again: dtype, policy, determinism, thread count."""
    if "dtype" in meta and meta["dtype"] != logical:
        raise GoldenCorruptError(f"{where}: metadata field 'dtype' is {meta['dtype']!r}, but the logits are {logical}")
    policy = meta.get("policy")
    if policy is not None:
        from vd.policy import Policy

        try:
            if not isinstance(policy, Mapping) or not all(isinstance(v, str) for v in policy.values()):
                raise UsageError("not a table of SPECs")
            Policy.parse((), policy)
        except UsageError as e:
            raise GoldenCorruptError(f"{where}: metadata field 'policy' is {policy!r}: {e}") from None
    det = meta.get("determinism")
    applied = det.get("applied") if isinstance(det, Mapping) else None
    if det is not None and not isinstance(det, Mapping) or applied is not None and not (
            isinstance(applied, Mapping) and set(applied) <= set(_DETERMINISM)
            and all(isinstance(v, bool) or v is None for k, v in applied.items() if k != "cublas_workspace_config")
            and re.fullmatch(r"(:\d+:\d+)*", applied.get("cublas_workspace_config") or "")):
        raise GoldenCorruptError(f"{where}: metadata field 'determinism' is {det!r}, expected the settings vd applies")
    env = meta.get("environment")
    threads = env.get("threads") if isinstance(env, Mapping) else None
    if env is not None and not isinstance(env, Mapping) or threads is not None and not (
            isinstance(threads, int) and not isinstance(threads, bool) and 1 <= threads <= 4096):
        raise GoldenCorruptError(f"{where}: metadata field 'environment.threads' is {threads!r}, expected a thread "
                                 "count")


# Fields whose type is all that is checked, where present: (key, type test, what it should be).
_TYPED = (
    ("rows", lambda v: isinstance(v, Mapping) and isinstance(v.get("stored", True), bool), '{"stored": true|false}'),
    ("thin", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of reasons"),
    ("prompt_text", lambda v: isinstance(v, str), "the prompt's text"),
    ("require_coverage", lambda v: isinstance(v, bool), "true or false"),
    ("history", lambda v: isinstance(v, list) and all(isinstance(e, Mapping) for e in v), "a list of entries"),
    ("greedy", lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
     "token ids"),
    ("mtp", lambda v: isinstance(v, Mapping), "the draft head's description"),
    ("left_greedy", lambda v: isinstance(v, Mapping) and all(isinstance(k, str) and k.isdigit()
                                                             and _ints([s], 0, LIMITS["steps"]) for k, s in v.items()),
     '{"K": step, ...}'),
    ("batch", lambda v: isinstance(v, Mapping) and _ints([v.get("n")], 1, 65) and _ints([v.get("seed")], 0, 1 << 63)
     and (v.get("slot") is None or _ints([v.get("slot")], 0, v["n"])), '{"n": N, "slot": I or null, "seed": S}'),
    ("trace", lambda v: isinstance(v, Mapping) and _points(v.get("points"))
     and ("decode" not in v or _points(v["decode"]))
     and v.get("stats") == ["absmax", "norm"] and v.get("lanes") == 6,
     '{"points": [[module, what], ...], "stats": ["absmax", "norm"], "lanes": 6, "decode": [[module, what], ...] '
     'or absent}'),
    ("candidate", lambda v: isinstance(v, Mapping) and isinstance(v.get("control", {}), Mapping),
     "a candidate's description"),
    ("compiled", lambda v: isinstance(v, Mapping) and v.get("artifacts") == F.INDUCTOR_ARTIFACTS
     and isinstance(v.get("bytes"), int) and not isinstance(v.get("bytes"), bool) and 0 < v["bytes"] <= 1 << 31
     and isinstance(v.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", v["sha256"]) is not None,
     f'{{"artifacts": "{F.INDUCTOR_ARTIFACTS}", "bytes": N, "sha256": HEX, ...}}'),
)


def _points(v: object) -> bool:
    """A list of traced points (`vd.tracing`): 1 to 65,536 ``[module path, what it is]`` pairs of strings."""
    return (isinstance(v, list) and 0 < len(v) <= 1 << 16
            and all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in v))


def _str_or_none(v: object) -> bool:
    return v is None or isinstance(v, str)


def _step_ms(v: object) -> bool:
    return isinstance(v, Mapping) and all(
        isinstance(k, str) and isinstance(ms, list)
        and all(isinstance(x, int | float) and not isinstance(x, bool) and x >= 0 for x in ms) for k, ms in v.items())


# The run group's fields (`vd.store.format.split_volatile`), each with its type test and what it should be.
_RUN = (("created", _str_or_none, "a time or null"), ("model_source", _str_or_none, "a path or null"),
        ("step_ms", lambda v: v is None or _step_ms(v), '{"K": [milliseconds, ...], ...}'))


def check_run(run: Mapping, where: str) -> None:
    """The ``run`` group's volatile facts (format 5), which `vd.store.format.join_volatile` lays over the root
    metadata: each of the right type, and its environment only the facts a recording puts there (``host``,
    ``time``), so it cannot replace a setting the root's metadata holds and `check_meta` checked (its thread
    count)."""
    at = f"{where}/{F.RUN_GROUP}/zarr.json: field"
    for key, test, want in _RUN:
        if not test(run.get(key)):
            raise GoldenCorruptError(f"{at} {key!r} is {run.get(key)!r}, expected {want}")
    env = run.get("environment")
    if env is not None and not isinstance(env, Mapping):
        raise GoldenCorruptError(f"{at} 'environment' is {env!r}, expected the recording's host and time")
    for key, v in (env or {}).items():
        if key not in F.VOLATILE_ENV:
            raise GoldenCorruptError(f"{at} 'environment.{key}' is {v!r}: not a fact of the run (the golden's "
                                     "settings are in its root metadata)")
        if not _str_or_none(v):
            raise GoldenCorruptError(f"{at} 'environment.{key}' is {v!r}, expected text or null")


def _check_typed(meta: Mapping, where: str) -> None:
    for key, test, want in _TYPED:
        if meta.get(key) is not None and not test(meta[key]):
            raise GoldenCorruptError(f"{where}: metadata field {key!r} is {_shown(meta[key])}, expected {want}")


def _check_tokens(meta: Mapping, vocab: int, where: str) -> None:
    tokens = meta.get("prompt_tokens")
    if tokens is not None and not (_ints(tokens, 0, vocab) and 1 <= len(tokens) <= LIMITS["prompt"]):
        raise GoldenCorruptError(f"{where}: metadata field 'prompt_tokens' is not a prompt of token ids within the "
                                 f"vocabulary (0..{vocab - 1})")


def _check_logs(meta: Mapping, ks: tuple[int, ...], steps: int, vocab: int, required: bool, where: str,
                decode: int | None = None) -> None:
    """The step logs the metadata carries: each K's tokens, accept counts and bootstrap, and the decode group's
    where recorded (required since the manifest's format; before it, a golden may lack them and its arrays are
    read instead)."""
    logs = meta.get("logs")
    if logs is None and not required:
        return
    groups = {k: steps for k in ks} | ({F.DECODE_K: decode} if decode is not None else {})
    if not isinstance(logs, Mapping) or sorted(logs) != sorted(str(k) for k in groups):
        raise GoldenCorruptError(f"{where}: metadata field 'logs' does not hold a step log for each K {list(groups)}")
    for k, n in groups.items():
        e = logs[str(k)]
        at = f"{where}: metadata field 'logs.{k}'"
        if not isinstance(e, Mapping):
            raise GoldenCorruptError(f"{at} is not a step log")
        tokens, accepted = e.get("tokens"), e.get("accepted")
        if not (isinstance(tokens, list) and len(tokens) == n and all(_ints(t, 0, vocab) and len(t) == k
                                                                      for t in tokens)):
            raise GoldenCorruptError(f"{at}.tokens is not {n} steps of {k} token ids within the vocabulary")
        if not (_ints(accepted, 0, k) and len(accepted) == n):
            raise GoldenCorruptError(f"{at}.accepted is not {n} accept counts within 0..{k - 1}")
        for name in ("bootstrap", "decoded"):
            v = e.get(name)
            if (v is not None or name == "bootstrap") and not _ints([v], 0, vocab):
                raise GoldenCorruptError(f"{at}.{name} is {v!r}, not a token id within the vocabulary")

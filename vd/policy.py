"""Comparison policies: when a candidate row counts as the same as the golden's, per kind of row.

A policy maps each kind of row (``prefill``, ``verify``, ``draft``: the MTP head's rows and its
bootstrap row) to a SPEC:

=================  =====================================================================================
``exact``          every element's bits equal (the default)
``ulp:N``          every element within N units in the last place of the golden's dtype (bf16: 8-bit
                   mantissa), counted on the ordered bit patterns, so -0.0 and 0.0 are 0 apart
``atol:X,rtol:Y``  every element within ``X + Y * |golden|`` (``torch.testing.assert_close`` and
                   ``numpy.isclose``: one combined bound). Polygraphy instead passes an element when
                   *either* its absolute or its relative difference is within bound, a looser rule;
                   vd fails an element as soon as it is outside the combined bound
``argmax``         the row's top-1 index equal
``topk:N``         the same set of N top indices
``kl:X``           KL(golden || candidate) of the rows' softmax at most X nats
=================  =====================================================================================

Whatever the policy, decisions are checked as well (`vd.replayer.judge`): a row whose argmax differs from the
golden's fails even when its values are within tolerance, because it changes which draft a scheduler
accepts or which token it emits. The one exception is stated, not implied: ``decisions=margin:X`` allows
an argmax flip, and the accept-count change it causes, only at a row whose golden top-1/top-2 margin is
below X (logits): near-ties, where another engine's rounding may pick the other token (what llama.cpp's
``--kl-divergence`` calls "same top p"). Each allowed flip is reported with its margin;
``decisions=strict`` (the default) allows none. `sensitivity` states the smallest change a policy is guaranteed to
catch. A golden stores the policy it was recorded with as its default; ``--tolerance`` overrides it. A slim
golden (`vd.store.slim`) can be judged under ``exact`` and ``argmax`` only, unless its full golden is named.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vd.errors import UsageError
from vd.layout import KINDS

_SPEC = re.compile(
    r"^(?:(?P<exact>exact)|ulp:(?P<ulp>.+)|atol:(?P<atol>[^,]+),rtol:(?P<rtol>[^,]+)|(?P<argmax>argmax)"
    r"|topk:(?P<topk>.+)|kl:(?P<kl>.+))$"
)


@dataclass(frozen=True, slots=True)
class Spec:
    """One parsed SPEC: ``name`` is exact, ulp, close, argmax, topk or kl."""

    name: str
    text: str
    n: int = 0
    atol: float = 0.0
    rtol: float = 0.0
    kl: float = 0.0


MAX_ULP = 2**32  # the most two float32 values can be apart in ULPs (a larger N overflowed the comparison's integers)


@functools.lru_cache(maxsize=256)
def parse_spec(text: str) -> Spec:
    """A SPEC string to a `Spec`, or a UsageError naming the accepted forms (cached: every comparison
    parses its policy's three)."""
    m = _SPEC.match(text.strip())
    if not m:
        alone = " (atol takes its rtol: atol:X,rtol:Y)" if text.strip().startswith(("atol:", "rtol:")) else \
            f" ({text.strip()} takes its number: {text.strip()}:{'N' if text.strip() != 'kl' else 'X'})" \
            if text.strip() in ("ulp", "topk", "kl") else ""
        raise UsageError(f"unknown tolerance {text!r}: use exact, ulp:N, atol:X,rtol:Y, argmax, topk:N or kl:X{alone}")
    t = text.strip()
    number = m["ulp"] or m["topk"] or m["kl"]
    if number is not None and "," in number:  # (a list where one SPEC goes: each item names one kind's)
        raise UsageError(f"tolerance {text!r} is more than one SPEC: give each kind's its own item (two "
                         "--tolerance options, or two entries of a policy list: verify=ulp:2 and draft=exact)")
    try:
        if m["exact"]:
            return Spec("exact", t)
        if m["ulp"]:
            if not 0 <= int(m["ulp"]) <= MAX_ULP:
                raise ValueError
            return Spec("ulp", t, n=int(m["ulp"]))
        if m["atol"] is not None:
            atol, rtol = float(m["atol"]), float(m["rtol"])
            if not (atol >= 0 and rtol >= 0 and math.isfinite(atol) and math.isfinite(rtol)):
                raise ValueError
            return Spec("close", t, atol=atol, rtol=rtol)
        if m["argmax"]:
            return Spec("argmax", t)
        if m["topk"]:
            if int(m["topk"]) < 1:
                raise ValueError
            return Spec("topk", t, n=int(m["topk"]))
        kl = float(m["kl"])
        if not (kl >= 0 and math.isfinite(kl)):
            raise ValueError
        return Spec("kl", t, kl=kl)
    except ValueError as e:
        wants = (f"ulp:N takes a whole N from 0 to {MAX_ULP} (2**32: more than any two float32 values are apart)"
                 if m["ulp"] else "topk:N takes a whole N >= 1" if m["topk"]
                 else "kl:X takes a finite X >= 0" if m["kl"] else "atol:X,rtol:Y take finite X, Y >= 0")
        raise UsageError(f"bad number in tolerance {text!r}: {wants}") from e


DECISIONS = "decisions"  # the policy term for argmax flips and accept-count changes
# The policy term for verify rows against the decode rows of the same positions (`vd.equivalence`): unset, the
# equivalence is reported and not judged; set, each mapped verify row must pass its SPEC against its decode row,
# and an argmax that differs between them fails.
EQUIVALENCE = "equivalence"


def exact_number(x: float) -> str:
    """``x`` as text that parses back to ``x`` exactly: ``%g`` where that loses nothing (``0.5``, ``1``), else the
    shortest round-trip form (``0.2421875``; ``%g`` gave ``0.242188``, a policy other than the one asked for)."""
    short = f"{x:g}"
    return short if float(short) == x else repr(x)


def parse_decisions(text: str) -> float | None:
    """``strict`` (None) or ``margin:X`` (X > 0, finite), else a UsageError."""
    t = text.strip()
    if t == "strict":
        return None
    m = re.fullmatch(r"margin:(.+)", t)
    try:
        x = float(m[1]) if m else float("nan")
    except ValueError:
        x = float("nan")
    if not (x > 0 and math.isfinite(x)):
        what = f"decisions=margin:X needs a finite X > 0, not {m[1]!r}" if m else f"unknown decisions term {text!r}"
        raise UsageError(f"{what}: use decisions=strict or decisions=margin:X (X > 0, the golden top-1/top-2 logit "
                         "margin below which an argmax flip is allowed)")
    return x


ROWLESS = ("exact", "argmax")  # specs a golden's stored digests and statistics decide without its rows


@dataclass(frozen=True, slots=True)
class Policy:
    """A SPEC per kind of row (`KINDS`)."""

    prefill: Spec
    verify: Spec
    draft: Spec
    margin: float | None = None  # decisions=margin:X: flips allowed below this golden margin (None: strict)
    equivalence: Spec | None = None  # equivalence=SPEC: verify rows judged against decode rows (None: reported)

    @classmethod
    def parse(cls, items: Iterable[str] = (), base: Mapping[str, str] | None = None) -> Policy:
        """``[KIND=]SPEC`` items over ``base`` (a stored policy; default exact everywhere); later items win.
        A SPEC without a KIND applies to every kind."""
        texts = {k: "exact" for k in KINDS}
        texts.update({k: v for k, v in (base or {}).items() if k in KINDS})
        decisions = (base or {}).get(DECISIONS, "strict")
        equivalence = (base or {}).get(EQUIVALENCE)
        for item in items:
            kind, sep, spec = item.partition("=")
            if not sep:
                kind, spec = "", item
            elif not kind.strip():
                raise UsageError(f"--tolerance {item!r}: name a kind before '=' ({', '.join(KINDS)}, {DECISIONS} or "
                                 f"{EQUIVALENCE}), or leave the '=' out for every kind")
            if kind == DECISIONS:
                decisions = spec.strip()
                parse_decisions(decisions)
                continue
            if kind == EQUIVALENCE:
                equivalence = spec.strip()
                parse_spec(equivalence)
                continue
            if kind and kind not in KINDS:
                raise UsageError(f"unknown row kind {kind!r} in --tolerance {item!r} (choose from "
                                 f"{', '.join(KINDS)}, or {DECISIONS}=margin:X, or {EQUIVALENCE}=SPEC)")
            parse_spec(spec)
            for k in [kind] if kind else KINDS:
                texts[k] = spec.strip()
        # a stored policy must parse too
        return cls(**{k: parse_spec(texts[k]) for k in KINDS}, margin=parse_decisions(decisions),
                   equivalence=None if equivalence is None else parse_spec(equivalence))

    def __getitem__(self, kind: str) -> Spec:
        return getattr(self, kind)

    def to_json(self) -> dict[str, str]:
        """Each kind's SPEC, ``decisions`` where it is not strict, ``equivalence`` where it is judged."""
        return {**{k: self[k].text for k in KINDS}, **({DECISIONS: self.decisions} if self.margin is not None else {}),
                **({EQUIVALENCE: self.equivalence.text} if self.equivalence is not None else {})}

    def terms(self) -> tuple[str, ...]:
        """The ``--tolerance`` items that parse back to this policy: each kind whose SPEC is not exact, then
        ``decisions`` where it is not strict and ``equivalence`` where it is judged."""
        return tuple(f"{k}={v}" for k, v in self.to_json().items() if not (k in KINDS and v == "exact"))

    @property
    def decisions(self) -> str:
        """``strict`` or ``margin:X``."""
        return "strict" if self.margin is None else f"margin:{exact_number(self.margin)}"

    def allows_flip(self, margin: float) -> bool:
        """Whether an argmax flip at a row whose golden top-1/top-2 margin is ``margin`` is allowed."""
        return self.margin is not None and margin < self.margin

    def describe(self) -> str:
        """``prefill exact, verify ulp:2, draft exact`` (and ``, decisions margin:X``)."""
        return ", ".join(f"{k} {self[k].text}" for k in KINDS) + (
            f", decisions {self.decisions}" if self.margin is not None else "") + (
            f", equivalence {self.equivalence.text}" if self.equivalence is not None else "")

    def check_vocab(self, vocab: int) -> None:
        """Refuse a ``topk:N`` whose N is not below the ``vocab`` compared: the top N are then every token, the same
        set whatever the rows hold, and the spec catches nothing (a UsageError)."""
        specs = [(f"{k} rows", self[k]) for k in KINDS]
        specs += [(f"{EQUIVALENCE}= (verify against decode rows)", self.equivalence)] if self.equivalence else []
        wide = [(what, spec) for what, spec in specs if spec.name == "topk" and spec.n >= vocab]
        if wide:
            spec = wide[0][1]
            where = ", ".join(what for what, s in wide if s.text == spec.text)
            raise UsageError(f"{spec.text} (for {where}): the vocabulary has {vocab} tokens, so the top {spec.n} "
                             f"are all of them and no change is caught; give topk:N with N below {vocab}")

    @property
    def needs_rows(self) -> list[str]:
        """The kinds whose spec cannot be judged from a golden's digests and statistics alone."""
        return [k for k in KINDS if self[k].name not in ROWLESS]


def sensitivity(spec: Spec, logical: str, stats: Mapping[str, float], margin: float | None = None) -> str:
    """The smallest change the policy is guaranteed to catch in a row, in words and figures.

    ``stats`` describes the golden's rows of this kind: ``max_abs`` (largest |logit|), ``min_margin``
    (smallest top-1/top-2 gap) and ``median_top1_p`` (median probability of the top token); ``margin``: the
    policy's decisions=margin:X (flips allowed below it).
    """
    from vd.dtypes import DTYPES  # here, not at the top: parsing a policy needs no torch

    top = max(stats.get("max_abs", 1.0), 2.0 ** -126)  # Inf (or NaN) where the golden holds such (--allow-nonfinite)
    ulp_at = 2.0 ** (math.floor(math.log2(top)) - DTYPES[logical].mantissa_bits) if math.isfinite(top) else math.inf
    smallest = f"{stats.get('min_margin', float('nan')):.4g}"
    flip = (f"; and always any change of a row's argmax (the golden's smallest top-1/top-2 margin is {smallest})"
            if margin is None else
            f"; and any change of the argmax of a row whose golden top-1/top-2 margin is {exact_number(margin)} or "
            f"more (decisions=margin:{exact_number(margin)}; the golden's smallest margin is {smallest})")
    if spec.name == "exact":
        return "any change of any bit of any element (1 ULP)" + flip
    if spec.name == "ulp":
        return (f"any element moved by more than {spec.n} ULP (at the largest |logit| "
                f"{stats.get('max_abs', 0):.4g} that is {spec.n * ulp_at:.4g})" + flip)
    if spec.name == "close":
        worst = spec.atol + spec.rtol * stats.get("max_abs", 0.0)
        return (f"any element moved by more than atol + rtol·|golden| ({spec.atol:g} near zero, {worst:.4g} at "
                f"the largest |logit| {stats.get('max_abs', 0):.4g})" + flip)
    if spec.name == "argmax":
        return "only a change of a row's top-1 index; a change of any size that keeps it is not seen" + flip
    if spec.name == "topk":
        return (f"only a change of the set of a row's top {spec.n} indices; changes within or below it are "
                "not seen" + flip)
    p = min(max(stats.get("median_top1_p", 0.5), 1e-6), 1 - 1e-6)
    delta = math.sqrt(2 * spec.kl / (p * (1 - p))) if spec.kl > 0 else 0.0
    return (f"a change of the softmax by more than {spec.kl:g} nats KL; for a row whose top token holds "
            f"p = {p:.3g} (the golden's median) that is a shift of its logit by about {delta:.3g}" + flip)

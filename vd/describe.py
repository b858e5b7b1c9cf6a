"""A golden described in lines (`describe`, what ``vd show`` prints): where it is and its format, its ID and
content digest, the model and its fingerprint, the forward, the MTP head, the settings and policy, the
environment that recorded it, its storage, and each K's accept counts; every file is checked against the
manifest first and every row against its digest as its K is described.

It leaves out verdicts (`vd.replayer.words` words those) and printing: the lines are yielded one at a time,
so a caller shows each as soon as it is known.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from vd.batch import slots_text
from vd.coverage import histogram
from vd.equivalence import describe as describe_equivalence
from vd.equivalence import of_golden
from vd.policy import Policy
from vd.preflight import made_from
from vd.store import Golden, open_golden
from vd.store.format import DECODE_K


def describe(where: str | os.PathLike) -> Iterator[str]:
    """The lines of ``vd show`` for the golden at ``where`` (a damaged golden raises before its first line)."""
    g = open_golden(where)
    g.check_files()  # every file against the manifest (format 6), before anything is shown as the golden's
    yield from _identity(g)
    yield from _model(g.meta)
    tokens = f"{len(g.prompt)} token" + ("" if len(g.prompt) == 1 else "s")
    yield (f"settings  feed {g.info.feed}, dtype {g.logical}, device {g.info.device}, K {g.ks}, "
           f"{g.info.steps} steps, vocab {g.info.vocab}, prompt {tokens}"
           + (", deterministic (--deterministic)" if _deterministic(g.meta) else ""))
    yield f"prompt    {g.meta.get('prompt_text', '')!r}"
    batch = g.meta.get("batch")
    if batch is not None:
        yield (f"batch     recorded as one member of a batch of {batch['n']} ({slots_text(batch['slot'])}, "
               f"companions from seed {batch['seed']}); every replay runs that batch again")
    if g.traced:
        n, m = len(g.trace_points()), len(g.trace_points(DECODE_K)) if g.traced_at(DECODE_K) else None
        where = ("every K (not the decode rows)" if m is None else "every K and the decode rows" if m == n else
                 f"every K, and of {m} points at the decode rows (their forward's)")
        yield (f"trace     module traces of {n} points per row at {where} (vd record --trace): vd locate names the "
               "first module a replay's difference starts at")
    yield f"policy    {Policy.parse((), g.meta.get('policy')).describe()}"
    yield from _environment(g.meta.get("environment") or {})
    yield f"storage   {g.location.nbytes() / 1e6:.1f} MB; {_rows_text(g)}"
    for k in g.ks:
        yield _k_line(g, k)
        e = of_golden(g, k)
        if e is not None:
            yield f"      verify vs decode: {describe_equivalence(e)}"
    yield _decode_line(g)
    yield _digests_line(g)


def _identity(g: Golden) -> Iterator[str]:
    m = g.meta
    yield f"{g.url}  (format {m['format_version']}, created {m.get('created')})"
    if g.manifest is not None:
        yield f"golden ID {m['golden_id']}  ({len(g.manifest)} files, each checked against the manifest)"
    yield f"content   {g.content_digest()}  (history: {len(g.history)} version(s); vd history)"


def _model(m: Mapping[str, Any]) -> Iterator[str]:
    yield f"model     {m['model'].get('name')}  [{m['model']['spec']}]"
    yield f"          {m['model']['fingerprint']}"
    yield f"forward   {m['forward']}: {m.get('forward_description', '')}"
    if m.get("compiled"):
        c = m["compiled"]
        yield (f"compiled  Inductor artifacts {c['bytes'] / 1e6:.1f} MB (torch {c.get('torch')}), loaded by a "
               "compiled forward's replay before it compiles")
    if m.get("mtp"):
        h = m["mtp"]
        yield f"MTP head  {h.get('name')} ({h.get('source')}, {h.get('block')})  {h['fingerprint']}"
        yield f"          hidden: {h.get('hidden')}"
        yield f"          trim: {h.get('trim')}"


def _environment(e: Mapping[str, Any]) -> Iterator[str]:
    yield (f"recorded  vd {e.get('vd')}, torch {e.get('torch')}, transformers {e.get('transformers')}, "
           f"zarr {e.get('zarr')}, python {e.get('python')} on {e.get('host')}")
    gpu = f", GPU {e.get('gpu_name')} (CUDA {e.get('cuda')}, driver {e.get('driver')})" if e.get("gpu_name") else ""
    isa = e.get("cpu_capability") if not e.get("onednn_isa") else f"{e.get('cpu_capability')}, oneDNN {e['onednn_isa']}"
    threads = f"{e.get('threads')} thread" + ("" if e.get("threads") == 1 else "s")
    yield f"          CPU {e.get('cpu_model')} ({isa}), {threads}{gpu}"
    if (e.get("tp") or 1) > 1:
        yield f"          tensor parallel over {e['tp']} ranks ({e.get('collectives')})"
    if isinstance(e.get("engine"), dict):
        yield "          engine " + ", ".join(f"{k} {v}" for k, v in e["engine"].items())


def _deterministic(m: Mapping[str, Any]) -> bool:
    """Whether the recording ran with deterministic algorithms on (``--deterministic``)."""
    applied = (m.get("determinism") or {}).get("applied")
    return isinstance(applied, Mapping) and applied.get("deterministic_algorithms") is True


def _k_line(g: Golden, k: int) -> str:
    """K's accept counts, histogram, acceptance and bootstrap token, its rows checked against their digests."""
    if not g.slim:
        g.verify_rows(k)  # every row against its digest, every chunk against its checksum
    log = g.checked_log(k)
    acc = log.accepted.tolist()
    hist = ", ".join(f"{i}:{n}" for i, n in enumerate(histogram(k, acc)))
    flag = "" if log.committed_is_greedy in (True, None) else "  (left the greedy continuation)"
    rate = sum(acc) / (len(acc) * (k - 1))
    return f"K={k}  accepted {acc}  histogram {{{hist}}}  acceptance {rate:.0%}  bootstrap {log.bootstrap}{flag}"


def _decode_line(g: Golden) -> str:
    if not g.decoded:
        return "decode    not recorded (the golden predates format 7's decode rows)"
    if not g.slim:
        g.verify_rows(DECODE_K)  # every decode row against its digest, as each K's rows
    n = g.layout(DECODE_K).steps
    by = g.decode_forward
    return (f"decode    {n} one-token decode rows of the greedy continuation (group k{DECODE_K}"
            + ("" if by is None else f", computed with {by}: every replay computes them so") + "), each verify row "
            "whose input is the continuation compared with the decode row of its position")


def _digests_line(g: Golden) -> str:
    if not g.info.digested:
        return "digests   none stored (written before format 3): computed from the rows when replayed"
    d = g.meta["digest"]
    checked = "" if g.slim else ", each checked against its row's bytes"
    return f"digests   {d['lanes']} x {d['bits']}-bit per row ({d['scheme']}){checked}"


def _rows_text(g: Golden) -> str:
    if g.slim:
        src = (g.meta.get("rows") or {}).get("slim_of") or {}
        return f"slim: no rows (made from {made_from(g.url, g.meta)}, created {src.get('created')})"
    if g.info.version >= 4:
        return "rows as byte planes: high byte zstd-1 + crc32c, other bytes + crc32c"
    from vd.store.chunks import node

    codecs = node(g.location, f"k{g.ks[0]}/logits", f"{g.url}/k{g.ks[0]}/logits")["codecs"]
    return f"logits rows {' + '.join(c['name'] for c in codecs)}"

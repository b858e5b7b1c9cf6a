"""The Inductor and Dynamo settings every vd compilation runs under (`compiled` and `compiled-graphed`
forwards, the lean step's compiled regions), applied when a forward is compiled, never at import."""

from __future__ import annotations


def inductor_settings() -> None:
    """Inductor and Dynamo settings every vd compilation runs under."""
    import torch._dynamo
    import torch._inductor.config

    # Inductor's deterministic mode turns off some of the choices it makes by timing candidates (pad-mm,
    # template and reduction autotuning). Not all of them: on torch 2.11 two fresh processes compiling the tiny
    # MTP model still timed 79-83 candidates each, chose differently and computed other rows
    # (tools/h200/compiled-mtp-drafts-after.json); a replay matches its recording by loading the recording's
    # Inductor artifacts (`load_artifacts`).
    if hasattr(torch._inductor.config, "deterministic"):
        torch._inductor.config.deterministic = True
    # Each step shape (verify K, decode, every proposal shape) is its own compilation.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.cache_size_limit = max(getattr(torch._dynamo.config, "cache_size_limit", 8), 64)


# Artifacts this process saved or loaded already (by SHA-256): its Inductor caches hold them.
_HELD: set[str] = set()


def held(digest: str) -> bool:
    """Whether this process saved or loaded the artifacts of that SHA-256 already."""
    return digest in _HELD


def compiles(forward: str) -> bool:
    """Whether a forward of that name runs code Inductor compiled (vd's ``compiled`` and ``compiled-graphed``)."""
    return forward.startswith("compiled")


# The last `save_artifacts` of this process: (blob, kinds, its SHA-256).
_SAVED: tuple[bytes, dict[str, int], str] | None = None


def save_artifacts() -> tuple[bytes, dict[str, int], str] | None:
    """Everything Inductor compiled (or found in its caches) in this process, as one blob
    (`torch.compiler.save_cache_artifacts`: FX graphs, AOTAutograd entries, kernels and the kernel
    configurations it chose by timing), how many artifacts of each kind and the blob's SHA-256; None where
    there are none. A process that compiled nothing since its last save (torch's ``need_serialize``: a
    second recording of a suite, the pytest plug-in's, a benchmark's) gets that save again: torch would
    serialise the same artifacts into the same blob (on an H200 host the artifacts took 6-16 ms of each
    recording's publish with their serialising and hashing, 1.5-3 ms without: their file's write)."""
    import torch

    from vd.chunkfiles import sha256  # (the hash a golden's manifest lists for the file)

    global _SAVED
    manager = getattr(getattr(torch.compiler, "_cache", None), "CacheArtifactManager", None)
    unchanged = getattr(manager, "need_serialize", None)
    if (_SAVED is not None and unchanged is not None and not unchanged()
            and not getattr(torch._dynamo.config, "caching_precompile", False)):
        return _SAVED
    save = getattr(torch.compiler, "save_cache_artifacts", None)
    saved = save() if save is not None else None
    if not saved:
        return None
    data, info = saved
    kinds = {k: len(v) for k, v in (getattr(info, "artifacts", None) or {}).items()}
    _SAVED = (data, kinds, sha256(data))
    return _SAVED


def load_artifacts(data: bytes, digest: str) -> str | None:
    """Make Inductor's caches hold ``data`` (`save_artifacts`; ``digest``, its SHA-256, checked by the caller),
    so that the next compilations of the same code reuse its kernels and choices instead of timing
    candidates afresh; why not, or None."""
    import torch

    if digest in _HELD:
        return None  # this process saved or loaded them already
    off = caches_off()
    if off is not None:
        return off
    load = getattr(torch.compiler, "load_cache_artifacts", None)
    if load is None:
        return f"torch {torch.__version__} has no torch.compiler.load_cache_artifacts"
    try:
        load(data)
    except Exception as e:  # noqa: BLE001  another torch's format, or a cache that cannot be written
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    _HELD.add(digest)
    return None


def caches_off() -> str | None:
    """Why Inductor will not look in its caches here, so that artifacts loaded into them go unused and it compiles
    and times its kernel candidates afresh (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``, or
    ``TORCHINDUCTOR_FX_GRAPH_CACHE=0``); None where it will."""
    import torch._inductor.config as config

    if getattr(config, "force_disable_caches", False):
        return "Inductor's caches are disabled (torch._inductor.config.force_disable_caches, " \
               "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1)"
    if not getattr(config, "fx_graph_cache", True):
        return "Inductor's FX graph cache is off (torch._inductor.config.fx_graph_cache, " \
               "TORCHINDUCTOR_FX_GRAPH_CACHE=0)"
    return None


def keep_artifacts(forward: str, add_file, key: str, handed: dict | None = None) -> dict:
    """For a compiled forward, the Inductor artifacts this process compiled, handed with their SHA-256 to
    ``add_file(key, data, digest)`` (a golden's writer) so that a replay elsewhere runs the same kernels; the
    golden's ``compiled`` metadata field describing them (empty for other forwards, or when nothing was
    compiled). ``handed``: the field an earlier call for the same golden returned; artifacts with its SHA-256 (as
    when nothing was compiled since) are not handed again."""
    import torch

    # (where Inductor looks in no cache, what this recording compiled never reached them: nothing to keep)
    saved = save_artifacts() if compiles(forward) and caches_off() is None else None
    if saved is None:
        return {}
    data, kinds, digest = saved
    if handed and handed["compiled"]["sha256"] == digest:
        return handed
    add_file(key, data, digest)
    _HELD.add(digest)
    return {"compiled": {"artifacts": key, "bytes": len(data), "sha256": digest,
                         "torch": torch.__version__, "kinds": kinds}}

"""The Inductor and Dynamo settings every vd compilation runs under (`compiled` and `compiled-graphed`
forwards, the lean step's compiled regions), applied when a forward is compiled, never at import."""

from __future__ import annotations


def inductor_settings() -> None:
    """Inductor and Dynamo settings every vd compilation runs under."""
    import torch._dynamo
    import torch._inductor.config

    # Inductor's deterministic mode turns off the choices it makes by timing candidates (pad-mm, template
    # and reduction autotuning): without it two compilations of one step (a recording and its replay in
    # another process) can pick different kernels, and so compute different numbers.
    if hasattr(torch._inductor.config, "deterministic"):
        torch._inductor.config.deterministic = True
    # Each step shape (verify K, decode, every proposal shape) is its own compilation.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.cache_size_limit = max(getattr(torch._dynamo.config, "cache_size_limit", 8), 64)

"""Model specs: turn a ``--model SPEC`` into a `vd.protocol.VerifyModel`.

A SPEC is, in the order tried:

* a plug-in, ``package.module:factory`` or ``path/to/file.py:factory``: ``factory(device=, dtype=)``
  returns any object satisfying `VerifyModel` (a non-HF engine, or a deliberately perturbed one);
* a local path: an HF checkpoint directory or a ``.gguf`` file;
* a preset name from `vd.models.presets.PRESETS` (``smollm2``, the embedded default, and small
  seeded random-weight models for tests).

Nothing here fetches from a model hub. Importing this package imports neither torch nor transformers
(the presets, spec kinds and forward names answer a command line's checks in a moment); loading a model
does.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from vd.errors import ModelSpecError, PluginError, Terminated, UsageError, VdError, write_traceback
from vd.models.device import CUDA_ONLY, check_device
from vd.models.presets import DEFAULT_MODEL, PRESETS
from vd.models.specs import LLAMACPP
from vd.outputs import brief

if TYPE_CHECKING:
    import torch

    from vd.models.hf import HFModel
    from vd.protocol import VerifyModel

__all__ = ["BUILTIN_FORWARDS", "DEFAULT_MODEL", "PRESETS", "check_device", "check_forward_names", "forwards_of",
           "load_model", "require_forwards", "spec_kind"]

_PLUGIN = re.compile(r"^(?P<target>.+\.py|[A-Za-z_][\w.]*):(?P<factory>[A-Za-z_]\w*)$")

# Every forward a built-in model (a preset, an HF checkpoint directory, a .gguf file) can offer: the HF
# adapter's (`vd.models.hf.all_forwards`; a test holds the two equal), named here so that a --forward is
# checked without importing torch. Which of them a model offers depends on its device.
BUILTIN_FORWARDS = ("eager", "sdpa", "sdpa-math", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "static", "graphed",
                    "compiled", "compiled-graphed")


def spec_kind(spec: str) -> str:
    """``llamacpp``, ``plugin``, ``path`` or ``preset``; a ModelSpecError for a spec that names nothing."""
    if spec.startswith(LLAMACPP):
        return "llamacpp"
    if _PLUGIN.match(spec) and not Path(spec).exists():
        return "plugin"
    if Path(spec).exists():
        return "path"
    if spec in PRESETS:
        return "preset"
    raise ModelSpecError(
        f"unknown model {spec!r}: not a preset ({', '.join(PRESETS)}), an existing path, "
        "or a plug-in module:factory / file.py:factory"
    )


def import_code(spec: str) -> None:
    """Import the code a SPEC's model runs on (transformers' causal LMs for presets and paths, llama.cpp's
    bindings), so that a caller can time it apart from the build (`vd.replayer.report.Seconds`); a plug-in
    imports its own in `load_model`."""
    kind = spec_kind(spec)
    if kind in ("preset", "path"):
        import transformers.modeling_utils  # noqa: F401  what every HF model class imports first
        from transformers import AutoModelForCausalLM  # noqa: F401
    elif kind == "llamacpp":
        with contextlib.suppress(ImportError):  # load_model says what is missing, in one line
            import llama_cpp  # noqa: F401


def check_gguf(path: str | Path) -> None:
    """A `ModelSpecError` where ``llamacpp:PATH`` names no ``.gguf`` file (checked before anything loads)."""
    if not Path(path).is_file():
        raise ModelSpecError(f"{LLAMACPP}{path}: no such file")
    if Path(path).suffix != ".gguf":
        raise ModelSpecError(f"{LLAMACPP}{path}: not a .gguf file")


def check_forward_names(spec: str, names: list[str], device: str | None = None) -> None:
    """A UsageError naming every forward in ``names`` that no built-in model offers, for a ``spec`` that
    names a built-in model (a plug-in's forwards are known only once it is loaded), or, given the ``device``,
    one that runs on CUDA only asked on another; a llama.cpp GGUF that is not there, refused as early."""
    kind = spec_kind(spec)
    if kind == "llamacpp":
        check_gguf(spec[len(LLAMACPP):])
    if kind in ("plugin", "llamacpp"):
        return
    unknown = [n for n in names if n not in BUILTIN_FORWARDS]
    if unknown:
        raise UsageError(f"model {spec} has no forward {', '.join(map(repr, unknown))}; its forwards are among "
                         f"{', '.join(BUILTIN_FORWARDS)} (`vd forwards` lists those this machine runs)")
    cuda = [n for n in names if n in CUDA_ONLY]
    if cuda and device is not None and not device.startswith("cuda"):
        raise UsageError(f"model {spec} has no forward {', '.join(map(repr, cuda))} on device {device!r} "
                         f"({', '.join(cuda)} run{'s' if len(cuda) == 1 else ''} on CUDA only: --device cuda; "
                         "`vd forwards` lists those this machine runs)")


def check_recording(spec: str, forwards: list[str], device: str, threads: int | None) -> None:
    """What a recording of ``spec`` with ``forwards`` (the recording's and the decode rows', those named) on
    ``device`` can be refused for before anything heavy is imported: the device name, the model SPEC and its
    forwards there, the thread count. `vd record`'s flags and a declared golden's settings
    (`vd.workflow.declare.check_recordable`) both pass here."""
    from vd.models.device import check_device_name
    from vd.preflight import check_threads

    check_device_name(device)
    check_forward_names(spec, forwards, device)
    check_threads(threads)


def _plugin_module(target: str) -> ModuleType:
    """The module a plug-in spec names: a ``.py`` file (its folder put first on ``sys.path``, as Python does for a
    script, so it imports the modules beside it), or a module on the import path."""
    try:
        if not target.endswith(".py"):
            return importlib.import_module(target)
        path = Path(target)
        if not path.is_file():
            raise ModelSpecError(f"plug-in file {target} does not exist")
        folder = str(path.resolve().parent)  # its sibling modules import, as when the file runs as a script
        if folder not in sys.path:
            sys.path.insert(0, folder)
        mod_name = f"vd_plugin_{abs(hash(path.resolve()))}"
        loader_spec = importlib.util.spec_from_file_location(mod_name, path)
        assert loader_spec is not None and loader_spec.loader is not None, "a .py file has a source loader"
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[mod_name] = module
        loader_spec.loader.exec_module(module)
        return module
    except (ModelSpecError, KeyboardInterrupt):
        raise
    except BaseException as e:  # a plug-in's import can fail in any way, sys.exit() too; report it as one line
        first = str(e).splitlines()[0] if str(e) else ""
        missing = isinstance(e, ModuleNotFoundError) and e.name == target  # nothing of the plug-in's ran
        where = "" if missing else f" (traceback in {write_traceback(e, 'vd-plugin-')})"
        raise ModelSpecError(f"cannot import plug-in {target}: {type(e).__name__}: {first}{where}") from e


def _load_plugin(spec: str, device: torch.device, dtype: torch.dtype) -> VerifyModel:
    from vd.protocol import mark_plugin, not_a_model

    m = _PLUGIN.match(spec)
    assert m is not None, "spec_kind says the spec names a plug-in"
    target, factory_name = m["target"], m["factory"]
    module = _plugin_module(target)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ModelSpecError(f"plug-in {target} has no callable {factory_name!r}")
    _check_keywords(factory, spec)
    try:
        model = factory(device=device, dtype=dtype)
    except KeyboardInterrupt:  # a user's Ctrl-C (see `_guarded`)
        raise
    except BaseException as e:  # the engine could not be built (or ended the process): bad input, named
        raise _plugin_error(spec, "factory", e) from e
    _check_plain(model, spec)
    if (why := not_a_model(model)) is not None:
        raise ModelSpecError(f"plug-in {spec} returned {why}")
    _guard(model, spec)
    mark_plugin(model, spec)  # the spec that named it, for the errors that name the adapter
    _check_answers(model, spec)
    return model


def _check_answers(model: VerifyModel, spec: str) -> None:
    """A plug-in's identity and forwards, asked once at load (guarded: what they raise is already the plug-in's
    one line): an identity without a name and fingerprint was recorded into a golden no command could open
    again, and forwards that are no mapping crashed a replay after its runs (exit 3)."""
    ident = model.identity()
    if not all(isinstance(v, str) and v for v in (getattr(ident, "name", None), getattr(ident, "fingerprint", None))):
        raise PluginError(f"plug-in {spec}: its identity() is {brief(ident, 80)}, expected a vd.protocol.ModelIdentity "
                          "whose name and fingerprint are non-empty strings")
    offered = model.forwards()
    if not isinstance(offered, Mapping) or not offered or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in offered.items()):
        raise PluginError(f"plug-in {spec}: its forwards() is {brief(offered, 80)}, expected a mapping of each "
                          "forward's name to what it runs")
    default = model.default_forward()
    if default not in offered:
        raise PluginError(f"plug-in {spec}: its default_forward() is {brief(default, 80)}, which its forwards() do not "
                          f"offer ({', '.join(offered)})")


# Every method of the protocol vd calls on a model (`vd.protocol.VerifyModel` and its optional members:
# `vd.protocol.TokenDecoder`, `vd.protocol.DraftHead`, `vd.protocol.GraphedForwards`, `vd.protocol.Preparable`,
# `vd.protocol.EngineEnvironment`, `vd.protocol.BatchedForwards`, `vd.protocol.ModuleTrace`), each guarded on a
# plug-in's model.
_RUN_METHODS = ("identity", "forwards", "default_forward", "set_forward", "encode", "decode", "reset", "forward",
                "rewind", "head_info", "save_hidden", "trim_proposer", "propose", "forward_uses_graphs", "prepare",
                "environment", "batch_forwards", "reset_batch", "forward_batch", "rewind_batch", "reorder_batch",
                "trace_forwards", "trace")

# What a method may raise as part of the protocol, passed on as raised: ``set_forward``'s KeyError for a name it
# does not offer (vd checks names before calling it).
_PROTOCOL_ERRORS: dict[str, tuple[type[BaseException], ...]] = {"set_forward": (KeyError,)}


# The protocol's plain attributes, each with what it must be (read once, at load, so that a property that raises
# or a value of another type is the plug-in's one-line fault rather than an internal error mid-run).
_PLAIN = {"vocab_size": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a positive int"),
          "device": (lambda v: type(v).__name__ == "device" and type(v).__module__ == "torch", "a torch.device"),
          "dtype": (lambda v: type(v).__name__ == "dtype" and type(v).__module__ == "torch", "a torch.dtype")}


def _check_plain(model: object, spec: str) -> None:
    """A plug-in's plain attributes (`_PLAIN`) read and checked: one that raises, or holds another type, is a
    `vd.errors.PluginError` naming it (exit 2); one that is missing is left to the protocol's check."""
    for name, (ok, want) in _PLAIN.items():
        try:
            value = getattr(model, name)
        except AttributeError:
            continue
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            raise _plugin_error(spec, name, e) from e
        if not ok(value):
            raise PluginError(f"plug-in {spec}: its {name} is {value!r}, expected {want}")


def _guard(model: VerifyModel, spec: str) -> None:
    """Make each method of a plug-in that vd calls turn what it raises into a `vd.errors.PluginError` (`_guarded`).
    A built-in engine that raises stays an internal error (exit 3)."""
    for name in _RUN_METHODS:
        method = getattr(model, name, None)
        if callable(method):
            try:
                setattr(model, name, _guarded(method, spec, name))
            except (AttributeError, TypeError):  # __slots__ or a read-only attribute: its errors stay exit 3
                return


def _guarded(method, spec: str, name: str):
    """``method`` of plug-in ``spec``, turning anything it raises into a `vd.errors.PluginError` naming the plug-in,
    the method and what it raised (exit 2: the plug-in, an input, is at fault), its traceback written to a file
    the message names.

    Anything means a `BaseException` too: ``sys.exit(0)`` in a plug-in would end vd with success and no verdict,
    and ``SystemExit(1)`` or a custom `BaseException` with what reads as FAIL. Passed on as raised: a
    `vd.errors.VdError` (vd's own words on bad input), what the protocol lets the method raise
    (`_PROTOCOL_ERRORS`), and `KeyboardInterrupt`, so that a user's Ctrl-C still interrupts vd (``vd: aborted``,
    exit 130) whichever frame it lands in, and `vd.errors.Terminated`, vd's own SIGTERM handler's (exit 143); a
    plug-in that raises KeyboardInterrupt itself ends vd so too, which reads as neither PASS nor FAIL."""
    passed = (VdError, KeyboardInterrupt, Terminated, *_PROTOCOL_ERRORS.get(name, ()))

    @functools.wraps(method)
    def call(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except passed:
            raise
        except BaseException as e:
            raise _plugin_error(spec, name, e) from e

    return call


def _check_keywords(factory: Callable, spec: str) -> None:
    """Refuse a factory that cannot be called as ``factory(device=..., dtype=...)`` (its signature says so), in
    the protocol's words rather than as the call's TypeError; one whose signature Python cannot read is called."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or extension callable without one
        return
    try:
        signature.bind(device=None, dtype=None)
    except TypeError as e:
        raise ModelSpecError(f"plug-in {spec}: its factory does not take the keywords device= and dtype= (vd calls "
                             f"factory(device=..., dtype=...)); its signature is {signature}") from e


def _plugin_error(spec: str, what: str, e: BaseException) -> PluginError:
    """The one line for plug-in ``spec`` whose ``what`` (its factory, a method) raised ``e``, naming the file its
    traceback is written to."""
    first = str(e).splitlines()[0] if str(e) else ""
    return PluginError(f"plug-in {spec}: its {what} raised {type(e).__name__}: {first}",
                       write_traceback(e, "vd-plugin-"))


def load_model(spec: str = DEFAULT_MODEL, *, device: str | torch.device = "cpu",
               dtype: str | torch.dtype = "bfloat16", head: str | None = None) -> VerifyModel:
    """Load the model a SPEC names, on ``device``, computing in ``dtype``; with ``head``, attach the
    MTP draft head that safetensors file holds (`vd.models.mtp.save_head` format)."""
    from vd.dtypes import parse_dtype
    from vd.env import cap_kernel_caches
    from vd.models.hf import HFModel
    from vd.models.mtp import attach_head
    from vd.protocol import draft_head

    cap_kernel_caches()  # before the model's first matmul
    dev = check_device(device)
    dt = parse_dtype(dtype).torch if isinstance(dtype, str) else dtype
    kind = spec_kind(spec)
    if _split():
        return _tensor_parallel(spec, kind, dev, dt, head)
    model: VerifyModel
    if kind == "llamacpp":
        from vd.models import llamacpp

        model = llamacpp.load(spec, dev, dt)
    elif kind == "plugin":
        model = _load_plugin(spec, dev, dt)
    elif kind == "path":
        model = _load_path(spec, dev, dt)
    else:
        model = PRESETS[spec].build(dev, dt)
    if head is not None:
        if not isinstance(model, HFModel) or draft_head(model) is not None:
            raise ModelSpecError(f"--head attaches to an HF model without a draft head; {spec} is not one")
        model = attach_head(model, Path(head))
    return model


def _load_path(spec: str, device: torch.device, dtype: torch.dtype) -> HFModel:
    """The HF checkpoint directory or ``.gguf`` file at ``spec``, with a directory's own MTP layer attached as
    its draft head where its config has one."""
    from vd.models.checkpoints import load_checkpoint
    from vd.models.mtp import attach_head, native_layer

    path = Path(spec)
    if path.is_file() and path.suffix != ".gguf":
        raise ModelSpecError(f"{spec} is a file but not a .gguf checkpoint")
    model = load_checkpoint(path, device=device, dtype=dtype)
    mtp_layers = getattr(model.config.get_text_config(), "num_mtp_layers", 0)
    if path.is_dir() and mtp_layers:
        layer, cfg = native_layer(model.model, seed=None)  # the checkpoint's own MTP layer
        return attach_head(model, layer=layer, head_config=cfg, head_name=f"native MTP layer 0 of {path.name}",
                           head_source="native")
    return model


def _split() -> bool:
    """Whether this process is one of several ranks torchrun started (``WORLD_SIZE`` > 1)."""
    import os

    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def _tensor_parallel(spec: str, kind: str, device: torch.device, dtype: torch.dtype, head: str | None
                     ) -> VerifyModel:
    """Preset ``spec`` split over the ranks torchrun started (`vd.models.tp`): generated-weight shapes only."""
    from vd.models import tp

    preset = PRESETS.get(spec) if kind == "preset" else None
    if preset is None or preset.shape is None or head is not None:
        shapes = ", ".join(n for n, p in PRESETS.items() if p.shape is not None)
        raise UsageError(f"tensor parallelism (torchrun, --tp) splits the generated-weight shapes ({shapes}), "
                         f"without a draft head; {spec}{' with --head' if head else ''} is not one")
    cfg, seed, name = preset.shape()
    return tp.build(cfg, seed, name, device, dtype)


def forwards_of(spec: str, *, device: str = "cpu", dtype: str = "bfloat16") -> dict[str, str]:
    """The forwards a model offers. HF specs answer without loading weights (pinned SDPA backends
    marked as device-dependent); plug-ins are loaded."""
    if spec_kind(spec) in ("plugin", "llamacpp"):
        return dict(load_model(spec, device=device, dtype=dtype).forwards())
    from vd.models.hf import all_forwards

    return all_forwards()


def require_forwards(model: VerifyModel, names: list[str]) -> None:
    """A UsageError naming ``model`` and every forward in ``names`` it does not offer."""
    offered = model.forwards()
    unknown = [n for n in names if n not in offered]
    if unknown:
        cuda = [n for n in unknown if n in CUDA_ONLY and model.device.type != "cuda"]  # a built-in's, on the CPU
        why = f" ({', '.join(cuda)} run{'s' if len(cuda) == 1 else ''} on CUDA only: --device cuda)" if cuda else ""
        raise UsageError(f"model {model.identity().name} has no forward {', '.join(map(repr, unknown))}; it offers "
                         f"{', '.join(offered)}{why}")

"""The environment a golden was recorded in, or a replay ran in: versions, CPU, threads, GPU, host.

CPU results can depend on the CPU's vector ISA (torch's own dispatch capability, and the instructions oneDNN's
matmuls take) and on the thread count, so all three are captured; `numerics_differences` names the fields that
can move a CPU or GPU result when they differ between recording and replaying.
"""

from __future__ import annotations

import datetime as _dt
import functools
import os
import platform
import socket
import subprocess
import time
from importlib import metadata

import torch

import vd
from vd import protocol, warm
from vd.protocol import VerifyModel

# Fields whose difference can change the numbers, in the order a reader should see them.
NUMERIC_FIELDS = (
    "device", "cpu_capability", "onednn_isa", "cpu_model", "threads", "torch", "transformers", "gpu_name", "cuda",
    "cudnn", "driver", "determinism", "tp", "collectives", "engine",
)


@functools.cache
def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# oneDNN's ISA levels (its ONEDNN_MAX_CPU_ISA names), lowest first, with torch's check of each on this host.
ONEDNN_LEVELS = (("AVX2", "_is_avx2_supported"), ("AVX512_CORE", "_is_avx512_supported"),
                 ("AVX512_CORE_VNNI", "_is_vnni_supported"), ("AVX512_CORE_BF16", "_is_avx512_bf16_supported"),
                 ("AVX512_CORE_AMX", "_is_amx_tile_supported"))
ONEDNN_NAMES = tuple(name for name, _ in ONEDNN_LEVELS)
_ATEN_NAMES = {"DEFAULT": "default", "AVX2": "avx2", "AVX512": "avx512"}


def onednn_isa() -> str | None:
    """The highest oneDNN ISA level this host offers, capped by ``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``):
    the instructions torch's oneDNN matmuls (bf16 among them) take, whatever ``ATEN_CPU_CAPABILITY`` says. On one
    CPU model a host exposing AVX-512 computed other bf16 rows than one exposing AVX2 only, and limiting oneDNN
    to AVX2 brought the bits back; limiting ATen alone did not. None off x86-64."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    level = None
    for name, check in ONEDNN_LEVELS:
        if not getattr(torch.cpu, check, lambda: False)():
            break
        level = name
    limit = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    names = ONEDNN_NAMES
    if limit != "ALL" and level is not None:
        level = names[min(names.index(level), names.index(limit))] if limit in names else limit
    return level


KERNEL_CACHE_ENTRIES = "16"  # oneDNN primitives (and ideep's matmul descriptors) a process keeps


def cap_kernel_caches() -> None:
    """Bound the CPU kernel caches a long run fills: torch's bf16 matmuls on the CPU go through oneDNN, which
    JIT-builds and keeps a primitive per shape (and ideep, between torch and oneDNN, its own entry per shape),
    1024 of each by default. A one-token decode attends over a longer context every step, a new shape each
    time: about 1.35 MB kept per step (SmolLM2 under the eager forward: 200 decodes, +247 MB), so a 256-step
    recording grew to 1.8x a 16-step one. With 16 of each the 200 decodes keep +0.3 MB, as fast (9.50 s vs
    9.45 s), and the rows are the same bits: a primitive built again is the same kernel. Set as defaults
    (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``; a user's own values win), read by oneDNN and
    ideep at their first matmul, so called before a model is loaded (`vd.models.load_model`)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", KERNEL_CACHE_ENTRIES)
    os.environ.setdefault("LRU_CACHE_CAPACITY", KERNEL_CACHE_ENTRIES)


def same_kernels_hint(recorded: dict, replayed: dict) -> str | None:
    """The environment variables that make this x86-64 host take the recording's CPU kernels, where it offers
    more than the recording's host did (a golden without ``onednn_isa`` is known only where ATen ran AVX2)."""
    names = ONEDNN_NAMES
    was = recorded.get("onednn_isa") or ("AVX2" if recorded.get("cpu_capability") == "AVX2" else None)
    now = replayed.get("onednn_isa")
    if recorded.get("device") != "cpu" or was not in names or now not in names or names.index(was) >= names.index(now):
        return None
    aten = _ATEN_NAMES.get(str(recorded.get("cpu_capability")))
    return f"ONEDNN_MAX_CPU_ISA={was}" + (f" ATEN_CPU_CAPABILITY={aten}" if aten else "")


@functools.cache
def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        )
        return out.stdout.strip().splitlines()[0] or None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def capture(device: torch.device) -> dict:
    """The environment of this process, for a computation on ``device`` by one process (``tp`` 1)."""
    machine, gpu = _fixed(device.type, device.index if device.type == "cuda" else None)
    return {**machine, "threads": torch.get_num_threads(), **gpu, "determinism": determinism(),
            "tp": 1, "collectives": None, "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}


def of_model(model: VerifyModel) -> dict:
    """`capture` for ``model``'s device, with the fields the model adds (`vd.protocol.environment`: an engine's
    build, a tensor-parallel model's degree and collective library)."""
    return {**capture(model.device), **protocol.environment(model)}


@functools.cache
def _fixed(kind: str, index: int | None) -> tuple[dict, dict]:
    """What cannot change while a process runs, found once per device rather than at every replay:
    versions and machine; the device's kind, GPU and host. `capture` adds the rest."""
    machine = {
        "vd": vd.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "zarr": _version("zarr"),
        "numpy": _version("numpy"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_isa": onednn_isa(),
        "cpu_count": os.cpu_count(),
    }
    gpu = {
        "device": kind,
        "cuda": torch.version.cuda,
        "cudnn": None,
        "gpu_name": None,
        "driver": None,
        "host": socket.gethostname(),
    }
    if kind == "cuda":
        device = torch.device(kind, torch.cuda.current_device() if index is None else index)
        gpu["gpu_name"] = torch.cuda.get_device_name(device)
        gpu["cudnn"] = torch.backends.cudnn.version()
        gpu["driver"] = _driver()
    return machine, gpu


def numerics_differences(recorded: dict, replayed: dict) -> list[str]:
    """``field: recorded → replayed`` for each numerics-relevant field that differs."""
    out = []
    for f in NUMERIC_FIELDS:
        if f not in recorded:  # a field older goldens did not record is not a difference
            continue
        a, b = recorded.get(f), replayed.get(f)
        if a != b:
            out.append(f"{f}: {a} → {b}")
    return out


# What `vd record --deterministic` applies: deterministic algorithms with a fixed cuBLAS workspace, and no
# reduced-precision (split-K) reductions in bf16/fp16 matmuls.
DETERMINISTIC = {
    "deterministic_algorithms": True,
    "cublas_workspace_config": ":4096:8",
    "bf16_reduced_precision_reduction": False,
    "fp16_reduced_precision_reduction": False,
}


def determinism() -> dict:
    """The determinism-relevant settings in force in this process (whoever set them)."""
    m = torch.backends.cuda.matmul
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "bf16_reduced_precision_reduction": m.allow_bf16_reduced_precision_reduction,
        "fp16_reduced_precision_reduction": m.allow_fp16_reduced_precision_reduction,
        "tf32_matmul": m.allow_tf32,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }


def apply_determinism(settings: dict | None) -> None:
    """Apply settings of the `DETERMINISTIC` form (a golden's ``determinism.applied``); None does nothing.
    Call it before the model is loaded: cuBLAS reads its workspace setting when it starts."""
    if not settings:
        return
    if settings.get("cublas_workspace_config"):
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = settings["cublas_workspace_config"]
    if "deterministic_algorithms" in settings:
        torch.use_deterministic_algorithms(bool(settings["deterministic_algorithms"]))
    m = torch.backends.cuda.matmul
    if "bf16_reduced_precision_reduction" in settings:
        m.allow_bf16_reduced_precision_reduction = bool(settings["bf16_reduced_precision_reduction"])
    if "fp16_reduced_precision_reduction" in settings:
        m.allow_fp16_reduced_precision_reduction = bool(settings["fp16_reduced_precision_reduction"])


def process_age() -> float | None:
    """Seconds since this process started (Linux's /proc; None elsewhere): how long start-up took. In a child
    of a warm server (`vd.warm`) the process is the command's that it runs for. /proc is read once; later calls
    count from there on the monotonic clock (a replay asks twice, and a process replaying a suite asks per
    golden)."""
    born = warm.process_start()
    return None if born is None else max(0.0, time.monotonic() - born)

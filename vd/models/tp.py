"""Tensor-parallel models over torch.distributed: a generated-shape model (`vd.models.presets`) split over the
ranks torchrun starts, each rank generating only its own slice of the weights.

**How a run is shared.** Rank 0 is vd: it parses the command, opens, reads, judges and writes the golden and
the report, and drives the model (`TPModel`) as it drives any other. Every call that touches the model's
weights or cache (build, forward, rewind, reset, prepare, choosing a forward, the fingerprint) is first
broadcast to the other ranks over a gloo control group, and they make the same call on their shard
(`follow`); so every rank runs the same feed and the same steps, and the tokens, accept counts and rewinds
are rank 0's: ranks cannot drift. Rank 0 ends every rank with ``stop`` when its command is done, whatever its
outcome; an error on another rank ends that rank with one line and an exit code, which breaks rank 0's next
collective (an internal error there, exit 3) and torchrun ends the rest.

**The split** (Megatron's, over vd's lean step: `vd.models.lean`): each layer's query, key and value heads and
its MLP's gate and up rows are split by rank (column parallel), its output and down projections by input
column (row parallel), each summed across ranks by an all-reduce (NCCL on CUDA, captured inside the CUDA
graph of a ``graphed`` step; gloo on the CPU); the embeddings, norms and LM head are whole on every rank, so
every rank computes the same logits. The static KV cache holds each rank's key/value heads. The sums' order
differs from one GPU's, so a TP=N golden replayed at another degree is another build (its environment's
``tp``), with the numbers as they are.

**Weights and identity.** `vd.models.generated.hash_uniform_` gives every element a value from its index in the
whole tensor, so a rank fills its slice alone (`Region`) and the model is the one `build_generated` makes
whole; its fingerprint is the whole model's (each rank's checksums of its slices, weighted by their indices
in the whole tensors, summed across ranks), the same at every degree.
"""

from __future__ import annotations

import atexit
import copy
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

from vd.errors import UsageError
from vd.models.device import CUDA_ONLY
from vd.models.generated import GENERATOR, Region, checksum_on_device, fingerprint_of, generate
from vd.models.hf import HFModel
from vd.models.static import StaticRunner, static_forwards
from vd.models.text import ByteCodec
from vd.protocol import ModelIdentity

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(slots=True)
class World:
    """This process's place among the ranks torchrun started (``WORLD_SIZE`` > 1): its rank, their number,
    its local rank (its GPU) and the ranks on its host, the control group (gloo, the default group) and, once
    a model is built on CUDA, the NCCL group its sums run on."""

    rank: int
    size: int
    local_rank: int
    local_size: int = 1  # the ranks on this host (torchrun's LOCAL_WORLD_SIZE)
    nccl: object | None = None
    built: int = 0  # models built so far: each rank numbers them alike (builds are broadcast in order)

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank (over the control group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def data_group(self, device: torch.device):
        """The group a model on ``device`` sums over: NCCL on CUDA (made collectively on first use), else the
        control group (gloo; on CUDA too with ``VD_TP_COLLECTIVES=gloo``: ranks sharing one GPU, which NCCL
        refuses, for a functional check without graphs)."""
        if device.type != "cuda" or self.gloo_on_cuda:
            return None
        if self.nccl is None:
            self.nccl = dist.new_group(backend="nccl")
        return self.nccl

    @property
    def gloo_on_cuda(self) -> bool:
        return os.environ.get("VD_TP_COLLECTIVES") == "gloo"

    def environment(self, device: torch.device) -> dict:
        """The golden environment's fields for a model split over these ranks."""
        if device.type == "cuda" and not self.gloo_on_cuda:
            version = ".".join(map(str, torch.cuda.nccl.version()))
            return {"tp": self.size, "collectives": f"nccl {version}"}
        return {"tp": self.size, "collectives": "gloo"}


_WORLD: World | None = None


def world() -> World | None:
    """The ranks this process runs among under torchrun (None when it runs alone), joined on first use: the
    default process group is gloo, for the control messages; on the CPU each rank takes its share of the
    cores."""
    global _WORLD
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return None
    if _WORLD is None:
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        _WORLD = World(rank=dist.get_rank(), size=dist.get_world_size(),
                       local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                       local_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(dist.get_world_size()))))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    return _WORLD


def _joined() -> World:
    """The ranks this process runs among: a follower or a split model exists only under torchrun."""
    w = world()
    assert w is not None, "this process runs alone (WORLD_SIZE 1): there are no ranks to split over"
    return w


def is_follower() -> bool:
    """Whether this process is a rank other than 0 (it serves rank 0's calls: `follow`)."""
    w = world()
    return w is not None and w.rank != 0


def stop() -> None:
    """Rank 0 is done: every other rank leaves `follow`. A no-op elsewhere."""
    w = world()
    if w is not None and w.rank == 0:
        w.broadcast(("stop", ()))


def finish() -> None:
    """Leave the process groups (every rank, once its part is done), together: a rank that tore its groups
    down while another still used them made that one abort at exit."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def leave(code: int) -> NoReturn:
    """End this rank's process with exit status ``code`` once it has left the groups (`finish`): what Python
    does at exit (its threads joined, its exit handlers run, the standard streams flushed), then `os._exit`,
    without the interpreter's finalization. There gloo's worker thread may still be releasing its last
    collective's tensors, which takes the interpreter lock of an interpreter being torn down: the thread exits
    inside a destructor and the process aborts ("terminate called without an active exception", SIGABRT), which
    torchrun takes for a failed rank and ends the others. Seen in 1 of 2-10 runs of two CPU ranks on a loaded
    2-core host; a core dump showed ``ProcessGroupGloo::AsyncWork::~AsyncWork`` taking the lock during
    ``Py_FinalizeEx`` (torch 2.13). A script of its own that splits a model over ranks ends them so too."""
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter does first at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def follow() -> None:
    """A rank other than 0: make every call rank 0 broadcasts on this rank's shard, until ``stop``."""
    w = _joined()
    models: dict[int, TPModel] = {}  # rank 0 may go back to a model it built earlier (a suite holds them)
    while True:
        op, args = w.broadcast()
        if op == "stop":
            return
        if op == "build":
            model = build(*args)
            models[model.key] = model
        else:
            key, *rest = args
            getattr(models[key], op)(*rest)


# -- the split -------------------------------------------------------------------------------------------

_COLUMN = {"q_proj": "heads", "k_proj": "kv", "v_proj": "kv", "gate_proj": "inter", "up_proj": "inter"}
_ROW = {"o_proj": "heads", "down_proj": "inter"}


def _sizes(config) -> dict[str, int]:
    """Each split dimension of the whole model: query heads' rows, key/value heads' rows, MLP rows."""
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"heads": config.num_attention_heads * d, "kv": config.num_key_value_heads * d,
            "inter": config.intermediate_size, "d": d}


def shard_config(config, size: int):
    """The config of one rank's shard: its share of the query and key/value heads and of the MLP rows (head
    size kept). A UsageError where ``size`` does not divide them."""
    hq, hkv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    bad = [f"{what} {n}" for what, n in (("query heads", hq), ("key/value heads", hkv), ("MLP rows", inter))
           if n % size]
    if bad:
        raise UsageError(f"tensor parallelism over {size} ranks needs {size} to divide the model's "
                         f"{', '.join(bad)}")
    out = copy.deepcopy(config)
    out.head_dim = _sizes(config)["d"]
    out.num_attention_heads, out.num_key_value_heads, out.intermediate_size = hq // size, hkv // size, inter // size
    return out


def region(name: str, shape: tuple[int, ...], config, rank: int, size: int) -> tuple[Region | None, tuple]:
    """Where rank ``rank``'s tensor ``name`` (of shard shape ``shape``) sits in the whole model's, and the
    whole tensor's shape: None for a tensor every rank holds whole."""
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
    sizes = _sizes(config)
    if module in _COLUMN:
        n = sizes[_COLUMN[module]] // size
        whole = (n * size, *shape[1:])
        return Region(row=rank * n, column=0, columns=shape[1] if kind == "weight" else 1), whole
    if module in _ROW and kind == "weight":
        n = sizes[_ROW[module]] // size
        return Region(row=0, column=rank * n, columns=n * size), (shape[0], n * size)
    return None, tuple(shape)


def ranks_sharing(local_rank: int, local_size: int, devices: int) -> int:
    """How many of this host's ``local_size`` ranks use ``local_rank``'s GPU (rank ``r`` takes GPU ``r % devices``).

    Where ranks share a GPU, each is held to that fraction of its memory, its segments expandable, and its cache
    emptied once its shard is built (`build`): PyTorch's caching allocator keeps what a process frees for that
    process alone (fusing a layer's weights frees the unfused ones into it), split into blocks of the sizes
    freed, so without all three one rank's cache starved another's build (the 70B shape on one H200:
    tools/h200/README.md)."""
    gpu = local_rank % devices
    return sum(1 for r in range(local_size) if r % devices == gpu)


def build(config, seed: int, name: str, device: str | torch.device, dtype: torch.dtype) -> TPModel:
    """This rank's shard of the generated model of ``config`` (`vd.models.generated.build_generated`'s values); on
    rank 0, broadcast first, so every rank builds its own."""
    w = _joined()
    shard = shard_config(config, w.size)  # refused on rank 0 before any other rank builds
    if w.rank == 0:
        w.broadcast(("build", (config, seed, name, str(device), dtype)))
    dev, sharing = torch.device(device), 1
    if dev.type == "cuda":  # a GPU a rank (ranks share them where there are fewer: VD_TP_COLLECTIVES=gloo)
        dev = torch.device("cuda", w.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        sharing = ranks_sharing(w.local_rank, w.local_size, torch.cuda.device_count())
        if sharing > 1:  # each its share, its freed pages reusable for any size (`ranks_sharing`)
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
            torch.cuda.set_per_process_memory_fraction(1 / sharing, dev)
    model = generate(shard, seed, dev, dtype, "sdpa", lambda n, shape: region(n, shape, config, w.rank, w.size)[0])
    w.built += 1
    built = TPModel(model, world=w, whole=config, seed=seed, name=name, key=w.built)  # its weights fused here
    if sharing > 1:
        torch.cuda.empty_cache()  # what the build freed goes back: the shares add up to the whole GPU
    return built


class TPModel(HFModel):
    """One rank's shard of a tensor-parallel model (see the module's docstring): the static forwards of vd's
    lean step, summing across ranks; on rank 0 each call is broadcast to the other ranks first."""

    def __init__(self, model: PreTrainedModel, *, world: World, whole: Any, seed: int, name: str, key: int = 0):
        self.world, self.whole, self.seed, self.key = world, whole, seed, key
        self._leading = False  # no broadcasts while every rank builds
        group = world.data_group(next(model.parameters()).device)

        def reduce(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t, group=group)
            return t

        self._reduce = reduce
        super().__init__(model, name=name, encode=ByteCodec(whole.vocab_size),
                         details={"seed": seed, "random_weights": True, "generator": GENERATOR},
                         fingerprinter=self._fingerprint)
        self._leading = world.rank == 0

    def trace_forwards(self) -> list[str]:
        """None: a shard's step sums across ranks inside each layer, which the trace does not follow."""
        return []

    def _lead(self, op: str, *args) -> None:
        if self._leading:
            self.world.broadcast((op, (self.key, *args)))

    def _fingerprint(self, model: torch.nn.Module, config) -> str:
        """The whole model's fingerprint (`vd.models.generated.generated_fingerprint`): each tensor's checksum summed
        across ranks (a tensor every rank holds whole counted once, rank 0's)."""
        w = self.world
        tensors, parts, shapes = sorted(model.state_dict().items()), [], []
        for pname, t in tensors:
            at, whole = region(pname, tuple(t.shape), self.whole, w.rank, w.size)
            shapes.append(whole)
            if at is None and w.rank != 0:
                parts.append(torch.zeros((), dtype=torch.int64, device=t.device))
            else:
                parts.append(checksum_on_device(t, at=at).sum())
        totals = torch.stack(parts)
        dist.all_reduce(totals, group=w.data_group(totals.device))
        return fingerprint_of(self.whole, self.seed, [(pname, t.dtype, shape, total) for (pname, t), shape, total
                                                       in zip(tensors, shapes, totals.tolist())])

    def identity(self) -> ModelIdentity:
        if self._identity is None:
            self._lead("identity")
            ident = super().identity()
            whole = sum(int(torch.Size(region(n, tuple(t.shape), self.whole, 0, self.world.size)[1]).numel())
                        for n, t in self.model.named_parameters())
            self._identity = ModelIdentity(ident.name, ident.fingerprint, {**ident.details, "parameters": whole})
        return self._identity

    def environment(self) -> dict:
        """The degree and the collective library, for the golden's environment (`vd.env.of_model`)."""
        return self.world.environment(self.device)

    def forwards(self) -> Mapping[str, str]:
        """The static forwards (graphed and compiled ones on CUDA), each summing across the ranks."""
        split = f"tensor parallel over {self.world.size} ranks ({self.environment()['collectives']}): "
        graphs = self.device.type == "cuda" and not self.world.gloo_on_cuda  # gloo's sums cannot be captured
        return {n: split + d for n, d in static_forwards(self.model).items()
                if (self.device.type == "cuda" or n not in CUDA_ONLY) and (graphs or "graphed" not in n)}

    def default_forward(self) -> str:
        return "static"

    def set_forward(self, name: str) -> None:
        if name == self._forward:
            return
        if name not in self.forwards():
            raise KeyError(name)
        self._lead("set_forward", name)
        if name not in self._runners:
            self._runners[name] = self._new_runner(name)
        self._runner = self._runners[name]
        self._forward = name

    def _new_runner(self, name: str) -> StaticRunner:
        return StaticRunner(self.model, name, hidden=False, reduce=self._reduce)

    def prepare(self, capacity: int, lengths: Sequence[int] = ()) -> None:
        self._lead("prepare", capacity, tuple(lengths))
        super().prepare(capacity, lengths)

    def reset(self) -> None:
        self._lead("reset")
        super().reset()

    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        self._lead("forward", [int(t) for t in tokens])
        return super().forward(tokens)

    def rewind(self, n: int) -> None:
        self._lead("rewind", n)
        super().rewind(n)

    # The batch (`HFModel`'s, over vd's lean step summing across ranks): every call broadcast first, as above.

    def reset_batch(self, n: int, capacity: int) -> None:
        self._lead("reset_batch", n, capacity)
        super().reset_batch(n, capacity)

    def forward_batch(self, tokens: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        self._lead("forward_batch", [[int(t) for t in member] for member in tokens])
        return super().forward_batch(tokens)

    def rewind_batch(self, member: int, n: int) -> None:
        self._lead("rewind_batch", member, n)
        super().rewind_batch(member, n)

    def reorder_batch(self, order: Sequence[int]) -> None:
        self._lead("reorder_batch", [int(i) for i in order])
        super().reorder_batch(order)

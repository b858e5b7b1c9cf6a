"""`vd locate --between`: the first module whose output differs between two forwards, on a golden's steps. A
plug-in moves one module's output by one ULP (`tests/plugins/planted.py`); locate must name that module, where
an independent computation with plain forward hooks agrees that nothing before it differs."""

import json
from pathlib import Path

import pytest
import torch

from vd.models import load_model

PLANTED = str(Path(__file__).parent / "plugins" / "planted.py") + ":factory"


@pytest.fixture(scope="module")
def planted_golden(tmp_path_factory, cli):
    """SmolLM2 in float32 (a one-ULP move reaches the logits), 2 steps at K=2."""
    path = tmp_path_factory.mktemp("locate") / "g.zarr"
    code, _, err = cli("record", path, "--model", PLANTED, "--dtype", "float32", "--steps", "2", "--k", "2",
                       "--allow-thin")
    assert code == 0, err
    return path


def _first_by_plain_hooks(module: str, prompt_text: str) -> str:
    """The first module (in the order HF runs them) whose output differs between eager and planted on a prefill,
    found with plain forward hooks on every module of the model, not through vd's tracing."""
    import os

    os.environ["VD_PLANT"] = module
    try:
        m = load_model(PLANTED, device=torch.device("cpu"), dtype=torch.float32)
    finally:
        del os.environ["VD_PLANT"]
    leaves = [(n, mod) for n, mod in m.inner.model.named_modules() if n and not list(mod.children())]
    runs = [_leaf_outputs(m, leaves, name, prompt_text) for name in ("eager", "planted")]
    return next(a[0] for a, b in zip(*runs) if not torch.equal(a[1], b[1]))


def _leaf_outputs(m, leaves, forward: str, prompt_text: str) -> list[tuple[str, torch.Tensor]]:
    """Every leaf module's output on a prefill under ``forward``, in the order they ran."""
    seen: list[tuple[str, torch.Tensor]] = []
    hooks = [mod.register_forward_hook(lambda _m, _a, out, n=n: seen.append((n, out))) for n, mod in leaves]
    m.set_forward(forward)
    m.reset()
    with torch.inference_mode():
        m.forward(m.encode(prompt_text))
    for h in hooks:
        h.remove()
    return [(n, out if isinstance(out, torch.Tensor) else out[0]) for n, out in seen]


@pytest.mark.parametrize("module, what", [
    ("model.layers.7.mlp.down_proj", "MLP down projection"),
    ("model.layers.12.self_attn.o_proj", "attention output projection (o_proj)"),
    ("model.norm", "final norm"),
])
def test_a_planted_difference_is_located_at_its_module(planted_golden, cli, tmp_path, monkeypatch, module, what):
    monkeypatch.setenv("VD_PLANT", module)
    code, out, err = cli("locate", planted_golden, "--model", PLANTED, "--between", "planted",
                         "--report", tmp_path / "l.json")
    assert code == 1, out + err
    r = json.loads((tmp_path / "l.json").read_text())
    (k2,) = r["verify"]
    assert k2["differs"] and k2["step"] is None  # the planted move reaches the logits at the prefill
    assert k2["first_module"]["name"] == module and k2["first_module"]["what"] == what
    assert f"first difference at {module} ({what})" in out
    layer = k2["first_module"]["layer"]
    assert [p["layer"] for p in k2["path"]][:1] == [layer] and k2["first_module"]["max_abs"] > 0


def test_nothing_before_the_located_module_differs_by_plain_hooks(planted_golden):
    from vd.store import open_golden

    prompt = open_golden(planted_golden).meta["prompt_text"]
    assert _first_by_plain_hooks("model.layers.7.mlp.down_proj", prompt) == "model.layers.7.mlp.down_proj"


def test_eager_and_sdpa_part_at_the_attention(tiny_golden, cli):
    code, out, err = cli("locate", tiny_golden, "--forward", "eager", "--between", "sdpa", "--k", "2")
    assert code == 1, out + err
    assert ("K=2 the prefill: first difference at model.layers.0.self_attn.o_proj (attention output before "
            "o_proj)") in out and "the 5 traced outputs before it identical" in out


def test_two_equal_forwards_agree(tiny_golden, cli):
    code, out, err = cli("locate", tiny_golden, "--forward", "eager", "--between", "eager", "--k", "2")
    assert code == 0 and "every row bit-identical" in out, out + err


@pytest.mark.parametrize("args, message", [
    ([], "vd locate needs a second forward: --between NAME"),
    (["--between", "static"], "forward 'static' cannot be traced: it traces the modules of eager, sdpa"),
    (["--between", "eager", "--model", "tests/plugins/perturb.py:factory"],
     "cannot be traced: it cannot trace its modules"),
])
def test_what_locate_cannot_do_is_refused(tiny_golden, cli, args, message):
    code, out, err = cli("locate", tiny_golden, *args)
    assert code == 2 and message in err and "Traceback" not in err, err

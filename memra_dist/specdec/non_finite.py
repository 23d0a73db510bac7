"""Where non-finite logits come from, in words (run only after a failure was detected: the
session's checks cost nothing here). The first layer whose output is not finite, re-run
eagerly with hooks, and the first weight holding NaN / inf."""

from __future__ import annotations

import torch

__all__ = ["locate_non_finite"]


def _bad_weight(module) -> str | None:
    """The first parameter (in the module's order: embedding, layers, head) holding NaN / inf;
    a reduction per tensor (amax / amin propagate NaN), no copy of any weight."""
    for name, p in module.named_parameters():
        if not p.is_floating_point() or p.numel() == 0:
            continue
        try:
            if not (torch.isfinite(p.amax()) and torch.isfinite(p.amin())):
                return name
        except RuntimeError:  # a dtype without the reductions (fp8): not checked
            continue
    return None


def _layer_of(name: str) -> str:
    """'layers.3.mlp.down_proj.weight' -> 'layer 3'; 'embed_tokens.weight' -> 'embed_tokens'."""
    parts = name.split(".")
    if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit():
        return f"layer {parts[1]}"
    return parts[0]


@torch.inference_mode()
def _first_non_finite_output(runner, ids: torch.Tensor, start: int) -> str | None:
    """Re-run `ids` at `start` on a local runner holding the whole model, eagerly (its step
    graphs set aside: hooks do not fire inside a replay), with a hook on the embedding, each
    layer, the final norm and the lm_head; the first whose output is not finite."""
    stage = runner.stage
    mods = [("embed_tokens", getattr(stage, "embed_tokens", None))]
    mods += [(f"layer {i}", blk) for i, blk in getattr(stage, "layers", {}).items()]
    mods += [("the final norm", getattr(stage, "norm", None)), ("the lm_head", getattr(stage, "lm_head", None))]
    found: list[str] = []

    def hook(label):
        def h(_mod, _inp, out):
            o = out[0] if isinstance(out, (tuple, list)) else out
            if not found and torch.is_tensor(o) and o.is_floating_point() and not bool(torch.isfinite(o).all()):
                found.append(label)
        return h

    handles = [m.register_forward_hook(hook(label)) for label, m in mods if m is not None]
    graphs, runner.graphs = runner.graphs, None
    try:
        runner.rollback(start)
        runner.forward(ids.to(runner.device), start)
    finally:
        runner.graphs = graphs
        for h in handles:
            h.remove()
    return found[0] if found else None


def locate_non_finite(target, ids: torch.Tensor, start: int) -> str:
    """Where non-finite logits come from, in words: the first layer whose output is not finite
    (a local runner holding the whole model: pp = 1), and the first weight holding NaN / inf
    among the weights this process holds (at pp > 1 the head's own stage only). Best effort: a
    failure to locate says so and never hides the error itself."""
    runner = target if hasattr(target, "stage") else getattr(target, "runner", None)
    stage = getattr(runner, "stage", None)
    if stage is None:
        return "the logits are not finite (the layer could not be located)"
    whole = getattr(stage, "has_embed", False) and getattr(stage, "has_head", False)
    layer = None
    if whole:
        try:
            layer = _first_non_finite_output(runner, ids, start)
        except Exception:  # noqa: BLE001 (locating is best effort)
            layer = None
    try:
        weight = _bad_weight(stage)
    except Exception:  # noqa: BLE001
        weight = None
    if weight is not None:
        held = f"the weight {weight} holds NaN/inf (a broken checkpoint)"
        return f"{layer} is the first to output NaN/inf; {held}" if layer is not None else \
            f"{held}, in {_layer_of(weight)}"
    if layer is not None:
        return f"{layer} is the first to output NaN/inf (its weights are finite: an overflow in {runner.dtype}?)"
    if not whole:
        return ("the logits are not finite (the head's own layers and weights are finite; the layer is on another "
                "pipeline stage: run at --pp 1 to name it)")
    return "the logits are not finite (no layer's output was, re-run alone: a nondeterministic fault?)"

"""`--drafter auto`: the best drafter the checkpoints on hand allow, with prompt lookup first.

A network drafter (DFlash or EAGLE-3 from the draft checkpoint's config, or the target's own MTP
layers where its config declares them and its tensors hold them) drafts with `--ngram-first`:
each round whose context's suffix recurs takes the n-gram proposal, on the host, and the network
drafts the others (ngram_first.py: suffix-decoding style, each source counted apart). A draft
checkpoint of another kind is a draft model (`model`); with none, and no MTP layer, prompt lookup
alone (`ngram`). The choice is one line on stderr."""

from __future__ import annotations

__all__ = ["choose"]


def _has_mtp(model: str) -> bool:
    """The target declares MTP layers and its checkpoint holds their tensors (mtp.py)."""
    from ...model.config import load_config  # noqa: PLC0415
    from ...model.moe_config import MOE_ARCHS  # noqa: PLC0415
    from ...model.mtp import mtp_layer_count  # noqa: PLC0415

    cfg = load_config(model)
    return cfg.arch in MOE_ARCHS and cfg.family.num_mtp > 0 and mtp_layer_count(cfg, model) > 0


def choose(model: str, draft_model: str | None) -> tuple[str, bool, str]:
    """(drafter, ngram_first, why) for `--drafter auto` over these checkpoints."""
    from ...model.config import read_config_json  # noqa: PLC0415
    from ...model.dflash import ARCH as DFLASH_ARCH  # noqa: PLC0415
    from ...model.eagle3 import is_eagle3  # noqa: PLC0415

    if draft_model:
        d = read_config_json(draft_model, "draft model")
        archs = d.get("architectures") if isinstance(d, dict) else None
        if isinstance(archs, list) and DFLASH_ARCH in archs:
            return "dflash", True, "the draft checkpoint is a DFlash drafter"
        if isinstance(d, dict) and is_eagle3(d):
            return "eagle3", True, "the draft checkpoint is an EAGLE-3 head"
        return "model", False, "the draft checkpoint is a draft model"
    if _has_mtp(model):
        return "mtp", True, "the target holds MTP layers"
    return "ngram", False, "no draft checkpoint and no MTP layer in the target"

"""Load the vision tower (`model.visual.*`, transformers' names: serving/models/vision.py) of a
glm5_next checkpoint, apart from the text model (whose loader skips these tensors).

The tower is held in the model's dtype, whatever the text weights are: GLM-5.3-Flash's FP8
release keeps it in bf16, and a tower tensor stored in FP8 (with a scale beside it) is refused,
not dequantized, so a checkpoint quantized by some other tool is noticed. Every parameter must
be filled exactly once, with the checkpoint's shape; an unknown `model.visual.` tensor is an
error that names it. Under TP every rank holds the whole tower (it is 0.56 B parameters; the
text model's slices are what does not fit one GPU).
"""

from __future__ import annotations

from pathlib import Path

import torch

from serving.config import ModelConfig
from serving.models.checkpoint_reader import CheckpointError, iter_slices
from serving.models.fp8_weights import SCALE_SUFFIX
from serving.models.vision import VisionTower

VISION_PREFIX = "model.visual."


def load_vision(
    model_dir: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device | str
) -> VisionTower | None:
    """The checkpoint's vision tower on `device` in `dtype`; None for a text-only config."""
    if config.vision is None:
        return None
    with torch.device("meta"):
        tower = VisionTower(config.vision, dtype)
    tower.to_empty(device=device)
    params = dict(tower.named_parameters())
    filled: set[str] = set()
    for name, read in iter_slices(model_dir):
        if not name.startswith(VISION_PREFIX):
            continue
        key = name[len(VISION_PREFIX) :]
        if key.endswith(SCALE_SUFFIX):
            raise CheckpointError(
                f"{name}: the vision tower is stored in FP8; it is served in the model dtype "
                "only (GLM-5.3-Flash keeps it in bf16)"
            )
        param = params.get(key)
        if param is None:
            raise CheckpointError(f"unknown tensor {name!r} (no vision tower parameter {key})")
        tensor = read(None)
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(
                f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, the tower "
                f"expects {tuple(param.shape)}"
            )
        if key in filled:
            raise CheckpointError(f"{name!r} is in the checkpoint twice")
        with torch.no_grad():
            param.copy_(tensor.to(dtype))
        filled.add(key)
    missing = sorted(set(params) - filled)
    if missing:
        raise CheckpointError(
            f"config.json has a vision_config but the checkpoint lacks {VISION_PREFIX}"
            f"{missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    return tower.eval()

"""LoRA adapters served by name on one base model, unmerged (kind "serve", `serve.adapters`).

Each adapter is a peft folder (what a LoRA job saves: engine.workers.checkpoint, peft's save_pretrained).
They are loaded side by side into one peft model, and every forward says which adapter each row of the
batch runs (peft's mixed-batch `adapter_names`, "__base__" for the base alone): requests for different
adapters and for the base decode in one batch, and no adapter's weights are ever folded into the base's.
"""

from __future__ import annotations

from typing import Any

import torch

from rigpilot.engine.errors import UserError
from rigpilot.engine.workers.serve_setup import check_adapter_folder

BASE = "__base__"  # peft's name for "no adapter" in adapter_names


def attach_adapters(model: torch.nn.Module, adapters: dict[str, str], device: torch.device) -> torch.nn.Module:
    """`model` with every adapter loaded beside the others, in eval mode; `model` itself when there are none."""
    if not adapters:
        return model
    from peft import PeftModel

    peft_model: Any = None
    for name, folder in adapters.items():
        check_adapter_folder(name, folder)
        try:
            if peft_model is None:
                peft_model = PeftModel.from_pretrained(model, folder, adapter_name=name, is_trainable=False)
            else:
                peft_model.load_adapter(folder, adapter_name=name, is_trainable=False)
        except (ValueError, KeyError, RuntimeError, OSError) as e:
            # The adapter names modules this base lacks, or its matrices have other shapes: another base's.
            said = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise UserError(f"adapter {name} ({folder}) does not fit this model: {said}",
                            reason="serve_adapter_mismatch", adapter=name, folder=folder) from None  # fmt: skip
    peft_model.to(device)
    peft_model.eval()
    return peft_model  # type: ignore[no-any-return]


def forward_kwargs(adapters: list[str | None] | None) -> dict[str, Any]:
    """The forward's extra arguments for rows running these adapters (None: the base)."""
    if adapters is None:
        return {}
    return {"adapter_names": [a if a is not None else BASE for a in adapters]}

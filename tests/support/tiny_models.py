"""Variants of examples/models/tiny-llama for worker tests that pay per distinct weight shape.

torch.compile specialises on shapes: torchao's optimizer steps (8-bit AdamW, bf16 stochastic rounding) compile
once per parameter shape in every rank, tens of seconds on shared cores for the example's six shapes. The
variant here has two weight shapes (the vocabulary's and hidden x hidden) and the norms', with the example's
tokenizer, so a job's warm-up is a few seconds and every code path (8-bit and plain moments, sharded and
split weights) is still taken.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from support.paths import TINY_LLAMA_CONFIG


def square_tiny_llama(folder: Path, layers: int = 2) -> Path:
    """The tiny Llama with intermediate size = hidden size and as many key/value heads as heads, written to
    `folder` beside the example's tokenizer; its config.json."""
    shutil.copytree(TINY_LLAMA_CONFIG.parent, folder)
    config = json.loads(TINY_LLAMA_CONFIG.read_text())
    config.update(intermediate_size=config["hidden_size"], num_key_value_heads=config["num_attention_heads"],
                  num_hidden_layers=layers)  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder / "config.json"

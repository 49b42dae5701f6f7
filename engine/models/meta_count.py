"""Count a model that no formula covers by building it on the meta device, in a child process.

The planner process never imports torch (it starts fast and stays small), so
the child does: it builds the model from its config with tensors that have
shapes but no storage, and prints what sizing needs as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from rigpilot.engine.errors import UserError
from rigpilot.engine.models.spec import Linear

TIMEOUT_S = 300  # importing transformers and, with remote code, fetching it

# Runs in the child. Kept free of engine imports so it works from any checkout layout.
_CHILD = r"""
import json, sys
import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

source, trust = sys.argv[1], sys.argv[2] == "1"
config = AutoConfig.from_pretrained(source, trust_remote_code=trust)
with torch.device("meta"):
    try:
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust)
    except ValueError:  # not a causal LM: the bare model
        model = AutoModel.from_config(config, trust_remote_code=trust)

params = dict(model.named_parameters())  # named_parameters() yields a tied weight once
inp = model.get_input_embeddings()
out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
embedding = sum(
    p.numel() for n, p in params.items()
    if n.endswith(("embed_tokens.weight", "wte.weight", "wpe.weight", "word_embeddings.weight",
                   "position_embeddings.weight", "token_type_embeddings.weight", "embed_in.weight"))
)
if not embedding and inp is not None:
    embedding = inp.weight.numel()

text = config.get_text_config() if hasattr(config, "get_text_config") else config
def attr(*names):
    for n in names:
        v = getattr(text, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None
hidden = attr("hidden_size", "n_embd", "d_model", "dim")

def fused_expert(pname, shape):
    # (in, out) of one expert of a fused 3-D expert weight, whichever way round the family stores it.
    _, a, b = shape
    if "down" in pname:  # writes the hidden size
        return (b, a) if a == hidden or b != hidden else (a, b)
    return (b, a) if b == hidden or a != hidden else (a, b)

# The repeated block: the longest ModuleList.
lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
blocks = max(lists, key=len) if lists else None
linears, expert_params, num_experts = [], 0, 0
if blocks is not None:
    for name, mod in blocks[0].named_modules():
        in_expert = ".experts." in f".{name}." or name.startswith("experts") or name.endswith("experts")
        if in_expert and any(part.isdigit() and part != "0" for part in name.split(".")):
            continue  # one expert stands for all
        w = getattr(mod, "weight", None)
        short = name.rsplit(".", 1)[-1]
        if isinstance(mod, nn.Linear) or type(mod).__name__ == "Conv1D":
            conv = type(mod).__name__ == "Conv1D"  # GPT-2 stores (in, out)
            fin, fout = (w.shape[0], w.shape[1]) if conv else (w.shape[1], w.shape[0])
            linears.append({"name": short, "in_features": int(fin), "out_features": int(fout),
                            "bias": getattr(mod, "bias", None) is not None, "expert": in_expert})
            continue
        own = dict(mod.named_parameters(recurse=False))
        if short in ("gate", "router") and isinstance(w, nn.Parameter) and w.dim() == 2:
            # A router kept as a bare weight rather than an nn.Linear (OLMoE, Qwen3-MoE, gpt-oss, ...).
            linears.append({"name": short, "in_features": int(w.shape[1]), "out_features": int(w.shape[0]),
                            "bias": own.get("bias") is not None, "expert": False})
            continue
        for pname, p in own.items():
            if p.dim() == 3 and not pname.endswith("bias") and hidden:
                # Fused experts (transformers 5): one 3-D weight (experts, out, in) or (experts, in, out).
                fin, fout = fused_expert(pname, p.shape)
                linears.append({"name": pname, "in_features": int(fin), "out_features": int(fout),
                                "bias": f"{pname}_bias" in own, "expert": True})
    for name, p in blocks[0].named_parameters():
        if "experts" in name:
            expert_params += p.numel()
            if p.dim() == 3:  # fused experts: (experts, out, in)
                num_experts = max(num_experts, p.shape[0])

print(json.dumps({
    "architecture": type(model).__name__,
    "params_total": sum(p.numel() for p in params.values()),
    "params_embedding": embedding,
    "tied": bool(out is not None and inp is not None and out.weight is inp.weight),
    "num_blocks": len(blocks) if blocks is not None else 0,
    "block_expert_params": expert_params,
    "num_experts": num_experts,
    "linears": linears,
    "hidden_size": attr("hidden_size", "n_embd", "d_model", "dim"),
    "num_layers": attr("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "num_heads": attr("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "num_kv_heads": attr("num_key_value_heads", "num_kv_heads", "n_head_kv"),
    "head_dim": attr("head_dim"),
    "intermediate_size": attr("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size"),
    "vocab_size": attr("vocab_size"),
    "max_position_embeddings": attr("max_position_embeddings", "n_positions", "max_sequence_length"),
}))
"""


@dataclass
class MetaCount:
    architecture: str
    params_total: int
    params_embedding: int
    tied: bool
    num_blocks: int
    block_expert_params: int  # expert parameters in the first repeated block
    num_experts: int  # from fused 3-D expert weights; 0 when experts are separate modules
    linears: list[Linear]
    dims: dict[str, int | None]  # hidden_size, num_layers, num_heads, ... as the config object resolves them


def count_on_meta(source: str, *, trust_remote_code: bool = False, token: str | None = None) -> MetaCount:
    """Build `source` (a folder with config.json, or a repo id for remote code) on the meta device in a child."""
    env = dict(os.environ)
    if token:
        env["HF_TOKEN"] = token
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, source, "1" if trust_remote_code else "0"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired as e:
        raise UserError(f"{source}: building the model on the meta device took over {TIMEOUT_S} s") from e
    if proc.returncode != 0:
        if not trust_remote_code and "trust_remote_code" in proc.stderr:
            raise UserError(
                f"{source}: the model needs its own code from its repo; allow trust_remote_code if you trust it"
            )
        raise UserError(f"{source}: transformers cannot build this model ({_last_line(proc.stderr)})")
    try:
        out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError) as e:
        raise UserError(f"{source}: the meta-device count printed no result") from e
    dims_keys = (
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
    )
    return MetaCount(
        architecture=out["architecture"],
        params_total=out["params_total"],
        params_embedding=out["params_embedding"],
        tied=out["tied"],
        num_blocks=out["num_blocks"],
        block_expert_params=out["block_expert_params"],
        num_experts=out["num_experts"],
        linears=[Linear(**lin) for lin in out["linears"]],
        dims={k: out.get(k) for k in dims_keys},
    )


def _last_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no error output"

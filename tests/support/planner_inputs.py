"""What the planner tests feed the planner: Llama-shaped model specs, training workloads, a calibration file."""

from typing import Any

from rigpilot.engine.models.spec import Linear, ModelSpec
from rigpilot.engine.planner.calibration import SCHEMA
from rigpilot.engine.planner.plan import Workload
from rigpilot.engine.recipe import PLAIN_RECIPE

H100 = "NVIDIA H100 80GB HBM3"


def llama(h: int, inter: int, layers: int, heads: int, kv: int, vocab: int, params: int, name: str, ctx: int = 4096) -> ModelSpec:
    d = h // heads
    lin = [
        Linear("q_proj", h, heads * d), Linear("k_proj", h, kv * d), Linear("v_proj", h, kv * d),
        Linear("o_proj", heads * d, h), Linear("gate_proj", h, inter), Linear("up_proj", h, inter),
        Linear("down_proj", inter, h),
    ]
    return ModelSpec(
        id=name, architecture="LlamaForCausalLM", model_type="llama", params_total=params, params_active=params,
        params_embedding=vocab * h, hidden_size=h, num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=d,
        intermediate_size=inter, vocab_size=vocab, max_position_embeddings=ctx, tied_embeddings=False, layer_linears=lin,
    )


def train(**kw) -> Workload:
    """A training workload pinned to the engine's plain recipe (the tests of layouts, ranking and offload were
    written for it); `auto_train` leaves the recipe to the search."""
    return Workload(model="llama-2-7b", **{"seq_len": 2048, "global_batch": 16, **PLAIN_RECIPE, **kw})


def auto_train(**kw) -> Workload:
    return Workload(model="llama-2-7b", **{"seq_len": 2048, "global_batch": 16, **kw})


def h100_calibration(**over: Any) -> dict[str, Any]:
    """What a calibrate job on eight H100s writes (the figures are made up, and lower than the priors)."""
    d = {
        "schema": SCHEMA,
        "measured_at": "2026-11-23T20:15:00Z",
        "simulated": False,
        "device_type": "cuda",
        "backend": "nccl",
        "precision": "bf16",
        "machine": {"gpus": {str(i): H100 for i in range(8)}, "gpu_count": 8, "driver": "550.90.07"},
        "matmul_tflops": {"bf16": {str(i): 312.0 for i in range(8)}},
        "bus_bandwidth_gbs": {"0,1,2,3,4,5,6,7": 180.0},
        "p2p_gbs": {},
    }
    d.update(over)
    return d


# `rigpilot plan`'s flags that pin the plain recipe.
PLAIN_FLAGS = ("--master-weights", "fp32", "--optimizer", "adamw", "--loss-chunks", "1", "--no-optimizer-in-backward",
               "--no-activation-offload")  # fmt: skip

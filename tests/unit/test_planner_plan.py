"""Plan JSON: versioned, exact round-trip, clear errors."""

from __future__ import annotations

import json

import pytest

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.models.spec import Linear, ModelSpec
from rigpilot.engine.planner.plan import PLAN_VERSION, LoraSettings, Plan, Workload
from rigpilot.engine.planner.search import search


def small_llama() -> ModelSpec:
    h, inter, layers, vocab = 2048, 5632, 22, 32000
    lin = [
        Linear("q_proj", h, h), Linear("k_proj", h, 256), Linear("v_proj", h, 256), Linear("o_proj", h, h),
        Linear("gate_proj", h, inter), Linear("up_proj", h, inter), Linear("down_proj", inter, h),
    ]
    total = 2 * vocab * h + layers * (sum(x.in_features * x.out_features for x in lin) + 2 * h) + h
    return ModelSpec(
        id="tinyllama-1.1b", architecture="LlamaForCausalLM", model_type="llama", params_total=total, params_active=total,
        params_embedding=vocab * h, hidden_size=h, num_layers=layers, num_heads=32, num_kv_heads=4, head_dim=64,
        intermediate_size=inter, vocab_size=vocab, max_position_embeddings=2048, tied_embeddings=False, layer_linears=lin,
    )


@pytest.fixture(scope="module")
def plans() -> list[Plan]:
    out = []
    for profile, w in [
        ("8x-a100-pcie", Workload(model="TinyLlama/TinyLlama-1.1B", seq_len=2048, global_batch=32, token_budget=10**9)),
        ("4x-rtx4090", Workload(model="tiny", method="qlora", seq_len=1024, global_batch=8, lora=LoraSettings(rank=8))),
        ("8x-h100-sxm", Workload(model="tiny", task="infer", seq_len=2048, global_batch=8, new_tokens=128, weight_bits=8)),
    ]:
        r = search(small_llama(), load_profile(profile), w)
        out += [r.best, *r.runners_up]
    return out


def test_round_trip_is_exact(plans):
    for plan in plans:
        text = plan.to_json()
        back = Plan.from_json(text)
        assert back == plan
        assert back.to_json() == text


def test_json_holds_what_a_launcher_needs(plans):
    d = json.loads(plans[0].to_json())
    assert d["schema"] == "rigpilot.plan" and d["schema_version"] == PLAN_VERSION
    w, par = d["workload"], d["parallelism"]
    for key in ("model", "task", "method", "precision", "seq_len", "global_batch", "lora"):
        assert key in w
    for key in ("gpu_indices", "dp", "tp", "pp", "zero_stage", "shard_degree", "micro_batch", "grad_accum",
                "checkpointing", "offload_optimizer", "offload_params", "stage_layers", "backend"):
        assert key in par
    assert d["memory"] and d["timing"]["tokens_per_s"] > 0
    mesh = par["mesh_shape"]
    assert list(mesh) == ["pp", "dp_replicate", "dp_shard", "tp"]
    assert (mesh["pp"], mesh["dp_replicate"] * mesh["dp_shard"], mesh["tp"]) == (par["pp"], par["dp"], par["tp"])
    assert par["world_size"] == len(par["gpu_indices"]) == par["dp"] * par["tp"] * par["pp"]
    qlora = next(p for p in plans if p.workload.method == "qlora")
    assert qlora.workload.lora.quant_bits == 4 and qlora.workload.lora.rank == 8


def test_newer_or_foreign_plans_are_refused(plans):
    d = plans[0].to_dict()
    with pytest.raises(UserError, match="newer"):
        Plan.from_dict({**d, "schema_version": PLAN_VERSION + 1})
    with pytest.raises(UserError, match="not a Rigpilot plan"):
        Plan.from_dict({**d, "schema": "something.else"})
    with pytest.raises(UserError, match="malformed plan"):
        Plan.from_dict({k: v for k, v in d.items() if k != "workload"})
    with pytest.raises(UserError, match="not valid JSON"):
        Plan.from_json("{")


def test_runs_here_round_trips_and_old_plans_are_judged_by_the_contract(plans):
    for plan in plans:
        d = plan.to_dict()
        assert d["runs_here"] is plan.runs_here and d["runs_here_reason"] == plan.runs_here_reason
        old = json.loads(plan.to_json())
        del old["runs_here"], old["runs_here_reason"]
        back = Plan.from_dict(old)
        assert back == plan  # judged again by engine.capability, it reads the same
    infer8 = next(p for p in plans if p.workload.weight_bits == 8)
    assert not infer8.runs_here and "8-bit inference" in infer8.runs_here_reason
    stale = json.loads(infer8.to_json())
    stale["runs_here"], stale["runs_here_reason"] = True, ""
    assert Plan.from_dict(stale).runs_here is True  # a saved verdict is read back as written, not re-judged

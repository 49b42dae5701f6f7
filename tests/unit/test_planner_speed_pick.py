"""The speed model at layouts nothing published measures: selective checkpointing and small micro-batches.

The planner's search picks among layouts; each term that separates them must never make a layout look faster
than the physics allows: recomputing is never free, and splitting a batch into more micro-batches never makes
a compute-bound step cheaper per token.
"""

from __future__ import annotations

import dataclasses

import pytest

from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.models.describe import describe_model
from rigpilot.engine.models.spec import Linear, ModelSpec
from rigpilot.engine.planner.links import Topology
from rigpilot.engine.planner.memory import MemoryModel
from rigpilot.engine.planner.model import model_facts
from rigpilot.engine.planner.plan import Parallelism, Workload
from rigpilot.engine.planner.speed import (
    ELEMENTWISE_TRAIN_PASSES,
    SpeedModel,
    fsdp_copy_out_bytes,
    recompute_bytes_per_token,
)


def llama_7b() -> ModelSpec:
    h, inter, layers, vocab = 4096, 11008, 32, 32000
    lin = [
        Linear("q_proj", h, h), Linear("k_proj", h, h), Linear("v_proj", h, h), Linear("o_proj", h, h),
        Linear("gate_proj", h, inter), Linear("up_proj", h, inter), Linear("down_proj", inter, h),
    ]
    return ModelSpec(
        id="llama-2-7b", architecture="LlamaForCausalLM", model_type="llama", params_total=6_738_415_616,
        params_active=6_738_415_616, params_embedding=vocab * h, hidden_size=h, num_layers=layers, num_heads=32,
        num_kv_heads=32, head_dim=128, intermediate_size=inter, vocab_size=vocab, max_position_embeddings=4096,
        tied_embeddings=False, layer_linears=lin,
    )


def topo(profile: str) -> Topology:
    machine = load_profile(profile)
    return Topology(machine, [g.index for g in machine.gpus])


def speed_model(t: Topology, **work) -> SpeedModel:
    w = Workload(model="llama-2-7b", **{"seq_len": 4096, "global_batch": 16, **work})
    m = model_facts(llama_7b())
    return SpeedModel(m, w, t, MemoryModel(m, w))


def fsdp8(**kw) -> Parallelism:
    base = dict(gpu_indices=list(range(8)), dp=8, tp=1, pp=1, zero_stage=3, shard_degree=8, backend="fsdp",
                micro_batch=2, grad_accum=1, checkpointing="none")
    return Parallelism(**{**base, **kw})


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("mb", [1, 2, 4])
def test_selective_sits_between_no_checkpointing_and_full(compile: bool, mb: int):
    sm = speed_model(topo("8x-h100-sxm"), global_batch=8 * mb)
    t = {ac: sm.train(fsdp8(micro_batch=mb, checkpointing=ac), detail=False, compile=compile).step_s
         for ac in ("none", "selective", "full")}
    assert t["none"] < t["selective"] < t["full"]


def test_selective_recompute_is_memory_traffic_and_compile_fuses_it():
    m = model_facts(llama_7b())
    eager, compiled = recompute_bytes_per_token(m, False), recompute_bytes_per_token(m, True)
    # Two eager RMSNorms (36 B/element), two residual adds, rotary on q and k, SiLU(gate)*up.
    assert eager == pytest.approx(2 * 36 * 4096 + 2 * 6 * 4096 + 20 * (4096 + 4096) + 10 * 11008)
    assert 0 < compiled < eager / 3


def test_compile_makes_selective_recompute_cheaper_than_eager():
    sm = speed_model(topo("8x-h100-sxm"), global_batch=16)

    def cost(compile: bool) -> float:
        none = sm.train(fsdp8(), detail=False, compile=compile).compute_s
        return sm.train(fsdp8(checkpointing="selective"), detail=False, compile=compile).compute_s / none

    assert 1.0 < cost(True) < cost(False)


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
@pytest.mark.parametrize("profile", ["8x-h100-sxm", "8x-a100-pcie"])
def test_smaller_micro_batches_are_never_cheaper_per_token(ac: str, profile: str):
    sm = speed_model(topo(profile), global_batch=32)
    steps = [sm.train(fsdp8(micro_batch=mb, grad_accum=4 // mb, checkpointing=ac), detail=False).step_s for mb in (4, 2, 1)]
    assert steps[0] < steps[1] < steps[2]


def test_fsdp_copy_out_is_paid_per_micro_batch_on_the_compute_stream():
    sm = speed_model(topo("8x-h100-sxm"), global_batch=16)
    one = sm.train(fsdp8(micro_batch=2, grad_accum=1), detail=False)
    two = sm.train(fsdp8(micro_batch=1, grad_accum=2), detail=False)
    params, lin = sm.mm.stage_params(fsdp8(), 0)
    blocks = lin + sm.m.layers * sm.m.layer_other_params
    bw = 3350e9 * 0.75  # H100 SXM HBM3, MEMORY_BW_EFFICIENCY
    copy_out = fsdp_copy_out_bytes(blocks * sm.mm.c, (params - blocks) * sm.mm.c, sm.m.layers, True) / bw
    # Resharded after forward, 3 of 4 blocks are gathered twice; the last block and the root (embedding, head)
    # once: FSDP2 keeps the root gathered from forward to backward, the engine the last block.
    assert fsdp_copy_out_bytes(100.0, 10.0, 4, True) == 2 * (25 * 7 + 10)
    assert fsdp_copy_out_bytes(100.0, 10.0, 4, False) == 2 * (100 + 10)
    # The second micro-batch copies every gathered unit out again; its matmuls also run on half the tokens.
    assert two.compute_s - one.compute_s >= copy_out * 0.99
    # Without sharding (DDP) there is no copy-out: only the blocks' elementwise ops, forward and backward.
    ddp = dataclasses.replace(fsdp8(), backend="ddp", zero_stage=0, shard_degree=1)
    elementwise = ELEMENTWISE_TRAIN_PASSES * 32 * 4096 * recompute_bytes_per_token(sm.m, False) / bw
    assert sm._memory_bound_s(ddp, sm.groups(ddp), 0, 32, 4096, False) == pytest.approx(elementwise)


def test_without_sequence_parallel_every_tp_rank_recomputes_the_whole_norms_and_residuals() -> None:
    """TP splits the activation and rotary by columns and heads; the norms and residual adds stay whole on every
    rank unless sequence parallel splits the tokens (dividing all of it by tp rated tp 8 about 5x too cheap)."""
    m = model_facts(describe_model("llama-3.1-8b"))
    one = recompute_bytes_per_token(m, False)
    tp8, tp8_sp = recompute_bytes_per_token(m, False, 8), recompute_bytes_per_token(m, False, 8, True)
    assert tp8_sp == pytest.approx(one / 8)
    assert one / 8 < tp8 < one


def llama_of_width(h: int) -> ModelSpec:
    """A Llama-2-shaped model that differs from another only in width (heads of 128, MLP at 11008/4096 of h)."""
    inter = h * 11008 // 4096
    lin = [
        Linear("q_proj", h, h), Linear("k_proj", h, h), Linear("v_proj", h, h), Linear("o_proj", h, h),
        Linear("gate_proj", h, inter), Linear("up_proj", h, inter), Linear("down_proj", inter, h),
    ]
    params = 32 * sum(u.in_features * u.out_features for u in lin) + 2 * 32000 * h
    return ModelSpec(
        id=f"llama-width-{h}", architecture="LlamaForCausalLM", model_type="llama", params_total=params,
        params_active=params, params_embedding=32000 * h, hidden_size=h, num_layers=32, num_heads=h // 128,
        num_kv_heads=h // 128, head_dim=128, intermediate_size=inter, vocab_size=32000, max_position_embeddings=4096,
        tied_embeddings=False, layer_linears=lin,
    )


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_a_narrower_model_never_reaches_a_higher_mfu_at_the_same_layout(compile: bool, ac: str):
    """Elementwise traffic grows with the width h per token, matmul FLOPs with h²: the narrower model spends a
    larger share of its step off the matmul units."""
    t = topo("8x-h100-sxm")
    w = Workload(model="llama", seq_len=4096, global_batch=16)
    mfu = []
    for h in (2048, 4096, 8192):
        m = model_facts(llama_of_width(h))
        sm = SpeedModel(m, w, t, MemoryModel(m, w))
        mfu.append(sm.train(fsdp8(checkpointing=ac), detail=False, compile=compile).mfu)
    assert mfu[0] < mfu[1] < mfu[2]


def test_every_step_pays_the_blocks_elementwise_traffic_and_recomputing_pays_it_once_more():
    sm = speed_model(topo("8x-h100-sxm"), global_batch=16)
    bw = 3350e9 * 0.75
    one_pass = 32 * 4096 * recompute_bytes_per_token(sm.m, False) / bw
    ddp = dict(backend="ddp", zero_stage=0, shard_degree=1)
    cost = {ac: sm._memory_bound_s(fsdp8(checkpointing=ac, **ddp), sm.groups(fsdp8(**ddp)), 0, 32, 4096, False)
            for ac in ("none", "selective", "full")}
    assert cost["none"] == pytest.approx(ELEMENTWISE_TRAIN_PASSES * one_pass)
    assert cost["selective"] == pytest.approx(cost["none"] + one_pass)
    assert cost["full"] == pytest.approx(cost["selective"])
    # Compile fuses the chains: the same step streams fewer bytes.
    fused = sm._memory_bound_s(fsdp8(**ddp), sm.groups(fsdp8(**ddp)), 0, 32, 4096, True)
    assert 0 < fused < cost["none"] / 3


def test_the_elementwise_share_of_a_layer_shrinks_with_width():
    """Per token, a 7B-wide layer's elementwise bytes against its matmul FLOPs are about twice a 70B-wide one's."""
    def bytes_per_flop(h: int) -> float:
        m = model_facts(llama_of_width(h))
        return recompute_bytes_per_token(m, False) / sum(u.lin.in_features * u.lin.out_features for u in m.linears())

    assert bytes_per_flop(8192) < bytes_per_flop(4096) / 1.8

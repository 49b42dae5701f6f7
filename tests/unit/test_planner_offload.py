"""FSDP2 CPU offload and the ZeRO-2 form, against bytes counted by hand on a small Llama.

The model: h 256, MLP 688, 2 layers, 4 heads (2 KV heads of 64), vocabulary 1000, untied.
Per layer the linears hold 2·256·256 + 2·256·128 + 3·256·688 = 724,992 weights and the two norms 512;
embeddings and head 256,000 each, the final norm 256: 1,963,264 parameters in all.
"""

from __future__ import annotations

import dataclasses

import pytest

from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.models.spec import ModelSpec
from rigpilot.engine.planner.links import Topology
from rigpilot.engine.planner.memory import HOST_BYTES_PER_RANK, MemoryModel, plan_memory
from rigpilot.engine.planner.model import model_facts
from rigpilot.engine.planner.plan import LoraSettings, Parallelism, Workload
from rigpilot.engine.planner.speed import (
    CPU_OPTIMIZER_BYTES,
    DEEPSPEED_CPU_ADAM_BYTES,
    HOST_ACCUMULATE_BYTES,
    HOST_STREAM_PER_CORE_GBS,
    SpeedModel,
)
from rigpilot.engine.recipe import PLAIN_RECIPE

from support.planner_inputs import llama

P = 1_963_264
UNIT = 724_992 + 512 + 256 // 2  # one block as FSDP2 gathers it; the planner spreads the final norm over the blocks


def tiny() -> ModelSpec:
    return llama(256, 688, 2, 4, 2, 1000, P, "tiny")


def setup(profile: str = "4x-rtx4090"):
    machine = load_profile(profile)
    topo = Topology(machine, [g.index for g in machine.gpus])
    w = Workload(model="tiny", seq_len=512, global_batch=16)
    m = model_facts(tiny())
    mm = MemoryModel(m, w)
    return topo, mm, SpeedModel(m, w, topo, mm)


def fsdp(**kw) -> Parallelism:
    base = dict(gpu_indices=[0, 1, 2, 3], dp=4, zero_stage=3, shard_degree=4, backend="fsdp", micro_batch=1,
                grad_accum=4, checkpointing="none")
    return Parallelism(**{**base, **kw})


def test_tiny_model_count():
    m = model_facts(tiny())
    assert m.params == P
    assert m.layer_linear_params + m.layer_other_params == UNIT


def test_offload_holds_no_sharded_state_on_the_gpu_and_16_bytes_per_parameter_on_the_host():
    topo, mm, _ = setup()
    plain = mm.train_stage(fsdp(), 0, "ada")
    off = mm.train_stage(fsdp(offload_params=True, offload_optimizer=True), 0, "ada")
    assert (off.weights, off.gradients, off.optimizer) == (0, 0, 0)
    # Host, per rank: fp32 parameter shard 4 + fp32 gradient shard 4 + AdamW's two fp32 states 8, over 4 ranks.
    assert off.host_offloaded == pytest.approx(16 * P / 4)
    assert plain.host_offloaded == 0
    # The GPU keeps the gathered units and additionally stages two fp32 shards (parameter in, gradient out) of
    # this and the prefetched unit; no AdamW temporary, as the step runs on the CPU.
    assert off.activations == pytest.approx(plain.activations)
    assert off.buffers - plain.buffers == pytest.approx(2 * 2 * UNIT * 4 / 4)
    # Pinned host memory is not swappable: it counts against the machine's RAM with every rank's runtime.
    memory, host = plan_memory(mm, fsdp(offload_params=True, offload_optimizer=True), topo)
    assert host.offloaded == pytest.approx(16 * P, abs=4)
    assert host.needed == pytest.approx(4 * HOST_BYTES_PER_RANK + 16 * P, abs=4)
    assert host.available == topo.machine.host.memory_total
    assert all(m.weights == m.gradients == m.optimizer == 0 for m in memory)


def test_lora_offload_moves_the_frozen_base_too():
    m = model_facts(tiny())
    w = Workload(model="tiny", method="lora", seq_len=512, global_batch=16, lora=LoraSettings(rank=8, targets=["q_proj"]))
    mm = MemoryModel(m, w)
    off = mm.train_stage(fsdp(offload_params=True, offload_optimizer=True), 0, "ada")
    adapters = 2 * 8 * (256 + 256)  # rank 8 on q_proj (256 → 256) in both layers
    assert off.host_offloaded == pytest.approx((P * 2 + adapters * 16) / 4)  # bf16 base + fp32 adapter states


def test_offload_traffic_per_step():
    _, _, speed = setup()
    par = fsdp(offload_params=True, offload_optimizer=True)
    h2d, d2h, cpu = speed.offload_traffic(par)
    # 4 micro-batches; each gathers every unit for forward and again for backward, copying its fp32 shard in,
    # and copies its fp32 gradient shard out once.
    assert h2d == pytest.approx(4 * 2 * P * 4 / 4)
    assert d2h == pytest.approx(4 * P * 4 / 4)
    assert cpu == pytest.approx(P / 4 * CPU_OPTIMIZER_BYTES["adamw"])


def test_host_side_work_shares_each_sockets_memory_bandwidth():
    topo, _, speed = setup()
    bw = speed.host_memory_bandwidth()
    assert bw == pytest.approx(120e9)  # EPYC 7313 (DDR4, 8 channels): 120 GB/s per socket, one NUMA node per socket
    par = fsdp(offload_params=True, offload_optimizer=True)
    h2d, d2h, cpu = speed.offload_traffic(par)
    accumulate = speed.host_accumulate_bytes(par)
    assert accumulate == pytest.approx(3 * P / 4 * HOST_ACCUMULATE_BYTES)  # micro-batches 2-4 add onto the first
    # GPUs 0-1 and 2-3 share a socket each: two ranks stream through one socket's memory (8 cores each would
    # stream 80 GB/s, so the socket binds).
    rate = speed.host_rate(par, 0)
    assert rate == pytest.approx(bw / 2)
    t = speed.train(par)
    host_s = (accumulate + cpu) / rate
    pcie = topo.gpus[0].pcie_gbs * 1e9
    copies = max(max(h2d, d2h) / pcie, (h2d + d2h) / rate)  # both directions at once; host memory serves both
    assert host_s <= t.offload_s <= host_s + copies * (1 + 1 / 2)  # at worst all exposed, plus each pass's first unit
    # On one socket all four ranks share it: the host-side work alone takes twice as long.
    one = dataclasses.replace(topo.machine, gpus=[dataclasses.replace(g, numa_node=0) for g in topo.machine.gpus])
    topo1 = Topology(one, [0, 1, 2, 3])
    speed1 = SpeedModel(speed.m, speed.w, topo1, speed.mm)
    assert speed1.host_rate(par, 0) == pytest.approx(bw / 4)
    assert speed1.train(par).offload_s >= t.offload_s + host_s * 0.999


def test_a_rank_with_few_cores_streams_at_their_rate():
    topo, _, speed = setup()
    few = dataclasses.replace(topo.machine, host=dataclasses.replace(topo.machine.host, cores=8))
    s = SpeedModel(speed.m, speed.w, Topology(few, [0, 1, 2, 3]), speed.mm)
    par = fsdp(offload_params=True, offload_optimizer=True)
    assert s.host_rate(par, 0) == pytest.approx(2 * HOST_STREAM_PER_CORE_GBS * 1e9)  # 8 cores over 4 ranks


def test_offload_copies_hide_behind_compute_only_as_far_as_it_reaches():
    # A long sequence gives each micro-batch far more compute than its copies take: only the first unit of each
    # pass shows, plus the host-side work. Before, half the compute was assumed free to hide behind.
    topo = setup()[0]
    w = Workload(model="tiny", seq_len=4096, global_batch=16)
    m = model_facts(tiny())
    mm = MemoryModel(m, w)
    speed = SpeedModel(m, w, topo, mm)
    par = fsdp(offload_params=True, offload_optimizer=True)
    h2d, d2h, cpu = speed.offload_traffic(par)
    rate = speed.host_rate(par, 0)
    pcie = topo.gpus[0].pcie_gbs * 1e9
    per_mb = max(max(h2d, d2h) / pcie, (h2d + d2h) / rate) / 4
    t = speed.train(par)
    assert t.compute_s / 4 > per_mb
    assert t.offload_s == pytest.approx(4 * per_mb / 2 + (speed.host_accumulate_bytes(par) + cpu) / rate)


def test_full_offload_on_3090s_is_not_predicted_at_datacenter_mfu():
    # The case: 7B full training under FSDP2 CPU offload on two RTX 3090s was predicted at 43-50% MFU.
    from rigpilot.engine.models.describe import describe_model
    from rigpilot.engine.planner.search import search

    for seq, batch in ((2048, 16), (4096, 32)):
        r = search(describe_model("llama-2-7b"), load_profile("2x-rtx3090-nvlink"), Workload(model="llama-2-7b", seq_len=seq, global_batch=batch, **PLAIN_RECIPE))
        for p in [r.best, *r.runners_up]:
            assert p.parallelism.offload
            assert p.timing.mfu < 0.43, (seq, p.parallelism.describe(), p.timing.mfu)


def test_deepspeed_cpu_adam_is_bound_by_the_sockets_memory_bandwidth():
    _, _, speed = setup()
    par = dataclasses.replace(fsdp(offload_optimizer=True), backend="deepspeed", zero_stage=2, grad_accum=1)
    rate = speed.host_rate(par, 0)
    t = speed.train(par)
    assert t.offload_s >= P / 4 * DEEPSPEED_CPU_ADAM_BYTES / rate


def test_zero2_form_keeps_every_block_gathered_through_backward():
    _, mm, speed = setup()
    z3 = fsdp()
    z2 = fsdp(zero_stage=2)
    a, b = mm.train_stage(z3, 0, "ada"), mm.train_stage(z2, 0, "ada")
    assert (a.weights, a.gradients, a.optimizer) == (b.weights, b.gradients, b.optimizer)
    assert b.buffers >= 2 * UNIT * 2  # both blocks whole in bf16 at the end of forward
    # One all-gather per micro-batch instead of two.
    ta, tb = speed.train(z3), speed.train(z2)
    fa, fb = ta.comm[0].bytes_per_step, tb.comm[0].bytes_per_step
    gathered, reduced = P * 2, P * 2
    assert fa == pytest.approx(4 * (2 * gathered + reduced), abs=8)
    assert fb == pytest.approx(4 * (gathered + reduced), abs=8)

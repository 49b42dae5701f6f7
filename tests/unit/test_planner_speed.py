"""Step-time model: links, collectives, pipeline bubbles, calibration."""

from __future__ import annotations

import dataclasses

import pytest

from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.models.spec import Linear, ModelSpec
from rigpilot.engine.planner.links import Calibration, Topology
from rigpilot.engine.planner.memory import MemoryModel
from rigpilot.engine.planner.model import model_facts
from rigpilot.engine.planner.plan import Parallelism, Workload
from rigpilot.engine.planner.speed import SpeedModel, allreduce_s, bubble_fraction, gather_s, shape_factor


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


def topo(profile: str, gpus: list[int] | None = None, calibration: Calibration | None = None) -> Topology:
    machine = load_profile(profile)
    return Topology(machine, gpus if gpus is not None else [g.index for g in machine.gpus], calibration)


def speed_model(t: Topology, **work) -> SpeedModel:
    w = Workload(model="llama-2-7b", **{"seq_len": 2048, "global_batch": 16, **work})
    m = model_facts(llama_7b())
    return SpeedModel(m, w, t, MemoryModel(m, w))


def test_link_kinds_and_bandwidths():
    h100 = topo("8x-h100-sxm")
    assert h100.link(0, 7).kind == "nvswitch"
    assert h100.link(0, 7).gbs == pytest.approx(900 / 2 * 0.85)  # all 18 links, one direction

    a100 = topo("8x-a100-pcie")
    assert a100.link(0, 1).kind == "nvlink" and a100.link(0, 1).gbs == pytest.approx(300 * 0.85)  # NV12 bridge
    assert a100.link(0, 2).kind == "p2p" and a100.link(0, 2).label == "PCIe P2P (NODE)"
    assert a100.link(0, 4).kind == "sys"

    rtx = topo("4x-rtx4090")
    pcie = 1.969 * 16 * 0.8
    assert rtx.link(0, 1).kind == "host" and rtx.link(0, 1).gbs == pytest.approx(pcie * 0.5 * 0.8)  # no P2P
    assert rtx.link(0, 2).kind == "sys" and rtx.link(0, 2).gbs < rtx.link(0, 1).gbs

    nv4 = topo("2x-rtx3090-nvlink")
    assert nv4.link(0, 1).label == "NVLink NV4"
    assert nv4.link(0, 1).gbs == pytest.approx(112.5 / 2 * 0.85)  # 4 of the 3090's 4 links

    mixed = topo("mixed-4090-3090")
    assert mixed.link(0, 1).gbs == pytest.approx(1.969 * 4 * 0.8 * 0.5 * 0.8)  # the 3090 sits in an x4 slot


def test_slowest_link_binds_a_ring_and_shared_paths_split():
    a100 = topo("8x-a100-pcie")
    assert a100.ring([0, 1]).kind == "nvlink"
    assert a100.ring([0, 1, 2, 3]).kind == "p2p"
    assert a100.ring(list(range(8))).kind == "sys"
    one = a100.collective([[0, 4]])
    two = a100.collective([[0, 4], [1, 5]])
    assert two.gbs == pytest.approx(one.gbs / 2)


def test_fast_groups_for_tensor_parallelism():
    a100 = topo("8x-a100-pcie")
    assert a100.fast_partition(list(range(8)), 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert a100.fast_partition(list(range(8)), 4) is None
    assert topo("8x-h100-sxm").fast_partition(list(range(8)), 8) == [list(range(8))]
    assert topo("4x-rtx4090").fast_partition([0, 1, 2, 3], 2) is None
    bridged = topo("4x-rtxa6000-bridged")
    assert bridged.fast_partition([0, 2, 1, 3], 2) in ([[0, 1], [2, 3]], [[0, 1], [3, 2]])


def test_collective_formulas():
    link = topo("8x-h100-sxm").link(0, 1)
    b = 1e9
    assert allreduce_s(b, 8, link) == pytest.approx(2 * 7 / 8 * b / (link.gbs * 1e9) + 14 * link.latency_s)
    assert gather_s(b, 8, link) == pytest.approx(7 / 8 * b / (link.gbs * 1e9) + 7 * link.latency_s)
    assert allreduce_s(b, 1, link) == 0.0
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert bubble_fraction(1, 8) == 0.0
    assert shape_factor(4096, 4096) == pytest.approx(1.0)
    assert shape_factor(512, 768) < 0.5


def test_training_step_time_split():
    t = topo("8x-h100-sxm")
    sm = speed_model(t, global_batch=32)
    par = Parallelism(gpu_indices=list(range(8)), dp=8, zero_stage=3, shard_degree=8, backend="fsdp",
                      micro_batch=2, grad_accum=2, checkpointing="none")
    timing = sm.train(par)
    assert timing.step_s == pytest.approx(timing.compute_s + timing.exposed_comm_s + timing.bubble_s + timing.offload_s)
    assert timing.tokens_per_s == pytest.approx(32 * 2048 / timing.step_s)
    assert 0.2 < timing.mfu < 0.6
    assert timing.comm and timing.comm[0].what.startswith("FSDP")
    assert {f.source for f in timing.figures} >= {"spec", "assumed"}


def test_pipeline_bubble_does_not_grow_with_micro_batches():
    t = topo("8x-h100-sxm", [0, 1, 2, 3])
    kw = dict(gpu_indices=[0, 1, 2, 3], dp=1, pp=4, micro_batch=1, pipeline_schedule="1f1b", checkpointing="full",
              stage_layers=[[0, 8], [8, 16], [16, 24], [24, 32]])
    few = speed_model(t, global_batch=4).train(Parallelism(grad_accum=4, **kw))
    many = speed_model(t, global_batch=12).train(Parallelism(grad_accum=12, **kw))
    assert few.bubble_s == pytest.approx(many.bubble_s)
    assert many.bubble_s / many.step_s < few.bubble_s / few.step_s


def test_tensor_parallel_over_host_memory_is_costly():
    par = Parallelism(gpu_indices=[0, 1], dp=1, tp=2, backend="ddp", micro_batch=1, grad_accum=16,
                      sequence_parallel=True, checkpointing="full")
    nv = speed_model(topo("8x-h100-sxm", [0, 1])).train(par)
    host = speed_model(topo("4x-rtx4090", [0, 1])).train(par)
    assert nv.exposed_comm_s / nv.step_s < 0.1
    assert host.exposed_comm_s / host.step_s > 0.2


def test_calibration_replaces_priors():
    base = topo("4x-rtx4090")
    par = Parallelism(gpu_indices=[0, 1, 2, 3], dp=4, zero_stage=3, shard_degree=4, backend="fsdp",
                      micro_batch=1, grad_accum=4, checkpointing="full")
    before = speed_model(base).train(par)
    cal = Calibration(matmul_tflops={i: 150.0 for i in range(4)}, bus_bandwidth_gbs={"0,1,2,3": 20.0})
    measured = topo("4x-rtx4090", calibration=cal)
    assert measured.ring([0, 1, 2, 3]).measured and measured.ring([0, 1, 2, 3]).gbs == 20.0
    assert measured.ring([0, 1]).gbs == 20.0  # a measured ring bounds its subsets
    after = speed_model(measured).train(par)
    sources = {f.name: f.source for f in after.figures}
    assert sources["matmul TFLOP/s, GPU 0 (RTX 4090)"] == "measured"
    assert any(src == "measured" and name.startswith("bus bandwidth") for name, src in sources.items())
    assert after.compute_s < before.compute_s  # 150 × 0.8 beats 165 × 0.5
    assert Calibration.from_dict(cal.to_dict()) == cal


def test_token_budget_gives_time_to_finish():
    t = topo("8x-h100-sxm")
    sm = speed_model(t, token_budget=10**9)
    par = Parallelism(gpu_indices=list(range(8)), dp=8, zero_stage=3, shard_degree=8, backend="fsdp",
                      micro_batch=2, grad_accum=1)
    timing = sm.train(par)
    assert timing.time_to_budget_s == pytest.approx(1e9 / timing.tokens_per_s)


def test_inference_decode_is_memory_bound_and_tp_helps_on_nvswitch():
    t = topo("8x-h100-sxm")
    sm = speed_model(t, task="infer", seq_len=4096, global_batch=1, new_tokens=256)
    one = sm.infer(Parallelism(gpu_indices=[0], backend="inference"))
    tp2 = sm.infer(Parallelism(gpu_indices=[0, 1], tp=2, backend="inference"))
    weights_s = 6_738_415_616 * 2 / (3350e9 * 0.75)
    assert one.decode_token_s > weights_s
    assert tp2.decode_token_s < one.decode_token_s
    assert one.tokens_per_s == pytest.approx(256 / (one.prefill_s + 256 * one.decode_token_s))


def test_selective_and_full_recompute_cost_time():
    t = topo("8x-h100-sxm")
    sm = speed_model(t)
    par = Parallelism(gpu_indices=list(range(8)), dp=8, zero_stage=3, shard_degree=8, backend="fsdp",
                      micro_batch=2, grad_accum=1)
    steps = [sm.train(dataclasses.replace(par, checkpointing=c)).compute_s for c in ("none", "selective", "full")]
    assert steps[0] < steps[1] < steps[2]
    assert steps[2] / steps[0] == pytest.approx(4 / 3, rel=0.08)  # one more forward pass


def test_fsdp_accumulation_reduce_scatters_every_micro_batch():
    # The engine reduce-scatters each micro-batch into the sharded gradients (parallelize.set_gradient_sync):
    # the FSDP traffic grows with the accumulation count, one gather-and-reduce-scatter round per micro-batch.
    t = topo("8x-h100-sxm")
    kw = dict(gpu_indices=list(range(8)), dp=8, zero_stage=3, shard_degree=8, backend="fsdp", micro_batch=2,
              checkpointing="none")  # fmt: skip
    one = speed_model(t, global_batch=16).train(Parallelism(grad_accum=1, **kw)).comm[0]
    four = speed_model(t, global_batch=64).train(Parallelism(grad_accum=4, **kw)).comm[0]
    assert one.what.startswith("FSDP2") and four.what == one.what
    assert four.bytes_per_step == 4 * one.bytes_per_step
    assert four.seconds == pytest.approx(4 * one.seconds)


def test_compile_uses_the_compiled_share_and_leaves_communication_alone():
    from rigpilot.engine.planner.links import COMPILED_EFFICIENCY_PRIOR, EFFICIENCY_PRIOR

    sm = speed_model(topo("8x-h100-sxm"))
    par = Parallelism(gpu_indices=list(range(8)), dp=8, tp=1, pp=1, zero_stage=3, shard_degree=8, backend="fsdp",
                      micro_batch=2, grad_accum=1)
    eager = sm.train(par)
    compiled = sm.train(par, compile=True)
    assert sm.timing(par, compile=True).step_s == compiled.step_s
    # The matmul work runs at the compiled share of peak; the optimizer step (memory-bound) and the collectives
    # are the same either way.
    ratio = COMPILED_EFFICIENCY_PRIOR["hopper"] / EFFICIENCY_PRIOR["hopper"]
    assert 1.0 < ratio < 1.5
    assert compiled.step_s < eager.step_s
    assert sum(c.bytes_per_step for c in compiled.comm) == sum(c.bytes_per_step for c in eager.comm)
    assert any("compiled" in f.name for f in compiled.figures)
    assert not any("compiled" in f.name for f in eager.figures)


def test_a_measured_matmul_rate_takes_the_compile_gain():
    cal = Calibration(matmul_tflops={0: 600.0})
    t = topo("8x-h100-sxm", [0], cal)
    g = t.gpus[0]
    assert g.step_tflops("bf16") == pytest.approx(600.0 * 0.8)
    assert g.step_tflops("bf16", compile=True) == pytest.approx(600.0 * 0.8 * g.compiled_efficiency / g.efficiency)


def test_experts_touched_by_a_decode_batch():
    from rigpilot.engine.planner.speed import experts_touched

    assert experts_touched(2, 8, 1) == pytest.approx(2.0)  # one token: its top-2
    assert experts_touched(2, 8, 2) == pytest.approx(8 * (1 - 0.75**2))  # 3.5: two tokens overlap sometimes
    assert experts_touched(2, 8, 64) == pytest.approx(8.0, rel=1e-6)  # a large batch reaches every expert
    assert experts_touched(8, 8, 1) == 8.0


def test_mixture_of_experts_decode_reads_only_the_experts_its_tokens_reach():
    from rigpilot.engine.models.describe import describe_model
    from rigpilot.engine.planner.links import MEMORY_BW_EFFICIENCY
    from rigpilot.engine.planner.speed import DECODE_OVERHEAD_PER_LAYER_S

    spec = describe_model("mixtral-8x7b")
    m = model_facts(spec)
    t = topo("4x-rtxa6000-bridged")
    # One GPU's view (the speed model does not ask whether it fits): every layer read per decoded token.
    par = Parallelism(gpu_indices=[0], dp=1, tp=1, pp=1, backend="inference")

    def decode(batch: int) -> tuple[float, float]:
        w = Workload(model="mixtral-8x7b", task="infer", precision="bf16", seq_len=512, new_tokens=64, global_batch=batch)
        mm = MemoryModel(m, w)
        return SpeedModel(m, w, t, mm).infer(par).decode_token_s, mm.infer_stage(par, 0, None).weights

    one, weights = decode(1)
    # Batch 1: everything but six of the eight experts' weights is read (attention, router, top-2).
    expert = sum(u.weight_params for u in (*m.mlp_in, *m.mlp_out) if u.lin.expert) * 2 * m.layers
    read = weights - expert * 6 / 8
    bw = t.gpus[0].memory_bandwidth_gbs * 1e9 * MEMORY_BW_EFFICIENCY
    assert read < 0.45 * weights  # Mixtral's experts are ~96% of a layer: top-2 of 8 reads about a third
    # Memory-bound, plus the per-layer launch overhead.
    assert one == pytest.approx(read / bw + m.layers * DECODE_OVERHEAD_PER_LAYER_S, rel=0.05)
    assert one < 0.45 * decode(64)[0]  # a large batch reaches every expert


def test_tensor_parallel_does_not_split_the_experts_compute():
    from rigpilot.engine.models.describe import describe_model

    m = model_facts(describe_model("mixtral-8x7b"))
    w = Workload(model="mixtral-8x7b", task="infer", precision="bf16", seq_len=2048, new_tokens=1, global_batch=1)
    sm = SpeedModel(m, w, topo("4x-rtxa6000-bridged"), MemoryModel(m, w))
    one = sm.infer(Parallelism(gpu_indices=[0], dp=1, tp=1, pp=1, backend="inference")).prefill_s
    two = sm.infer(Parallelism(gpu_indices=[0, 1], dp=1, tp=2, pp=1, backend="inference")).prefill_s
    # Every rank runs the whole MoE MLP (experts are ~90% of the matmuls here): TP2 does not halve prefill
    # (its all-reduces over the bridge even make it slower here).
    assert two > 0.85 * one

"""The CUDA caching allocator's rules (engine.planner.allocator) and the reserve the memory model adds for them."""

from __future__ import annotations

import pytest

from rigpilot.engine.models.describe import describe_model
from rigpilot.engine.planner.allocator import MIB, CachingAllocator, reserved_for, round_request, segment_size
from rigpilot.engine.planner.memory import LOSS_FRAGMENTATION, MemoryModel
from rigpilot.engine.planner.model import model_facts
from rigpilot.engine.planner.plan import LoraSettings, Parallelism, Workload


def test_requests_are_rounded_and_segments_sized_as_the_allocator_does():
    assert round_request(1) == 512 and round_request(512) == 512 and round_request(513) == 1024
    assert segment_size(1 * MIB) == 2 * MIB  # small pool
    assert segment_size(1 * MIB + 512) == 20 * MIB  # large pool, under 10 MiB
    assert segment_size(10 * MIB) == 10 * MIB and segment_size(11 * MIB) == 12 * MIB  # rounded to 2 MiB


def test_persistent_tensors_pack_into_segments():
    assert reserved_for([(1000, 3)]) == 2 * MIB  # three 1024 B blocks in one small segment
    assert reserved_for([(8 * MIB, 5)]) == 3 * 20 * MIB  # two 8 MiB blocks per 20 MiB segment
    assert reserved_for([(32 * MIB, 4)]) == 4 * 32 * MIB  # a power-of-two weight wastes nothing
    assert reserved_for([(129.5 * MIB, 2)]) == 2 * 130 * MIB


def test_replay_splits_reuses_merges_and_keeps_what_it_reserved():
    a = CachingAllocator()
    a.malloc("x", 30 * MIB)
    a.free("x")
    a.malloc("y", 12 * MIB)  # fits the cached 30 MiB block: split (18 MiB left, more than 1 MiB)
    assert a.reserved == 30 * MIB
    a.malloc("z", 18 * MIB)  # the rest of it
    assert a.reserved == 30 * MIB and a.peak_allocated == 30 * MIB
    a.free("y")
    a.free("z")  # merged again into one 30 MiB block
    a.malloc("w", 30 * MIB)
    assert a.reserved == 30 * MIB
    a.free("w")
    # A request larger than every cached block takes a new segment; the cached ones stay reserved.
    a.malloc("big", 40 * MIB)
    assert a.reserved == 70 * MIB and a.peak_reserved == 70 * MIB and a.allocated == 40 * MIB
    # A block is not split when 1 MiB or less would remain: the request takes it whole.
    b = CachingAllocator()
    b.malloc("p", 12 * MIB)
    b.free("p")
    b.malloc("q", 11 * MIB + 512)
    b.malloc("r", 512 * 1024)  # small pool: its own 2 MiB segment, not the large block's remainder
    assert b.reserved == 12 * MIB + 2 * MIB


def test_training_reserve_is_rounding_plus_the_loss_fragmentation():
    spec = describe_model("llama-3.1-8b")
    m = model_facts(spec)
    w = Workload(model="llama-3.1-8b", method="lora", lora=LoraSettings(rank=16), seq_len=2048, global_batch=2)
    mm = MemoryModel(m, w)
    par = Parallelism(gpu_indices=[0], dp=1, tp=1, pp=1, backend="single", micro_batch=2, grad_accum=1, checkpointing="full")
    stage = mm.train_stage(par, 0, "ada lovelace")
    loss = stage.buffers  # one GPU, no collectives: the loss's logits are the step's buffers
    reserve = mm.allocator_reserve(par, 0, loss=loss, optimizer_temporaries=False)
    # Rounding: k_proj and v_proj (8 MiB each in bf16) share a 20 MiB segment in every layer, leaving 4 MiB
    # no later request of the step uses; the other weights are multiples of 2 MiB; the adapters fill 2 MiB
    # segments of the small pool, up to one partly.
    assert reserve == pytest.approx(LOSS_FRAGMENTATION * loss + 32 * 4 * MIB, abs=2 * MIB)
    assert stage.overhead == pytest.approx(0.55 * 1024**3 + reserve, rel=1e-6)
    # Full fine-tuning adds the optimizer's temporaries of the embedding and head: 2 GiB each in fp32.
    full = MemoryModel(m, Workload(model="llama-3.1-8b", method="full", seq_len=2048, global_batch=1))
    one = Parallelism(gpu_indices=[0], dp=1, tp=1, pp=1, backend="single", micro_batch=1, grad_accum=1)
    r = full.allocator_reserve(one, 0, loss=0.0, optimizer_temporaries=True)
    assert r == pytest.approx(2 * 128256 * 4096 * 4, rel=0.01)


def test_qlora_counts_the_dequantized_weight_of_its_largest_matmul():
    spec = describe_model("llama-3.1-8b")
    m = model_facts(spec)
    par = Parallelism(gpu_indices=[0], dp=1, tp=1, pp=1, backend="single", micro_batch=1, grad_accum=1, checkpointing="full")
    lora = dict(model="llama-3.1-8b", lora=LoraSettings(rank=16), seq_len=2048, global_batch=1)
    q = MemoryModel(m, Workload(method="qlora", **lora)).train_stage(par, 0, "ada lovelace")
    plain = MemoryModel(m, Workload(method="lora", **lora)).train_stage(par, 0, "ada lovelace")
    # The buffers differ by one bf16 copy of the largest NF4 weight (gate/up/down: 4096 × 14336).
    assert q.buffers - plain.buffers == pytest.approx(4096 * 14336 * 2, rel=1e-6)

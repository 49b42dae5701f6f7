"""Gradient accumulation under FSDP2 keeps the gradients sharded between micro-batches.

The engine's own wrapping (apply_data_parallel) and its accumulation switch (set_gradient_sync, as
train.py holds it around each micro-batch) on real gloo ranks: after the first micro-batch every
parameter's gradient is already this rank's shard (a DTensor of about half the parameter on 2
ranks), not an unsharded gradient FSDP2 keeps aside until the last micro-batch, and after the last
the gradients are those of a plain single-process loop over every rank's micro-batches. HSDP (4
ranks) sums its reduce-scattered shards until the last micro-batch and all-reduces them once.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from rigpilot.engine.accuracy.tp import free_port

from support.paths import TINY_LLAMA_CONFIG

pytestmark = pytest.mark.slow

MICRO = 2  # micro-batches per step on every rank


def _tiny_llama() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_LLAMA_CONFIG.parent))


def _batch(replica: int, micro: int) -> torch.Tensor:
    return torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(100 * replica + micro))


def _summed_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")


def _accumulate(rank: int, world: int, port: int, shape: dict[str, int], offload: bool, queue: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from rigpilot.engine.workers.parallel_dims import MESH_DIMS, ParallelDims, Runtime
    from rigpilot.engine.workers.parallelize import (
        apply_data_parallel,
        offloaded_shards,
        precision_plan,
        set_gradient_sync,
    )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dims = ParallelDims(pp=1, tp=1, world_size=world, **shape)
        mesh = init_device_mesh("cpu", dims.shape, mesh_dim_names=MESH_DIMS)
        runtime = Runtime(rank, rank, world, torch.device("cpu"), "gloo", dims, mesh)
        whole, model = _tiny_llama(), _tiny_llama()
        wrapped = apply_data_parallel(model, runtime, precision_plan("fp32", runtime), cpu_offload=offload)
        if offload:
            on_host, total = offloaded_shards(model)
            assert on_host == total, (on_host, total)
        shard = dims.dp_shard
        hsdp = dims.dp_replicate > 1
        for micro in range(MICRO):
            last = micro == MICRO - 1
            with set_gradient_sync(wrapped, last):
                _summed_loss(wrapped, _batch(rank, micro)).backward()
            if last:
                break
            if hsdp:
                # Until the last micro-batch FSDP2 keeps HSDP's reduce-scattered sums in one flat
                # buffer per block: sharded, not the unsharded gradients.
                held = 0
                for module in wrapped.modules():
                    state = getattr(module, "_get_fsdp_state", None)
                    group = state and getattr(state(), "_fsdp_param_group", None)
                    if group is not None:
                        assert group._partial_reduce_output is not None, type(module).__name__
                        assert all(fp.unsharded_accumulated_grad is None for fp in group.fsdp_params)
                        held += group._partial_reduce_output.numel()
                locals_ = sum(p.to_local().numel() for p in wrapped.parameters())
                assert held == locals_, (held, locals_)
                continue
            for name, p in wrapped.named_parameters():
                assert isinstance(p.grad, DTensor), (name, type(p.grad))
                assert p.grad.placements == (Shard(0),), name
                rows = p.size(0)
                assert p.grad.to_local().size(0) == (rows + shard - 1) // shard, (name, p.grad.to_local().shape)
                assert p.grad.to_local().device.type == "cpu"
        # The plain loop: every rank's micro-batches, summed; FSDP2 averages over the data-parallel ranks.
        reference = sum(_summed_loss(whole, _batch(r, m)) for r in range(world) for m in range(MICRO))
        (reference / world).backward()
        worst = 0.0
        for (name, p), q in zip(wrapped.named_parameters(), whole.parameters(), strict=True):
            got = p.grad.full_tensor()
            assert torch.allclose(got, q.grad, atol=1e-6, rtol=1e-5), name
            worst = max(worst, float((got - q.grad).abs().max()))
        queue.put((rank, worst))
    except BaseException as e:
        queue.put((rank, repr(e)))
        raise
    finally:
        dist.destroy_process_group()


def _run(world: int, shape: dict[str, int], offload: bool = False) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_accumulate, args=(r, world, port, shape, offload, queue)) for r in range(world)]
    for p in procs:
        p.start()
    answers = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    failed = {r: a for r, a in answers.items() if isinstance(a, str)}
    assert not failed, failed


@pytest.mark.parametrize("offload", [False, True], ids=["fsdp", "fsdp-offload"])
def test_fsdp_accumulates_into_sharded_gradients(offload: bool) -> None:
    _run(2, {"dp_replicate": 1, "dp_shard": 2}, offload)


def test_hsdp_reduce_scatters_every_micro_batch_and_all_reduces_once() -> None:
    _run(4, {"dp_replicate": 2, "dp_shard": 2})

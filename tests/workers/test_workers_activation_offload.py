"""Activation offloading (`--activation-offload`, torchtune's OffloadActivations): a plain PyTorch loop written
here trains bit for bit the same with the worker's saved-tensor hooks around its forward as without, with and
beside activation checkpointing; weights, small tensors and the output head's tensors stay on the device; and
the planner's trace leaves the offloaded activations out of the device's peak, as a real step measures it.

The layouts (DDP, FSDP2, tensor and pipeline parallel) are in test_workers_activation_layouts.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from rigpilot.engine.layout import Layout
from rigpilot.engine.workers.activation_offload import (
    MIN_OFFLOAD_BYTES,
    ActivationOffload,
    HostStore,
    offload_activations,
)
from rigpilot.engine.workers.chunked_loss import TokenLoss
from rigpilot.engine.workers.parallelize import apply_activation_checkpointing

from support.paths import TINY_LLAMA_CONFIG

STEPS = 3


def plain_loop(offload: bool, checkpointing: str, chunks: int = 1) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Three AdamW steps of the tiny Llama in fp32: each step's loss and gradients, and what was offloaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_LLAMA_CONFIG.parent), dtype=torch.float32)
    model.train()
    apply_activation_checkpointing(model, checkpointing)
    hooks = offload_activations(model, offload, torch.device("cpu"))
    loss_fn = TokenLoss(model, chunks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    out: list[torch.Tensor] = []
    for _ in range(STEPS):
        ids = torch.randint(512, (2, 33), generator=g)
        optimizer.zero_grad(set_to_none=True)
        with loss_fn.model_output(), hooks.saving():
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits
        loss = loss_fn(logits, ids[:, 1:])
        loss.backward()
        out += [loss.detach()] + [p.grad.clone() for p in model.parameters()]
        optimizer.step()
    return out, {"tensors": hooks.offloaded, "bytes": hooks.offloaded_bytes}


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_offloaded_activations_train_bit_for_bit_what_kept_ones_train(checkpointing: str) -> None:
    kept, nothing = plain_loop(False, checkpointing)
    offloaded, sent = plain_loop(True, checkpointing)
    assert nothing == {"tensors": 0, "bytes": 0} and sent["tensors"] > 0
    assert len(kept) == len(offloaded) and all(torch.equal(a, b) for a, b in zip(kept, offloaded, strict=True))


def test_offloading_and_the_loss_in_chunks_together_train_what_the_plain_loop_trains() -> None:
    kept, _ = plain_loop(False, "full")
    both, _ = plain_loop(True, "full", chunks=4)
    per_step = len(kept) // STEPS
    first = zip(kept[:per_step], both[:per_step], strict=True)  # later steps: AdamW magnifies 1e-7s in its update
    assert all(float((a - b).norm()) <= 1e-6 * float(a.norm()) for a, b in first)
    losses = [float(kept[i]) for i in range(0, len(kept), per_step)]
    assert [float(both[i]) for i in range(0, len(both), per_step)] == pytest.approx(losses, rel=1e-6)


def test_checkpointed_blocks_send_only_their_inputs() -> None:
    """Under full checkpointing a block keeps its input (batch x seq x hidden) and what it recomputes stays:
    per step and block, that input (and the rotary tables it is handed) goes to the host, nothing else."""
    _, sent = plain_loop(True, "full")
    _, none_sent = plain_loop(True, "none")
    hidden_bytes = 2 * 32 * 64 * 4
    blocks = 4
    assert sent["bytes"] >= STEPS * blocks * hidden_bytes
    assert sent["bytes"] < none_sent["bytes"] / 4


class RecordingStore(HostStore):
    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.shapes: list[torch.Size] = []
        self.storages: set[int] = set()

    def put(self, t: torch.Tensor) -> torch.Tensor | None:
        self.shapes.append(t.shape)
        self.storages.add(t.untyped_storage().data_ptr())
        return super().put(t)


def test_weights_small_tensors_and_the_heads_stay_on_the_device() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_LLAMA_CONFIG.parent))
    hooks = offload_activations(model, True, torch.device("cpu"))
    store = RecordingStore()
    hooks.store = store
    ids = torch.randint(512, (2, 32))
    with hooks.saving():
        logits = model(input_ids=ids, use_cache=False).logits
    F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert store.shapes and all(s.numel() * 4 >= MIN_OFFLOAD_BYTES for s in store.shapes)
    assert not store.storages & weights
    assert not any(s[-1] == model.config.vocab_size for s in store.shapes)  # the head's input and logits stayed

    bare = ActivationOffload(True, HostStore(torch.device("cpu")))
    weight = model.lm_head.weight
    assert bare._pack(weight) is weight and bare._pack(weight.t())._base is weight
    small = torch.ones(MIN_OFFLOAD_BYTES // 4 - 1)
    assert bare._pack(small) is small
    assert bare.offloaded == 0


BIG_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 344,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512,
    "max_position_embeddings": 512, "tie_word_embeddings": False,
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_the_trace_leaves_offloaded_activations_off_the_device_as_a_real_step_does(
    tmp_path: Path, checkpointing: str
) -> None:
    from rigpilot.engine.workers import memtrace

    (tmp_path / "config.json").write_text(json.dumps(BIG_LLAMA))
    config = memtrace._load_config(str(tmp_path), False)
    peaks = {}
    for offload in (False, True):
        workload = {"model": str(tmp_path), "task": "train", "method": "full", "precision": "fp32",
                    "seq_len": 256, "activation_offload": offload}  # fmt: skip
        # Enough blocks and tokens that the blocks' inputs, not the weights and AdamW's state, make the peak.
        par = {"micro_batch": 8, "grad_accum": 1, "checkpointing": checkpointing}
        real = memtrace._trace_step(config, 4, workload, par, Layout.from_dict({}), False, real=True)
        fake = memtrace._trace_step(config, 4, workload, par, Layout.from_dict({}), False)
        assert abs(fake.forward_backward - real.forward_backward) <= 0.03 * real.forward_backward
        peaks[offload] = real.forward_backward
    assert peaks[True] < peaks[False]


def test_tensor_parallels_dtensors_go_to_the_host_as_their_local_shards() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        weight = torch.nn.Parameter(distribute_tensor(torch.randn(64, 64), mesh, [Shard(0)]))
        x = distribute_tensor(torch.randn(8, 64), mesh, [Shard(0)])
        grads, store = [], RecordingStore()
        for offload in (False, True):
            hooks = ActivationOffload(offload, store)
            weight.grad = None
            with hooks.saving():
                y = torch.tanh(x @ weight)
            assert isinstance(y, DTensor)
            y.sum().backward()
            grads.append(weight.grad.full_tensor())
        assert hooks.offloaded == 2 and store.shapes == [torch.Size([8, 64])] * 2  # x for the matmul, tanh's output
        assert torch.equal(grads[0], grads[1])
    finally:
        dist.destroy_process_group()

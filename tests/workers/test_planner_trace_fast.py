"""The fast trace (fewer blocks, AdamW's state made without a step) against the whole model and the old counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rigpilot.engine.layout import Layout

# Big enough that the weights, not the framework's fixed buffers, make the peak; fake tensors cost nothing.
LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "intermediate_size": 2816,
    "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 8, "vocab_size": 8000,
    "max_position_embeddings": 1024, "tie_word_embeddings": False,
}  # fmt: skip
BLOCKS = LLAMA["num_hidden_layers"]


def _config(tmp_path: Path, **extra: object):
    from rigpilot.engine.workers import memtrace

    folder = tmp_path / "llama"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**LLAMA, **extra}))
    return str(folder), memtrace._load_config(str(folder), False)


def _workload(model: str, **recipe: object) -> dict:
    return {"model": model, "task": "train", "method": "full", "precision": "bf16", "seq_len": 128, "lora": None,
            **recipe}  # fmt: skip


CASES = [
    # FSDP over 2 with a second micro-batch and full checkpointing: the fewer blocks are 3 and 4.
    ({"dp_shard": 2}, {"micro_batch": 2, "grad_accum": 2, "checkpointing": "full"}, {}),
    # One device, pure bf16, the loss in chunks and activations offloaded: 2 and 3.
    ({}, {"micro_batch": 2, "grad_accum": 1, "checkpointing": "full"},
     {"master_weights": "bf16", "loss_chunks": 4, "activation_offload": True}),
    # Tensor parallel with sequence parallelism, no checkpointing: 2 and 3.
    ({"tp": 2, "sequence_parallel": True}, {"micro_batch": 1, "grad_accum": 1, "checkpointing": "none"}, {}),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("mesh", "par", "recipe"), CASES, ids=["fsdp", "single-recipe", "tp-sp"])
def test_fewer_blocks_give_the_old_counts_figures_and_the_whole_models(tmp_path, mesh, par, recipe):
    from rigpilot.engine.workers import memtrace

    model, config = _config(tmp_path)
    workload, layout = _workload(model, **recipe), Layout.from_dict(mesh)
    counts = memtrace._block_counts(config, layout)
    assert counts == ((3, 4) if "dp_shard" in mesh else (2, 3))

    def scaled(pair: tuple[int, int]):
        low, high = (memtrace._trace_step(config, n, workload, par, layout, False) for n in pair)
        return memtrace._extrapolate(low, high, pair, BLOCKS)

    fast, old = scaled(counts), scaled(memtrace.SCALE_FROM)
    assert (fast.forward_backward, fast.optimizer, fast.categories) == (old.forward_backward, old.optimizer,
                                                                        old.categories)  # fmt: skip
    whole = memtrace._trace_step(config, BLOCKS, workload, par, layout, False)
    assert fast.peak == pytest.approx(whole.peak, rel=0.005)
    assert fast.optimizer == pytest.approx(whole.optimizer, rel=0.005)


@pytest.mark.slow
def test_a_pipeline_stage_traced_with_fewer_blocks_gives_the_old_counts_figures(tmp_path):
    from rigpilot.engine.workers import memtrace

    model, config = _config(tmp_path, num_hidden_layers=12)
    layout = Layout.from_dict({"pp": 2, "pp_microbatches": 4})
    par = {"micro_batch": 1, "grad_accum": 4, "checkpointing": "selective"}
    counts = memtrace._block_counts(config, layout)
    assert counts == (2, 3)
    fast, old = (
        memtrace._trace_pipeline(config, 12, _workload(model), par, layout, False, 0.0, pair)
        for pair in (counts, memtrace.SCALE_FROM)
    )
    assert (fast["peak"], fast["stages"], fast["phases"]) == (old["peak"], old["stages"], old["phases"])


def test_blocks_not_all_alike_keep_the_difference_of_two(tmp_path):
    from rigpilot.engine.workers import memtrace

    _, config = _config(tmp_path, layer_types=["sliding_attention", "full_attention"] * 4)
    assert memtrace._block_counts(config, Layout.from_dict({"dp_shard": 2})) == memtrace.SCALE_FROM
    assert memtrace._block_counts(config, Layout()) == memtrace.SCALE_FROM
    _, config = _config(tmp_path, layer_types=["full_attention"] * 8)
    assert memtrace._block_counts(config, Layout()) == (2, 3)
    config.model_type = "deepseek_v3"  # dense first layers, then experts: not known to be alike
    assert memtrace._block_counts(config, Layout()) == memtrace.SCALE_FROM
    # FSDP2's CPU offload is FSDP on one rank too: a middle block.
    config.model_type = "llama"
    assert memtrace._block_counts(config, Layout.from_dict({"cpu_offload": True})) == (3, 4)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamws_steady_state_is_the_state_its_first_step_leaves(amsgrad):
    import torch

    from rigpilot.engine.workers import memtrace

    def state_after(steady: bool) -> list[dict[str, tuple]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4, bias=False)).to(torch.bfloat16)
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), amsgrad=amsgrad)
        if steady:
            memtrace._steady_state(optimizer, params)
        else:
            for p in params:
                p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in params)
        return [
            {k: (t.shape, t.dtype, t.device, t.sum().item()) for k, t in optimizer.state[p].items()} for p in params
        ]

    assert state_after(steady=True) == state_after(steady=False)


def test_a_repo_the_planner_answered_from_its_preset_is_traced_from_the_same_config(monkeypatch, tmp_path) -> None:
    """Offline with an empty cache, the planner describes meta-llama/Llama-3.1-8B from the preset made from that
    repo's config; the trace read the same id through transformers and said "cannot load its config"."""
    from rigpilot.engine.models.presets import preset_for_repo
    from rigpilot.engine.workers import memtrace

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    config = memtrace._read_config("meta-llama/Llama-3.1-8B", False)
    preset = preset_for_repo("meta-llama/Llama-3.1-8B")
    assert preset is not None
    assert (config.num_hidden_layers, config.vocab_size) == (preset.config["num_hidden_layers"], preset.config["vocab_size"])


def test_cpu_offload_with_the_loss_in_chunks_leaves_the_host_shards_out_of_the_gpus_peak(tmp_path) -> None:
    """FSDP2's CPU offload keeps the shards, their gradients and AdamW's state in host memory. The chunked loss
    calls the head again, which once sent the trace to the plain tracker, whose categories cannot tell a host
    shard from the GPU's copy: the GPU's peak then held the whole model's state (73 GiB for 8B on a 4090)."""
    from rigpilot.engine.workers import memtrace

    model, config = _config(tmp_path, num_hidden_layers=3)
    layout = Layout.from_dict({"cpu_offload": True})
    par = {"micro_batch": 1, "grad_accum": 1, "checkpointing": "full"}
    whole, chunked = (memtrace._trace_step(config, 3, _workload(model, loss_chunks=k), par, layout, False)
                      for k in (1, 4))  # fmt: skip
    host = sum(v for k, v in chunked.categories.items() if k in memtrace.HOST_CATEGORIES)
    assert host > chunked.peak  # the state is all on the host: it would dwarf the GPU's figure
    assert chunked.peak <= whole.peak


def test_a_warm_tracer_freezes_what_stays_only_after_a_trace_that_imported_code() -> None:
    """Frozen objects are never collected, even as garbage: a tracer that froze after every trace would keep every
    cache entry any trace left for as long as it lives. It freezes after the warm imports and after a trace that
    imported code (a model family's first), nothing more. In a child process: freezing is process-wide."""
    import subprocess
    import sys

    code = """
import gc, sys, types
from rigpilot.engine.workers import memtrace
memtrace._freeze_new_code()
base = gc.get_freeze_count()
left = []
for _ in range(3):  # traces of code already imported: what they leave is collectable, not frozen
    left.append([[] for _ in range(500)])
    memtrace._settle()
same = gc.get_freeze_count()
sys.modules["rigpilot_test_model_family"] = types.ModuleType("rigpilot_test_model_family")
memtrace._settle()  # a trace that imported a model family's code: it stays for good, so it is frozen
print(base, same, gc.get_freeze_count())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    base, same, after = map(int, out.stdout.split())
    assert same == base and after > base, out.stdout

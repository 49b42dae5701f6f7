"""CPU offload and QLoRA, run as real torchrun jobs on CPU ranks with gloo (see test_workers_jobs.py).

CPU offload on this machine: the ranks are CPU processes, so FSDP2's
CPUOffloadPolicy has nowhere to move anything from; the "device" copies before
each block's compute and after its backward are CPU-to-CPU no-ops. What these
tests check is that the offload code path itself runs (the same fully_shard
call with CPUOffloadPolicy, the same optimizer step, clipping, DCP checkpoint
and final gather a GPU run goes through), that FSDP2 reports every parameter
shard under the policy and in host memory, and that it computes what the same
job without offload computes. Pinned memory (a GPU run's) is not exercised.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_workers_jobs import (
    LLAMA_TRAIN,
    TINY_LLAMA_CONFIG,
    assert_loss_falls,
    assert_same_curve,
    llama_job,
    losses,
    notes_of,
    output_tensors,
    resume_from,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("offload-qlora")


@pytest.fixture(scope="module")
def fsdp_run(root: Path) -> Path:
    return llama_job(root, "fsdp", {"dp_shard": 2})


@pytest.fixture(scope="module")
def offload_run(root: Path) -> Path:
    return llama_job(root, "offload", {"dp_shard": 2, "cpu_offload": True})


def offload_note(job: Path) -> str:
    (note,) = [n for n in notes_of(job) if n.startswith("CPU offload (FSDP2 CPUOffloadPolicy")]
    return note


def test_cpu_offload_computes_what_fsdp_does_and_resumes(offload_run: Path, fsdp_run: Path) -> None:
    params = sum(1 for _ in _tiny_llama().parameters())
    assert offload_note(offload_run).startswith(
        f"CPU offload (FSDP2 CPUOffloadPolicy over 2 rank(s)): {params} of {params} parameter shards"
    )
    assert not any(n.startswith("CPU offload") for n in notes_of(fsdp_run))
    curve = assert_loss_falls(offload_run, margin=0.5)
    assert_same_curve(curve, losses(fsdp_run), tol=1e-5)
    for name, tensor in output_tensors(fsdp_run).items():
        assert torch.allclose(tensor, output_tensors(offload_run)[name], atol=1e-5), name
    resumed = resume_from(offload_run, 6)
    assert offload_note(resumed)
    after = losses(resumed)
    assert sorted(after) == list(range(7, 13))
    assert_same_curve(after, {s: curve[s] for s in after}, tol=1e-6)
    for name, tensor in output_tensors(offload_run).items():
        assert torch.allclose(tensor, output_tensors(resumed)[name], atol=1e-6), name


def test_cpu_offload_shards_a_replicated_layout_too(root: Path, fsdp_run: Path) -> None:
    # Offload is FSDP2's policy, so a DDP-shaped layout runs as FSDP2 over its replicate dim.
    job = llama_job(
        root, "offload-replicate", {"dp_replicate": 2, "cpu_offload": True}, max_steps=4, checkpoint_every=0
    )
    assert "over 2 rank(s)" in offload_note(job)
    warmup = LLAMA_TRAIN["warmup_steps"] + 1  # until warm-up ends the LR does not depend on max_steps
    assert_same_curve(
        {s: losses(job)[s] for s in range(1, warmup + 1)}, {s: losses(fsdp_run)[s] for s in range(1, warmup + 1)}, 1e-5
    )


def _tiny_llama() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_LLAMA_CONFIG.parent))


# --- QLoRA ----------------------------------------------------------------------------------------

QLORA_TRAIN: dict[str, object] = {
    "method": "qlora",
    "lora_rank": 8,
    "learning_rate": 5e-2,
    "max_steps": 10,
    "checkpoint_every": 5,
    "eval_every": 0,
}


@pytest.fixture(scope="module")
def base_run(root: Path) -> Path:
    # One step from random init: a base whose loss LoRA can still lower in a few steps.
    return llama_job(root, "base", {"dp_replicate": 2}, max_steps=1, warmup_steps=0, checkpoint_every=0, eval_every=0)


def adapter_job(root: Path, name: str, base: Path, parallelism: dict[str, object], **train: object) -> Path:
    from tests.test_workers_jobs import run_job, write_job

    job = write_job(
        root / name,
        kind="train",
        model=str(base / "output"),
        parallelism=parallelism,
        train={**LLAMA_TRAIN, **QLORA_TRAIN, **train},
    )
    run_job(job)
    return job


@pytest.fixture(scope="module")
def qlora_run(root: Path, base_run: Path) -> Path:
    return adapter_job(root, "qlora-ddp", base_run, {"dp_replicate": 2})


def test_nf4_quantisation_replaces_the_adapted_linears_only() -> None:
    from peft import LoraConfig, get_peft_model

    from engine.workers.model_loading import default_lora_targets, is_nf4, quantize_lora_bases_nf4

    torch.manual_seed(0)
    model = _tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = get_peft_model(model, LoraConfig(r=4, target_modules=default_lora_targets(model)))
    assert quantize_lora_bases_nf4(model) == 4 * 7  # 4 blocks x (q, k, v, o, gate, up, down)
    for name, p in model.named_parameters():
        plain = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if "lora_" in name:
            assert p.requires_grad and not is_nf4(p), name
        elif ".base_layer." in name and name.endswith("weight"):
            assert is_nf4(p) and not p.requires_grad, name
            # NF4's widest gap between levels is 0.28 of a block's absmax, so rounding moves a weight by at
            # most 0.14 of it (plus the 8-bit error of the scales); typical weights move far less.
            error = (p.get_original_weight() - before[plain]).abs() / before[plain].abs().max()
            assert 0 < error.max() < 0.2 and error.mean() < 0.05, (name, error.max(), error.mean())
        else:
            assert not is_nf4(p) and torch.equal(p, before[plain]), name  # embeddings, norms, head untouched


def test_qlora_trains_and_its_adapter_loads_on_the_unquantised_base(
    root: Path, base_run: Path, qlora_run: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from engine.workers.model_loading import quantize_lora_bases_nf4

    assert "QLoRA: the base weights of 28 adapted linear layers are 4-bit NF4 (torchao)" in " ".join(notes_of(qlora_run))
    curve = assert_loss_falls(qlora_run, margin=0.02)
    assert (qlora_run / "checkpoints" / "step-5" / "COMPLETE").is_file()
    # Plain LoRA over the same batches: QLoRA follows it within 4-bit quantisation's effect on the loss.
    lora = adapter_job(root, "lora-ddp", base_run, {"dp_replicate": 2}, method="lora", checkpoint_every=0)
    assert_same_curve(curve, losses(lora), tol=0.05)
    assert curve != losses(lora)  # the base weights really were quantised

    tokens = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(base_run / "output", dtype=torch.float32)
    plain = PeftModel.from_pretrained(base, qlora_run / "output").eval()
    assert plain.peft_config["default"].r == 8
    with torch.no_grad():
        unquantised = plain(input_ids=tokens).logits
        trained = AutoModelForCausalLM.from_pretrained(base_run / "output", dtype=torch.float32)
        quantised_model = PeftModel.from_pretrained(trained, qlora_run / "output").eval()
        quantize_lora_bases_nf4(quantised_model)
        quantised = quantised_model(input_ids=tokens).logits
        with plain.disable_adapter():
            bare = plain(input_ids=tokens).logits
    # The adapter learned on NF4 weights and runs on fp32 ones: logits within 4-bit quantisation's reach
    # (measured: about 2% of the logits' range), while the adapter itself moved them further.
    spread = unquantised.abs().max()
    gap = (unquantised - quantised).abs().max()
    print(f"QLoRA logits vs the adapter on the unquantised base: max |diff| {gap:.4f} of max |logit| {spread:.4f}")
    assert gap < 0.05 * spread
    assert (unquantised - bare).abs().max() > gap


def test_capability_names_the_layouts_qlora_and_offload_run() -> None:
    from engine.capability import Layout, why_not

    assert why_not(Layout("train", method="qlora", dp_replicate=2)) is None
    for shape in ({"dp_shard": 2}, {"tp": 2}, {"pp": 2}):
        assert "QLoRA runs with plain data parallelism" in (why_not(Layout("train", method="qlora", **shape)) or "")
    for shape in ({"dp_shard": 2}, {"dp_replicate": 2}, {}):
        assert why_not(Layout("train", cpu_offload=True, **shape)) is None
    assert "CPU offload runs with FSDP2" in (why_not(Layout("train", cpu_offload=True, tp=2)) or "")

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

from support.paths import TINY_LLAMA_CONFIG
from support.worker_jobs import (
    LLAMA_TRAIN,
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


def adapter_job(
    root: Path, name: str, base: Path, parallelism: dict[str, object], nproc: int = 2, **train: object
) -> Path:
    from support.worker_jobs import run_job, write_job

    job = write_job(
        root / name,
        kind="train",
        model=str(base / "output"),
        parallelism=parallelism,
        train={**LLAMA_TRAIN, **QLORA_TRAIN, **train},
    )
    run_job(job, nproc)
    return job


@pytest.fixture(scope="module")
def qlora_run(root: Path, base_run: Path) -> Path:
    return adapter_job(root, "qlora-ddp", base_run, {"dp_replicate": 2})


def test_nf4_quantisation_replaces_the_adapted_linears_only() -> None:
    from peft import LoraConfig, get_peft_model

    from rigpilot.engine.workers.model_loading import default_lora_targets, is_nf4, quantize_lora_bases_nf4

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

    from rigpilot.engine.workers.model_loading import quantize_lora_bases_nf4

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
    # (measured: 0.06% of the logits' range on this base), while the adapter itself moved them further.
    spread = unquantised.abs().max()
    gap = (unquantised - quantised).abs().max()
    print(f"QLoRA logits vs the adapter on the unquantised base: max |diff| {gap:.4f} of max |logit| {spread:.4f}")
    assert gap < 0.05 * spread
    assert (unquantised - bare).abs().max() > gap


@pytest.fixture(scope="module")
def qlora_fsdp_run(root: Path, base_run: Path) -> Path:
    return adapter_job(root, "qlora-fsdp", base_run, {"dp_shard": 2})


def adapter_logits(base: Path, adapter: Path, tokens: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base / "output", dtype=torch.float32)
    with torch.no_grad():
        return PeftModel.from_pretrained(model, adapter / "output").eval()(input_ids=tokens).logits


def test_qlora_under_fsdp_computes_what_ddp_does_resumes_and_exports_its_adapter(
    base_run: Path, qlora_run: Path, qlora_fsdp_run: Path
) -> None:
    import torch.distributed.checkpoint as dcp

    notes = notes_of(qlora_fsdp_run)
    assert "QLoRA: the base weights of 28 adapted linear layers are 4-bit NF4 (torchao)" in notes
    # Rank 0 loaded and quantised the base; the other rank received only its shard of the 4-bit weights.
    assert "the weights were read once, by rank 0, and handed out to the other ranks" in notes
    # Both layouts quantise the same weights the same way, and FSDP2 gathers the NF4 codes, not a dequantised
    # copy: the curves agree to float rounding. FSDP2 reduce-scatters every micro-batch (its gradients stay
    # sharded) where DDP adds its micro-batches locally first, so the sums add in another order, and Adam at
    # this learning rate amplifies that over the steps (measured: 8e-6 by step 4, 1.1e-3 by step 8), as for HSDP.
    curve, ddp = losses(qlora_fsdp_run), losses(qlora_run)
    worst = max(abs(curve[s] - ddp[s]) for s in curve)
    print(f"QLoRA per-step loss, FSDP2 (dp_shard 2) vs DDP (dp_replicate 2): max |diff| {worst:.2e}")
    assert_same_curve({s: curve[s] for s in range(1, 5)}, {s: ddp[s] for s in range(1, 5)}, tol=1e-5)
    assert_same_curve(curve, ddp, tol=5e-3)
    assert_loss_falls(qlora_fsdp_run, margin=0.02)

    # The checkpoint holds the adapter and its optimizer state only: the 4-bit base is quantised again from
    # the pretrained weights on resume.
    step5 = qlora_fsdp_run / "checkpoints" / "step-5"
    saved = dcp.FileSystemReader(str(step5)).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith("app.model.")]
    assert weights and all("lora_" in k for k in weights), weights
    resumed = resume_from(qlora_fsdp_run, 5)
    after = losses(resumed)
    assert sorted(after) == list(range(6, 11))
    assert_same_curve(after, {s: curve[s] for s in after}, tol=1e-5)

    tokens = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    fsdp = adapter_logits(base_run, qlora_fsdp_run, tokens)
    # The two adapters differ by the drift above (measured 4.8e-2 on logits the training moved by far more).
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        bare = AutoModelForCausalLM.from_pretrained(base_run / "output", dtype=torch.float32)(input_ids=tokens).logits
    gap = (fsdp - adapter_logits(base_run, qlora_run, tokens)).abs().max().item()
    moved = (fsdp - bare).abs().max().item()
    print(f"adapter logits, FSDP2 vs DDP: max |diff| {gap:.2e}; moved from the base by {moved:.2e}")
    assert gap < 0.1 * moved
    assert torch.allclose(fsdp, adapter_logits(base_run, resumed, tokens), atol=1e-5)


def test_qlora_under_hsdp_computes_what_ddp_does(root: Path, base_run: Path) -> None:
    # 4 ranks: NF4 shards over dp_shard 2 and replicates over dp_replicate 2 (a 2-D mesh). Four steps, as
    # 4 gloo ranks on 2 cores are slow. Over 10 steps the curves drift apart (measured: 2e-3 by step 7; plain
    # LoRA, HSDP vs DDP: 3e-4): the 4-way gradient sums add in another order, and Adam at this LR amplifies it.
    short = {"max_steps": 4, "checkpoint_every": 0}
    hsdp = adapter_job(root, "qlora-hsdp", base_run, {"dp_replicate": 2, "dp_shard": 2}, nproc=4, **short)
    ddp = adapter_job(root, "qlora-ddp4", base_run, {"dp_replicate": 4}, nproc=4, **short)
    assert "the weights were read once, by rank 0, and handed out to the other ranks" in notes_of(hsdp)
    assert_same_curve(losses(hsdp), losses(ddp), tol=1e-5)


def _shard_nf4_on_two_ranks(rank: int, port: int) -> None:
    import os

    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from rigpilot.engine.workers.model_loading import default_lora_targets, is_nf4, quantize_lora_bases_nf4
    from rigpilot.engine.workers.parallel_dims import MESH_DIMS, ParallelDims, Runtime
    from rigpilot.engine.workers.parallelize import apply_data_parallel, precision_plan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=2, tp=1, world_size=2)
        mesh = init_device_mesh("cpu", dims.shape, mesh_dim_names=MESH_DIMS)
        runtime = Runtime(rank, rank, 2, torch.device("cpu"), "gloo", dims, mesh)

        def qlora_model() -> torch.nn.Module:
            torch.manual_seed(0)
            model = _tiny_llama()
            model = get_peft_model(model, LoraConfig(r=4, target_modules=default_lora_targets(model)))
            for name, p in model.named_parameters():
                if "lora_B" in name:  # non-zero, so the adapter's gradients reach lora_A too
                    torch.nn.init.normal_(p, std=0.02)
            quantize_lora_bases_nf4(model)
            return model

        whole, sharded = qlora_model(), qlora_model()
        apply_data_parallel(sharded, runtime, precision_plan("fp32", runtime))
        full_rows = {n: p.size(0) for n, p in whole.named_parameters()}
        nf4 = 0
        for name, p in sharded.named_parameters():
            assert isinstance(p, DTensor), name
            if ".base_layer." in name and name.endswith("weight"):
                local = p.to_local()
                assert is_nf4(local) and local.size(0) == full_rows[name] // 2, (name, type(local), local.shape)
                nf4 += 1
        assert nf4 == 28
        tokens = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(1))
        expected = whole(input_ids=tokens, labels=tokens)
        got = sharded(input_ids=tokens, labels=tokens)
        assert torch.allclose(got.logits, expected.logits, atol=1e-5)
        expected.loss.backward()
        got.loss.backward()
        for (name, p), q in zip(sharded.named_parameters(), whole.parameters(), strict=True):
            if p.requires_grad:  # same batch on both ranks: the averaged gradient is the single-rank one
                assert torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-6), name
    finally:
        dist.destroy_process_group()


def test_fsdp2_shards_the_nf4_base_weights_and_computes_what_the_whole_model_does() -> None:
    from rigpilot.engine.workers.parallel_dims import _free_port

    torch.multiprocessing.spawn(_shard_nf4_on_two_ranks, args=(_free_port(),), nprocs=2)


def test_an_nf4_weight_fsdp_cannot_split_evenly_is_named() -> None:
    from peft import LoraConfig, get_peft_model

    from rigpilot.engine.workers.model_loading import default_lora_targets, nf4_unshardable, quantize_lora_bases_nf4

    model = _tiny_llama()
    model = get_peft_model(model, LoraConfig(r=4, target_modules=default_lora_targets(model)))
    quantize_lora_bases_nf4(model)
    assert nf4_unshardable(model, 2) is None and nf4_unshardable(model, 8) is None
    reason = nf4_unshardable(model, 3) or ""
    assert reason.startswith("QLoRA: the 4-bit weight ") and "does not split evenly into 3 FSDP shards" in reason


def test_capability_names_the_layouts_qlora_and_offload_run() -> None:
    from rigpilot.engine.capability import why_not
    from rigpilot.engine.layout import Layout

    for shape in ({"dp_replicate": 2}, {"dp_shard": 2}, {"dp_shard": 2, "dp_replicate": 2}):
        assert why_not(Layout(**shape), method="qlora") is None
    assert "QLoRA runs with data parallelism (DDP or FSDP), not with tensor parallel" in (
        why_not(Layout(tp=2), method="qlora") or ""
    )
    assert "pipeline parallel" in (why_not(Layout(pp=2), method="qlora") or "")
    assert "QLoRA" in (why_not(Layout(dp_shard=2, cpu_offload=True), method="qlora") or "")
    for shape in ({"dp_shard": 2}, {"dp_replicate": 2}, {}):
        assert why_not(Layout(cpu_offload=True, **shape)) is None
    assert "CPU offload runs with FSDP2" in (why_not(Layout(cpu_offload=True, tp=2)) or "")

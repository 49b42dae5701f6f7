"""The planner chooses the training recipe (engine.planner.recipes): the issue's three workstation cases, the recipe
in the plan's words and JSON, pinned settings, old plan files, and a job taking the plan's recipe."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rigpilot.engine.cli.entry import main
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.jobs.submission import apply_plan_training, describe, prepare
from rigpilot.engine.jobspec.spec import JobSpec
from rigpilot.engine.models.describe import describe_model
from rigpilot.engine.planner.plan import LoraSettings, Plan, Workload, refusal
from rigpilot.engine.planner.search import search

from support.paths import REPO

GIB = 2**30
SHAKESPEARE = REPO / "examples" / "data" / "shakespeare.txt"


def _plans(r):
    return [p for p in [r.best, *r.runners_up] if p is not None]


def _check(result, profile: str, tmp_path, method: str = "scratch", ranks: int = 4) -> tuple[JobSpec, list[str]]:
    """`rigpilot run train --model M … --plan FILE --check`, in-process (as tests/unit/test_capability.py does):
    the job the plan's JSON makes on the profile's machine, and its would-run lines. A full fine-tune is checked as
    training from scratch, whose layout and recipe are the same and which needs no weights on disk."""
    plan = json.loads(json.dumps(result.to_dict()))  # as a plan file is written and read
    job = {"kind": "train", "model": result.workload.model, "train": {"method": method, "dataset": [str(SHAKESPEARE)]}}
    sub = prepare(job, plan, str(tmp_path), job_id="check", machine=load_profile(profile), max_cpu_ranks=ranks)
    lines = describe(sub)
    assert lines[0].startswith("would run: train"), lines
    return sub.spec, lines


def test_llama2_7b_full_on_four_4090s_runs_without_offload(tmp_path):
    """torchtune: Llama-2-7B full fine-tune, FSDP over 4×RTX 4090, 22.9 GB (21.3 GiB) per GPU without offload.
    The planner finds FSDP2 with pure bf16 (and chunked cross-entropy) under 24 GiB, where the plain recipe chose
    FSDP2 with CPU offload pinning 110 GiB of host RAM."""
    r = search(describe_model("llama-2-7b"), load_profile("4x-rtx4090"), Workload(model="llama-2-7b"))
    best = r.best
    assert best is not None and best.runs_here and not best.parallelism.offload
    assert best.workload.master_weights == "bf16" and best.peak_memory.total < 24 * GIB
    d = best.to_dict()
    assert d["recipe"].startswith("pure bf16") and d["workload"]["master_weights"] == "bf16"
    said = next(n for n in best.notes if "would need" in n)
    assert "no CPU offload needed; bf16 mixed precision would need" in said
    assert "with pure bf16" in r.explanation[0]
    for p in _plans(r):  # every plan marked runnable passes the one contract, recipe included
        assert p.runs_here == (refusal(p) == "")
    spec, lines = _check(r, "4x-rtx4090", tmp_path)
    assert spec.train.master_weights == "bf16" and spec.train.loss_chunks == best.workload.loss_chunks
    assert not spec.parallelism.cpu_offload and spec.parallelism.dp_shard == 4
    assert f"recipe: {best.to_dict()['recipe']}" in lines


def test_llama31_8b_lora_batch_2_fits_one_4090_at_micro_batch_2(tmp_path):
    """torchtune: Llama-3.1-8B LoRA, batch 2 × 2048 on a 4090, 16.2 GiB measured (chunked cross-entropy,
    checkpointing). Without chunking the fp32 logits of 128k vocabulary refused micro-batch 2 (24.2 GiB)."""
    w = Workload(model="llama-3.1-8b", method="lora", global_batch=2, lora=LoraSettings())
    r = search(describe_model("llama-3.1-8b"), load_profile("1x-rtx4090"), w)
    best = r.best
    assert best is not None and best.runs_here and best.parallelism.micro_batch == 2
    assert best.workload.loss_chunks > 1 and best.workload.master_weights == "fp32"  # chunking is free; no pure bf16
    assert "chunked cross-entropy" in best.to_dict()["recipe"]
    assert best.peak_memory.total < 24 * GIB
    spec, lines = _check(r, "1x-rtx4090", tmp_path, method="lora")
    assert spec.train.loss_chunks == best.workload.loss_chunks and spec.train.micro_batch == 2
    assert any(x.startswith("recipe: bf16 mixed precision + chunked cross-entropy") for x in lines)


def test_llama31_8b_full_on_one_4090_fits_with_the_optimizer_state_in_host_memory(tmp_path):
    """torchtune: Llama-3.1-8B full fine-tune on one 4090 at 18.9 GiB (batch 2 × 2048), with pure bf16,
    bitsandbytes' *paged* 8-bit AdamW, the optimizer step in backward and checkpointing: the paged optimizer keeps
    its state in CUDA unified memory, paged out to the host. The engine's 8-bit AdamW (torchao) keeps it on the GPU,
    where 2 bytes of weights + 2.03 of state per parameter are 30 GiB before activations; with the optimizer state
    in host memory (engine.workers.optimizer_offload) the GPU keeps the 15.0 GiB of bf16 weights, one gradient on
    its way out (the 1 GiB embedding's) and the activations: the plan predicts 19.0 GiB against torchtune's
    measured 18.9 GiB, and no CPU parameter offload. The host holds the master copy, the gradients and the bf16 AdamW
    state (8 bytes a parameter, 60 GiB), which the simulated machine's 64 GiB of RAM takes."""
    w = Workload(model="llama-3.1-8b", global_batch=2)
    r = search(describe_model("llama-3.1-8b"), load_profile("1x-rtx4090"), w)
    best = r.best
    assert best is not None and best.runs_here and not best.parallelism.offload
    assert best.parallelism.world_size == 1 and best.parallelism.micro_batch == 2
    bw = best.workload
    assert bw.optimizer_offload and bw.master_weights == "bf16"
    assert bw.optimizer == "adamw" and not bw.optimizer_in_backward  # CPU AdamW, whole-gradient step
    assert 18 * GIB < best.peak_memory.total < 21 * GIB  # torchtune: 18.9 GiB
    assert best.memory[0].optimizer < 0.01 * GIB and best.memory[0].gradients < 1.1 * GIB
    assert best.host.offloaded > 55 * GIB and best.host.fits
    d = best.to_dict()
    assert "optimizer state in host memory (as torchtune's paged AdamW)" in d["recipe"]
    assert d["workload"]["optimizer_offload"] is True
    said = next(n for n in best.notes if n.startswith("the optimizer state in host memory keeps"))
    assert "pinned host RAM" in said
    assert "host optimizer" in r.explanation[1]  # the step's time on the host is named as such, not CPU offload
    spec, lines = _check(r, "1x-rtx4090", tmp_path)
    assert spec.train.optimizer_offload and spec.train.master_weights == "bf16"
    assert not spec.parallelism.cpu_offload and spec.parallelism.world_size == 1
    assert f"recipe: {d['recipe']}" in lines


def test_the_optimizer_state_in_host_memory_exports_where_the_tool_can_say_it():
    from rigpilot.engine.planner.export import accelerate_config, deepspeed_config, torchrun_command

    w = Workload(model="llama-3.1-8b", global_batch=2)
    best = search(describe_model("llama-3.1-8b"), load_profile("1x-rtx4090"), w).best
    assert best is not None and best.workload.optimizer_offload
    assert "--optimizer-offload" in torchrun_command(best)
    ds = deepspeed_config(best)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in zero and ds["optimizer"]["type"] == "AdamW"
    assert not any("optimizer state, master weights" in x for x in ds["rigpilot"].get("not_in_this_config", []))
    yaml = accelerate_config(best)
    assert "Accelerate cannot say it: the optimizer state, master weights and gradients live in pinned host" in yaml
    assert "DeepSpeed can: zero_optimization.offload_optimizer.device 'cpu'" in yaml


def test_pinned_settings_stay_and_optimizer_in_backward_runs_without_accumulation(capsys, tmp_path):
    argv = ["plan", "--simulate", "4x-rtx4090", "--model", "llama-2-7b", "--no-verify", "--json"]
    assert main([*argv, "--optimizer-in-backward", "--loss-chunks", "4"]) == 0
    d = json.loads(capsys.readouterr().out)
    best = d["best"]
    assert best["workload"]["optimizer_in_backward"] is True and best["workload"]["loss_chunks"] == 4
    assert best["parallelism"]["grad_accum"] == 1 and best["runs_here"]
    assert "optimizer in backward" in best["recipe"]
    assert any("without gradient accumulation or clipping" in n for n in best["notes"])
    assert d["workload"]["optimizer_in_backward"] is True and d["workload"]["master_weights"] is None  # as asked
    plan = Plan.from_dict(best)
    spec = JobSpec.from_dict({"id": "j", "kind": "train", "model": "llama-2-7b",
                              "train": {"grad_clip": 1.0, "grad_accum": 4}})  # fmt: skip
    _, notes = apply_plan_training(spec, plan)
    assert spec.train.optimizer_in_backward and spec.train.grad_clip == 0 and spec.train.grad_accum == 1
    assert any("cannot clip" in n for n in notes)
    # Checked on two CPU ranks for the plan's four GPUs: the micro-batch doubles, never the accumulation.
    r = search(describe_model("llama-2-7b"), load_profile("4x-rtx4090"),
               Workload(model="llama-2-7b", optimizer_in_backward=True, loss_chunks=4))  # fmt: skip
    spec, lines = _check(r, "4x-rtx4090", tmp_path, ranks=2)
    mb = r.best.parallelism.micro_batch
    assert spec.train.grad_accum == 1 and spec.train.micro_batch == 2 * mb and spec.train.grad_clip == 0
    assert any(f"the micro-batch rises from {mb} to {2 * mb}" in x for x in lines)
    # Pinned off, the search never reaches for it; a recipe setting for inference is refused in one line.
    assert main([*argv, "--no-optimizer-in-backward", "--master-weights", "fp32"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert all(not p["workload"]["optimizer_in_backward"] and p["workload"]["master_weights"] == "fp32"
               for p in [d["best"], *d["runners_up"]])  # fmt: skip
    assert main([*argv[:-1], "--task", "infer", "--loss-chunks", "4"]) == 2
    assert capsys.readouterr().err.strip() == "rigpilot: error: --loss-chunks 4 applies to training"


def test_a_plan_saved_before_the_recipe_reads_and_leaves_the_jobs_recipe_alone():
    r = search(describe_model("llama-2-7b"), load_profile("8x-h100-sxm"), Workload(model="llama-2-7b"))
    d = r.best.to_dict()
    for name in ("optimizer_in_backward", "loss_chunks", "activation_offload", "compile", "fp8"):
        del d["workload"][name]
    d["workload"]["master_weights"] = None
    del d["recipe"]
    old = Plan.from_dict(d)
    assert old.workload.loss_chunks is None and old.runs_here
    spec = JobSpec.from_dict({"id": "j", "kind": "train", "model": "llama-2-7b",
                              "train": {"loss_chunks": 16, "compile": True}})  # fmt: skip
    taken, _ = apply_plan_training(spec, old)
    assert spec.train.loss_chunks == 16 and spec.train.compile and "loss_chunks" not in taken


@pytest.mark.parametrize("profile", ["1x-rtx4090", "4x-rtx4090", "8x-h100-sxm"])
def test_auto_never_offers_a_runnable_plan_the_contract_refuses(profile):
    for model, kw in (("llama-2-7b", {}), ("llama-3.1-8b", {"method": "lora", "lora": LoraSettings()})):
        r = search(describe_model(model), load_profile(profile), Workload(model=model, **kw))
        for p in _plans(r):
            assert p.runs_here == (refusal(p) == "")
            for s in r.suggestions:
                assert refusal(s.plan) == ""


def test_exports_carry_the_recipe_where_the_tool_can_say_it():
    from rigpilot.engine.planner.export import accelerate_config, deepspeed_config, torchrun_command

    r = search(describe_model("llama-2-7b"), load_profile("4x-rtx4090"), Workload(model="llama-2-7b"))
    best = r.best
    assert best.workload.master_weights == "bf16" and best.workload.loss_chunks == 8
    assert "--master-weights bf16 --loss-chunks 8" in torchrun_command(best)
    ds = deepspeed_config(best)
    assert ds["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert ds["rigpilot"]["recipe"] == "pure bf16 + chunked cross-entropy (8 chunks)"
    assert any("chunked cross-entropy" in x for x in ds["rigpilot"]["not_in_this_config"])
    yaml = accelerate_config(best)
    assert "mixed_precision: 'no'" in yaml or "mixed_precision: no" in yaml
    assert "# Recipe: pure bf16 + chunked cross-entropy (8 chunks)." in yaml and "torch_dtype=torch.bfloat16" in yaml


def test_compile_and_fp8_are_used_only_where_asked_and_judged_by_the_contract():
    """The search never turns on compile (a warm-up) or FP8 (other numerics) itself; asked for, compile speeds the
    plan up by the speed model's compiled factor, and FP8 on a simulated machine is a plan the engine refuses."""
    spec, machine = describe_model("llama-2-7b"), load_profile("4x-rtx4090")
    auto = search(spec, machine, Workload(model="llama-2-7b")).best
    assert auto.workload.compile is False and auto.workload.fp8 is False
    compiled = search(spec, machine, Workload(model="llama-2-7b", compile=True)).best
    assert compiled.workload.compile and "compiled" in compiled.to_dict()["recipe"]
    assert compiled.timing.tokens_per_s > auto.timing.tokens_per_s
    fp8 = search(spec, machine, Workload(model="llama-2-7b", fp8=True)).best
    assert not fp8.runs_here and "CPU ranks" in fp8.runs_here_reason


def _stage(workload: Workload, par, profile: str = "1x-rtx4090", model: str = "llama-3.1-8b"):
    from rigpilot.engine.planner.memory import MemoryModel
    from rigpilot.engine.planner.model import model_facts
    from rigpilot.engine.planner.recipes import rung

    mm = MemoryModel(model_facts(describe_model(model)), rung(workload).workload)
    return mm, mm.stage(par, 0, "ada")


def test_each_technique_changes_the_memory_it_should():
    """Term by term, on Llama-3.1-8B on one GPU: what each recipe setting removes, and nothing else."""
    from rigpilot.engine.planner.memory import ADAMW8BIT_BYTES, OFFLOAD_WINDOW_LAYERS
    from rigpilot.engine.planner.plan import Parallelism
    from rigpilot.engine.recipe import PLAIN_RECIPE

    par = Parallelism(gpu_indices=[0], backend="single", micro_batch=1, grad_accum=1, checkpointing="none")
    base = Workload(model="m", **PLAIN_RECIPE)
    mm, plain = _stage(base, par)
    n = mm.m.params
    assert plain.weights == pytest.approx(4 * n) and plain.gradients == pytest.approx(4 * n)
    assert plain.optimizer == pytest.approx(8 * n)
    # Pure bf16: weights, gradients and both moments in 2 bytes.
    _, pure = _stage(Workload(model="m", **{**PLAIN_RECIPE, "master_weights": "bf16"}), par)
    assert (pure.weights, pure.gradients, pure.optimizer) == pytest.approx((2 * n, 2 * n, 4 * n))
    # 8-bit AdamW (torchao): one byte per moment and an fp32 scale per block of 256.
    assert ADAMW8BIT_BYTES == pytest.approx(2 * (1 + 4 / 256))
    _, eight = _stage(Workload(model="m", **{**PLAIN_RECIPE, "optimizer": "adamw8bit"}), par)
    assert eight.optimizer == pytest.approx(ADAMW8BIT_BYTES * n) and eight.weights == plain.weights
    # The optimizer step in backward: one parameter's gradient at a time, the largest (the 128k × 4096 embedding).
    _, oib = _stage(Workload(model="m", **{**PLAIN_RECIPE, "optimizer_in_backward": True}), par)
    assert oib.gradients == pytest.approx(4 * 128256 * 4096) and oib.optimizer == plain.optimizer
    # Chunked cross-entropy: forward saves no logits and no bf16 copy of the head, only the final hidden states
    # (fp32, in place of the head's bf16 cast of them); in backward one chunk's logits and the head's copy come
    # back, or autograd sums the head's fp32 gradient, whichever is larger (the sum: two gradients beyond it).
    chunks = Workload(model="m", **{**PLAIN_RECIPE, "loss_chunks": 8})
    mm_chunked, chunked = _stage(chunks, par)
    tokens, vocab, h = 2048, 128256, 4096
    saved = plain.activations - chunked.activations
    assert saved == pytest.approx(tokens * (4 * vocab - 2 * h) + 2 * vocab * h, rel=1e-6)
    edge = mm_chunked.edge("single", "none")
    assert (edge.head_recompute, edge.head_grad) == (2 * vocab * h, 4 * vocab * h)
    assert edge.loss_transient == pytest.approx((12 * vocab + 2 * h) / 8)
    assert mm.edge("single", "none").head_grad == 0  # the whole loss: one gradient, no sum
    # Activation offloading: every block's saved tensors but a window of two leave the GPU for host RAM.
    off = Workload(model="m", **{**PLAIN_RECIPE, "activation_offload": True})
    mm_off, offloaded = _stage(off, par)
    moved = mm_off.offloaded_activations(par, 0)
    per_layer = moved / (32 - OFFLOAD_WINDOW_LAYERS)
    assert offloaded.activations == pytest.approx(plain.activations - moved)
    assert offloaded.host_offloaded == pytest.approx(moved) and per_layer > 0
    host = mm_off.host_memory(par, [offloaded], None)
    assert host.offloaded == pytest.approx(moved, abs=1)
    # Compile and FP8: counted at eager bf16's memory.
    for setting in ("compile", "fp8"):
        _, same = _stage(Workload(model="m", **{**PLAIN_RECIPE, setting: True}), par)
        assert same.total == pytest.approx(plain.total)


def test_activation_offload_costs_only_what_compute_cannot_hide():
    """Saved activations go out and back over PCIe each micro-batch, hidden behind that micro-batch's compute as far
    as the link is fast enough: Llama-3.1-8B without checkpointing saves 26 GiB a micro-batch, whose 2 × 28 GB take
    2.2 s on a 4090's PCIe 4.0 ×16 against 1.3 s of compute, so part shows; with full checkpointing what is offloaded
    is the blocks' inputs, and it all hides."""
    from rigpilot.engine.planner.links import Topology
    from rigpilot.engine.planner.memory import MemoryModel
    from rigpilot.engine.planner.model import model_facts
    from rigpilot.engine.planner.plan import Parallelism
    from rigpilot.engine.planner.speed import SpeedModel
    from rigpilot.engine.recipe import PLAIN_RECIPE

    facts = model_facts(describe_model("llama-3.1-8b"))
    topo = Topology(load_profile("1x-rtx4090"), [0], None)
    for ckpt in ("none", "full"):
        par = Parallelism(gpu_indices=[0], backend="single", micro_batch=1, grad_accum=1, checkpointing=ckpt)
        times = {}
        for offload in (False, True):
            w = Workload(model="m", **{**PLAIN_RECIPE, "activation_offload": offload})
            mm = MemoryModel(facts, w)
            times[offload] = SpeedModel(facts, w, topo, mm).timing(par, detail=False)
        moved = mm.offloaded_activations(par, 0)
        transfer = 2 * moved / (topo.gpus[0].pcie_gbs * 1e9)
        cost = times[True].step_s - times[False].step_s
        assert cost == pytest.approx(times[True].offload_s)
        if ckpt == "none":
            assert transfer > times[False].compute_s and 0 < cost < transfer
        else:
            assert transfer < times[False].compute_s and cost == 0


def test_the_optimizer_state_in_host_memory_moves_it_and_costs_the_copies_and_the_cpu_step():
    """Term by term on Llama-3.1-8B on one GPU (pure bf16): the host keeps the master copy, the gradient and AdamW's
    two moments of every tensor but the norms (and, accumulating, two staging buffers of the largest tensor); the GPU
    keeps the weights, the norms' gradients and state and one gradient on its way out. The step pays what backward
    cannot hide: the last gradient's copy, the host-side accumulation, the CPU AdamW step and the weights' copy back."""
    from rigpilot.engine.planner.links import Topology
    from rigpilot.engine.planner.memory import STAGING_BUFFERS
    from rigpilot.engine.planner.model import model_facts
    from rigpilot.engine.planner.plan import Parallelism
    from rigpilot.engine.planner.speed import SpeedModel
    from rigpilot.engine.recipe import PLAIN_RECIPE

    pure = {**PLAIN_RECIPE, "master_weights": "bf16"}
    par = Parallelism(gpu_indices=[0], backend="single", micro_batch=1, grad_accum=1, checkpointing="full")
    mm, kept = _stage(Workload(model="m", **pure), par)
    mm_host, moved = _stage(Workload(model="m", **{**pure, "optimizer_offload": True}), par)
    n, norms = mm.m.params, 32 * mm.m.layer_other_params
    largest = 128256 * 4096
    assert mm_host.host_optimizer_params(par, 0) == pytest.approx(n - norms)
    assert moved.weights == kept.weights == pytest.approx(2 * n)
    assert moved.gradients == pytest.approx(2 * (norms + largest)) and moved.optimizer == pytest.approx(4 * norms)
    assert moved.host_offloaded == pytest.approx(8 * (n - norms))
    accumulating = dataclasses.replace(par, grad_accum=4)
    _, staged = _stage(Workload(model="m", **{**pure, "optimizer_offload": True}), accumulating)
    assert staged.host_offloaded - moved.host_offloaded == pytest.approx(STAGING_BUFFERS * 2 * largest)
    # Refused layouts are not counted as host-resident: CPU offload already is (its own terms).
    assert not mm_host.host_optimizer(dataclasses.replace(par, backend="fsdp", offload_params=True))

    facts = model_facts(describe_model("llama-3.1-8b"))
    topo = Topology(load_profile("1x-rtx4090"), [0], None)
    times = {}
    for accum in (1, 4):
        p = dataclasses.replace(par, grad_accum=accum)
        w = Workload(model="m", **{**pure, "optimizer_offload": True})
        times[accum] = SpeedModel(facts, w, topo, mm_host).timing(p, detail=False)
    link = topo.gpus[0].pcie_gbs * 1e9
    back = 2 * (n - norms) / link  # the updated weights, after the step: hidden behind nothing
    assert times[1].offload_s > back + 2 * largest / link
    assert times[4].offload_s > times[1].offload_s  # three micro-batches' gradients added on the host


def test_pinned_settings_that_contradict_each_other_get_the_contracts_line_not_nothing_fits():
    """Found in review: `--optimizer-offload --optimizer adamw8bit` answered "nothing fits" with a memory figure."""
    from rigpilot.engine.errors import UserError as Refused

    w = Workload(model="llama-3.1-8b", method="full", seq_len=2048, global_batch=2, optimizer="adamw8bit",
                 optimizer_offload=True)  # fmt: skip
    with pytest.raises(Refused) as e:
        search(describe_model("llama-3.1-8b"), load_profile("1x-rtx4090"), w)
    assert e.value.reason == "recipe_refused" and "8-bit AdamW" in str(e.value) and "\n" not in str(e.value)
    assert e.value.fields["setting"] in ("optimizer", "optimizer_offload")

"""Traced verification of plans: the fake-tensor step against real steps, and the planner's use of it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rigpilot.engine.accuracy.tp import free_port
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.layout import Layout
from rigpilot.engine.models.describe import describe_model
from rigpilot.engine.planner import verify
from rigpilot.engine.planner.plan import Plan, Workload
from rigpilot.engine.planner.search import SearchOptions, search

from support.paths import REPO

TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 160,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256,
    "max_position_embeddings": 256, "tie_word_embeddings": False,
}  # fmt: skip


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return folder


def tiny_result(folder: Path, **work: object):
    w = Workload(model=str(folder), task="train", seq_len=64, global_batch=8, **work)  # type: ignore[arg-type]
    return search(describe_model(str(folder)), load_profile("8x-h100-sxm"), w, options=SearchOptions(suggest=False))


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}


# -- the planner's side (no torch in this process) ---------------------------------------------------


def test_verify_records_both_figures_and_counts_the_larger(tiny, caplog):
    result = tiny_result(tiny)
    plan = result.best
    m = plan.peak_memory
    tensors = m.total - m.overhead
    # A trace 20% above the formula's tensor bytes: shown, logged as a defect, and the one counted.
    with caplog.at_level(logging.WARNING, logger="rigpilot.engine.planner.verify"):
        line = verify.apply_trace(plan, {"ok": True, "peak": int(tensors * 1.2), "method": "whole model", "seconds": 1})
    assert all(g.traced == int(tensors * 1.2) + g.overhead for g in plan.memory)
    assert all(g.headroom == g.capacity - g.traced for g in plan.memory)
    assert line and "formula" in line and "traced" in line and "+20%" in line
    assert any("planner defect" in r.getMessage() for r in caplog.records)
    assert verify.figures(plan).startswith("formula ") and "· traced" in verify.figures(plan)
    # Both figures survive the JSON round trip.
    again = Plan.from_dict(json.loads(plan.to_json()))
    assert again.memory[0].traced == plan.memory[0].traced and again.verification == plan.verification


def test_a_trace_below_the_formula_keeps_the_formula_and_small_gaps_are_quiet(tiny, caplog):
    plan = tiny_result(tiny).best
    m = plan.peak_memory
    headroom = m.headroom
    with caplog.at_level(logging.WARNING, logger="rigpilot.engine.planner.verify"):
        assert verify.apply_trace(plan, {"ok": True, "peak": m.total - m.overhead - 1000}) is None
    assert plan.peak_memory.headroom == headroom  # the larger figure is still the formula's
    assert not [r for r in caplog.records if "planner defect" in r.getMessage()]


def test_a_plan_that_does_not_fit_once_traced_gives_way(tiny, monkeypatch):
    result = tiny_result(tiny)
    first = result.best

    def fake_trace(plan, **kwargs):
        # The best plan's traced step is bigger than its GPU; the others are as the formula says.
        if plan is first:
            return {"ok": True, "peak": plan.peak_memory.capacity * 2, "method": "whole model"}
        return {"ok": True, "peak": plan.peak_memory.total - plan.peak_memory.overhead, "method": "whole model"}

    monkeypatch.setattr(verify, "trace_all", lambda plans, **kwargs: [fake_trace(p) for p in plans])
    verify.verify(result)
    assert not first.fits and result.best is not first and result.best.fits
    assert first in result.runners_up
    assert result.runners_up[-1] is first  # listed, with both figures, below every plan that fits
    assert any("does not fit" in line for line in result.explanation)


def test_the_plan_that_takes_the_best_ones_place_is_one_the_engine_runs(tiny, monkeypatch):
    result = tiny_result(tiny)
    first = result.best
    assert len(result.runners_up) >= 2
    result.runners_up[0].runs_here, result.runners_up[0].runs_here_reason = False, "not in this engine"

    def fake_trace(plan, **kwargs):
        if plan is first:
            return {"ok": True, "peak": plan.peak_memory.capacity * 2, "method": "whole model"}
        return {"ok": True, "peak": plan.peak_memory.total - plan.peak_memory.overhead, "method": "whole model"}

    monkeypatch.setattr(verify, "trace_all", lambda plans, **kwargs: [fake_trace(p) for p in plans])
    runnable = result.runners_up[1]
    verify.verify(result)
    assert result.best is runnable and result.best.runs_here and result.best.fits


def test_a_failing_trace_is_one_line(tiny):
    plan = tiny_result(tiny).best
    # An architecture transformers does not know: a reason, not a traceback.
    (tiny / "config.json").write_text(json.dumps({**TINY_LLAMA, "model_type": "no-such-arch"}))
    answer = verify.trace(plan)
    assert answer["ok"] is False and "\n" not in answer["reason"] and "Traceback" not in answer["reason"]
    verify.apply_trace(plan, answer)
    assert plan.verification.startswith("not verified: ") and plan.peak_memory.traced is None
    assert "not verified" in verify.figures(plan)


def test_a_trace_past_its_timeout_says_so(tiny):
    plan = tiny_result(tiny).best
    answer = verify.trace(plan, timeout_s=0.05)
    assert answer == {"ok": False, "reason": "the trace took longer than 0 s"}


def test_quantised_inference_is_refused_with_a_reason(tiny):
    d = tiny_result(tiny).best.to_dict()
    d["workload"]["task"], d["workload"]["weight_bits"] = "infer", 4
    assert _tracer(d) == {"ok": False, "reason": "quantised inference (8-bit, 4-bit weights) is not traced"}


@pytest.mark.slow
def test_a_pipeline_plan_is_traced_stage_by_stage(tiny):
    result = tiny_result(tiny)
    plan = next(p for p in [result.best, *result.runners_up] if p.parallelism.pp > 1)
    answer = _tracer(plan.to_dict())
    assert answer["ok"] and set(answer["stages"]) == {str(s) for s in range(plan.parallelism.pp)}
    verify.apply_trace(plan, answer)
    for m in plan.memory:
        assert m.traced == answer["stages"][str(m.stage)] + m.overhead


@pytest.mark.slow
def test_an_inference_plans_traced_prefill_agrees_with_the_formula(tmp_path, caplog):
    """The prefill's head runs on the last position only, as the formula counts it, on one rank and under TP.

    A 32k vocabulary on a tiny model: logits for every prompt position would be 4-7 times the formula's
    tensor bytes, so a prefill that computed them could not pass.
    """
    folder = tmp_path / "tiny-llama-32k"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TINY_LLAMA, "vocab_size": 32000, "max_position_embeddings": 1024}))
    w = Workload(model=str(folder), task="infer", seq_len=512, global_batch=8, new_tokens=16)
    result = search(describe_model(str(folder)), load_profile("8x-h100-sxm"), w,
                    options=SearchOptions(suggest=False, force_tp=True))  # fmt: skip
    plans = [result.best, next(p for p in result.runners_up if p.parallelism.tp == 2 and p.parallelism.pp == 1)]
    assert result.best.parallelism.tp == 1 and result.best.parallelism.pp == 1
    for plan in plans:
        m = plan.peak_memory
        tensors = m.total - m.overhead
        answer = verify.trace(plan)
        assert answer["ok"], answer
        assert abs(answer["phases"]["prefill"] - tensors) <= 0.05 * tensors, (plan.parallelism.describe(), answer)
        with caplog.at_level(logging.WARNING, logger="rigpilot.engine.planner.verify"):
            assert verify.apply_trace(plan, answer) is None
    assert not [r for r in caplog.records if "planner defect" in r.getMessage()]


def _tracer(plan: dict) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "rigpilot.engine.workers.memtrace"], input=json.dumps({"plan": plan}),
        capture_output=True, text=True, env=env(), timeout=120,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_plan_json_carries_both_figures(tiny):
    done = subprocess.run(
        [sys.executable, "-m", "rigpilot.engine.cli", "plan", "--simulate", "8x-h100-sxm", "--model", str(tiny),
         "--seq", "64", "--batch", "8", "--json"],
        capture_output=True, text=True, env={**env(), "RIGPILOT_PLAN_VERIFY": "1"}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    best = result["best"]
    assert best["verification"].startswith("traced: whole model (2 blocks)")
    for m in best["memory"]:
        assert isinstance(m["traced"], int) and m["traced"] > m["overhead"]
        assert m["headroom"] == m["capacity"] - max(m["total"], m["traced"])
    traced = [p for p in [best, *result["runners_up"]] if p["verification"]]
    assert len(traced) == min(verify.VERIFY_TOP, 1 + len(result["runners_up"]))
    # --no-verify: the formula alone.
    done = subprocess.run(
        [sys.executable, "-m", "rigpilot.engine.cli", "plan", "--simulate", "8x-h100-sxm", "--model", str(tiny),
         "--seq", "64", "--batch", "8", "--json", "--no-verify"],
        capture_output=True, text=True, env={**env(), "RIGPILOT_PLAN_VERIFY": "1"}, timeout=120,
    )  # fmt: skip
    best = json.loads(done.stdout)["best"]
    assert best["verification"] == "" and all(m["traced"] is None for m in best["memory"])


# -- the tracer against real steps -------------------------------------------------------------------

# Every rank steps the same plan on real tensors in a real gloo group, as `_trace_step(real=True)`
# does inside an initialised group; rank 0 prints its peaks, and the fake trace is run beside them.
GLOO_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def rank_main(rank, world, port, cases, queue):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from rigpilot.engine.layout import Layout
        from rigpilot.engine.workers import memtrace
        out = []
        try:
            for workload, par, layout in cases:
                config = memtrace._load_config(workload["model"], False)
                phases = memtrace._trace_step(config, 2, workload, par, Layout.from_dict(layout), False, real=True)
                out.append([phases.forward_backward, phases.optimizer])
        except Exception as e:
            out = repr(e)
        if rank == 0:
            queue.put(out)
        dist.destroy_process_group()

    if __name__ == "__main__":
        world, port, cases = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.stdin.read())
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(r, world, port, cases, queue)) for r in range(world)]
        for p in procs:
            p.start()
        real = queue.get(timeout=300)
        if isinstance(real, str):
            sys.exit("a rank failed: " + real)
        for p in procs:
            p.join()
        from rigpilot.engine.layout import Layout
        from rigpilot.engine.workers import memtrace
        fake = []
        for workload, par, layout in cases:
            config = memtrace._load_config(workload["model"], False)
            phases = memtrace._trace_step(config, 2, workload, par, Layout.from_dict(layout), False)
            fake.append([phases.forward_backward, phases.optimizer])
        print(json.dumps({"real": real, "fake": fake}))
    """
)


def _case(folder: Path, mesh: dict[str, int], **par: object) -> list[dict]:
    """[workload, the step's settings, the layout (job.json's `parallelism`)]: JSON, for the gloo script."""
    workload = {"model": str(folder), "task": "train", "method": par.pop("method", "full"), "precision": "bf16",
                "seq_len": 64, "lora": par.pop("lora", None)}  # fmt: skip
    layout = {**mesh, **{k: par.pop(k) for k in ("sequence_parallel", "reshard_after_forward") if k in par}}
    return [workload, {"micro_batch": 2, "grad_accum": 1, "checkpointing": "none", **par}, layout]


def _real_vs_fake(tmp_path: Path, world: int, cases: list[list[dict]], port: int) -> tuple[list, list]:
    script = tmp_path / "gloo_steps.py"
    script.write_text(GLOO_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(world), str(port)], input=json.dumps(cases), capture_output=True,
        text=True, env=env(), timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    return answer["real"], answer["fake"]


def _within(real: list, fake: list, bound: float = 0.03) -> None:
    for (rf, ro), (ff, fo) in zip(real, fake, strict=True):
        assert abs(ff - rf) <= bound * rf, (real, fake)
        assert abs(fo - ro) <= bound * ro, (real, fake)


@pytest.mark.slow
def test_fake_trace_matches_two_gloo_ranks_under_fsdp_and_tensor_parallel(tiny, tmp_path):
    mesh_tp = {"dp_replicate": 1, "dp_shard": 1, "tp": 2}
    mesh_fsdp = {"dp_replicate": 1, "dp_shard": 2, "tp": 1}
    cases = [
        _case(tiny, mesh_tp),
        _case(tiny, mesh_tp, sequence_parallel=True),
        _case(tiny, mesh_tp, sequence_parallel=True, checkpointing="full"),
        _case(tiny, mesh_fsdp, grad_accum=2),
        _case(tiny, mesh_fsdp, checkpointing="full", reshard_after_forward=False),
    ]
    real, fake = _real_vs_fake(tmp_path, 2, cases, free_port())
    _within(real, fake)


@pytest.mark.slow
def test_fake_trace_matches_a_real_single_rank_step_with_checkpointing_and_lora(tiny, tmp_path):
    one = {"dp_replicate": 1, "dp_shard": 1, "tp": 1}
    lora = {"rank": 8, "alpha": 16, "dropout": 0.0, "targets": ["all-linear"]}
    generate = _case(tiny, one)
    generate[0].update(task="infer", global_batch=3, new_tokens=9)  # prefill of 55 tokens, 9 generated
    cases = [
        generate,
        _case(tiny, one),
        _case(tiny, one, checkpointing="full"),
        _case(tiny, one, checkpointing="selective"),
        _case(tiny, one, method="lora", lora=lora),
    ]
    real, fake = _real_vs_fake(tmp_path, 1, cases, free_port())
    _within(real, fake)


def test_planner_page_shows_both_figures(tiny):
    from rigpilot.app.planner.model import plan_row, summary_lines

    plan = tiny_result(tiny).best
    m = plan.peak_memory
    verify.apply_trace(plan, {"ok": True, "peak": 3 * (m.total - m.overhead), "method": "whole model"})
    d = plan.to_dict()
    lines = summary_lines(d)
    gib = 2**30
    assert f"Memory: formula {m.total / gib:.1f} GiB · traced {m.traced / gib:.1f} GiB" in lines
    assert plan_row(d, "best").peak.startswith(f"{m.traced / gib:.1f} / ")  # the larger figure is the one shown
    plan.memory[0].traced, plan.verification = None, "not verified: the trace took longer than 120 s"
    for g in plan.memory:
        g.traced = None
    memory = [line for line in summary_lines(plan.to_dict()) if line.startswith("Memory: formula")]
    assert memory and "not verified: the trace took longer than 120 s" in memory[0]


def test_the_engines_planner_verifies_within_its_budget(tiny, monkeypatch):
    from rigpilot.engine.service import planworker

    monkeypatch.setenv(verify.ENV_SWITCH, "1")
    monkeypatch.setattr(verify, "VERIFY_BUDGET_S", 0.5)  # less than one trace: every plan says so
    answer = planworker.plan(load_profile("8x-h100-sxm"), str(tiny), {"seq_len": 64, "global_batch": 8})
    best = answer["result"]["best"]
    assert best["verification"] == "not verified: no time left for it in this request"
    monkeypatch.setenv(verify.ENV_SWITCH, "0")
    answer = planworker.plan(load_profile("8x-h100-sxm"), str(tiny), {"seq_len": 64, "global_batch": 8})
    assert answer["result"]["best"]["verification"] == ""


@pytest.mark.slow
def test_two_and_four_blocks_scale_to_the_whole_model(tmp_path):
    from rigpilot.engine.workers import memtrace

    folder = tmp_path / "eight-blocks"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TINY_LLAMA, "num_hidden_layers": 8}))
    config = memtrace._load_config(str(folder), False)
    workload, par, shape = _case(folder, {"dp_replicate": 1, "dp_shard": 2, "tp": 2}, sequence_parallel=True,
                                 checkpointing="full", grad_accum=2)  # fmt: skip
    layout = Layout.from_dict(shape)
    whole = memtrace._trace_step(config, 8, workload, par, layout, False)
    low, high = (memtrace._trace_step(config, n, workload, par, layout, False) for n in memtrace.SCALE_FROM)
    scaled = memtrace._extrapolate(low, high, memtrace.SCALE_FROM, 8)
    assert abs(scaled.peak - whole.peak) <= 0.03 * whole.peak
    assert abs(scaled.optimizer - whole.optimizer) <= 0.03 * whole.optimizer


# Big enough that the weights, not the framework's fixed buffers, make the peak; fake tensors cost nothing.
LORA_LLAMA = {**TINY_LLAMA, "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
              "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 4096}  # fmt: skip


@pytest.mark.slow
def test_a_bf16_lora_plan_traces_as_the_formula_predicts(tmp_path):
    # The worker holds LoRA's frozen base in bf16, as the formula assumes: an fp32 base traced 20% above it.
    from rigpilot.engine.planner.plan import LoraSettings

    folder = tmp_path / "lora-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LORA_LLAMA))
    w = Workload(model=str(folder), task="train", method="lora", precision="bf16", seq_len=2048, global_batch=8,
                 lora=LoraSettings(rank=8, alpha=16))  # fmt: skip
    result = search(describe_model(str(folder)), load_profile("8x-h100-sxm"), w, options=SearchOptions(suggest=False))
    plan = next(
        p for p in [result.best, *result.runners_up] if p.parallelism.backend == "ddp" and p.parallelism.pp == 1
    )
    answer = verify.trace(plan)
    assert answer["ok"], answer
    formula = plan.peak_memory.total - plan.peak_memory.overhead
    assert abs(answer["peak"] - formula) <= 0.05 * formula, (answer["peak"], formula)

"""The search on every simulated machine: sane plans, rejected families, suggestions, validation."""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest

from rigpilot.engine.errors import UserError
from rigpilot.engine.hardware.machine import Host, Machine, Source
from rigpilot.engine.hardware.simulated import load_profile
from rigpilot.engine.planner.links import Topology
from rigpilot.engine.planner.plan import LoraSettings, Workload
from rigpilot.engine.planner.search import (
    MAX_BATCH,
    OFFLOAD_MARGIN,
    RANKING,
    SPEED_TIE,
    SearchOptions,
    _stage_layers,
    search,
)
from rigpilot.engine.recipe import PLAIN_RECIPE

from support.planner_inputs import llama, train

PROFILES = [
    "8x-h100-sxm", "8x-a100-pcie", "4x-rtx4090", "2x-rtx3090-nvlink", "4x-rtxa6000-bridged", "mixed-4090-3090", "1x-rtx4090",
]


LLAMA_7B = llama(4096, 11008, 32, 32, 32, 32000, 6_738_415_616, "llama-2-7b")
LLAMA_70B = llama(8192, 28672, 80, 64, 8, 128256, 70_553_706_496, "llama-3.1-70b", ctx=131072)


@pytest.fixture(scope="module")
def results():
    return {p: search(LLAMA_7B, load_profile(p), train()) for p in PROFILES}


@pytest.mark.parametrize("profile", PROFILES)
def test_plans_are_sane_on_every_machine(results, profile):
    r = results[profile]
    machine = load_profile(profile)
    assert r.explanation and all(isinstance(x, str) and x for x in r.explanation)
    if r.best is None:
        assert profile == "1x-rtx4090"
        return
    plan = r.best
    par = plan.parallelism
    assert plan.fits
    assert sorted(par.gpu_indices) == [g.index for g in machine.gpus]
    assert par.dp * par.micro_batch * par.grad_accum == 16
    for m in plan.memory:
        assert m.total <= m.capacity == machine.gpu(m.gpu).memory_total
    assert plan.timing.tokens_per_s > 0 and 0 < plan.timing.mfu < 1
    for runner in r.runners_up:
        # A runner-up is faster only within the tie the ranking gives the roomier plan (offload counted at its
        # speed less the margin it must beat).
        assert runner.fits and score(runner) <= score(plan) / (1 - SPEED_TIE) * 1.0001


def score(p) -> float:
    return p.timing.tokens_per_s * ((1 - OFFLOAD_MARGIN) if p.parallelism.offload else 1.0)


def test_h100s_train_7b_without_offload(results):
    par = results["8x-h100-sxm"].best.parallelism
    assert par.family in ("FSDP", "HSDP", "DDP", "ZeRO-1", "ZeRO-2")
    assert not (par.offload_optimizer or par.offload_params)
    assert par.world_size == 8
    assert "NVSwitch" in " ".join(results["8x-h100-sxm"].explanation)


def test_rtx4090s_without_p2p_avoid_tensor_parallelism(results):
    r = results["4x-rtx4090"]
    assert r.best.parallelism.tp == 1
    text = " ".join(r.explanation)
    assert "no P2P" in text and "tensor-parallel all-reduce would cross the CPU" in text
    assert re.search(r"about \d+% of a step", text)
    tp = next(x for x in r.rejected if x.family == "tensor parallel")
    assert "NVLink" in tp.reason and "--force-tp" in tp.reason


def test_tensor_parallel_stays_inside_nvlink_pairs():
    machine = load_profile("8x-a100-pcie")
    r = search(LLAMA_7B, machine, train(global_batch=32))
    assert all(p.parallelism.tp <= 2 for p in [r.best, *r.runners_up])
    forced = search(LLAMA_7B, machine, train(global_batch=32), options=SearchOptions(force_tp=True, runners_up=20))
    assert forced.considered > r.considered - 1
    assert "Tensor parallelism stays within groups of 2" in " ".join(r.explanation)


def test_single_4090_cannot_fully_fine_tune_7b_and_suggests_lora(results):
    r = results["1x-rtx4090"]
    assert r.best is None
    kinds = [s.change for s in r.suggestions]
    assert any("--method lora" in k for k in kinds) and any("--method qlora" in k for k in kinds)
    for s in r.suggestions:
        assert s.plan.fits
    single = next(x for x in r.rejected if x.family == "single GPU")
    assert re.fullmatch(r"single GPU needs \d+ GiB per GPU even at micro-batch 1.*; you have 24 GiB", single.reason)
    assert single.need_bytes > single.have_bytes
    assert "Nothing fits" in r.explanation[0] and "It fits if you train LoRA" in " ".join(r.explanation)


def test_rejected_family_reasons(results):
    r = results["4x-rtx4090"]
    ddp = next(x for x in r.rejected if x.family == "DDP")
    assert re.fullmatch(r"DDP needs \d+ GiB per GPU even at micro-batch 1 with full checkpointing; you have 24 GiB", ddp.reason)
    assert ddp.need_bytes > 100 * 2**30
    families = {x.family for x in r.rejected}
    assert r.best.parallelism.family not in families


def test_lora_and_qlora_fit_one_4090():
    machine = load_profile("1x-rtx4090")
    for method in ("lora", "qlora"):
        r = search(LLAMA_7B, machine, train(method=method, lora=LoraSettings(rank=16)))
        assert r.best is not None and r.best.parallelism.family == "single GPU"
        assert r.best.workload.lora.targets == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        assert r.best.workload.lora.quant_bits == (4 if method == "qlora" else 16)


def test_host_ram_binds_offload():
    machine = load_profile("4x-rtx4090")
    small = dataclasses.replace(machine, host=dataclasses.replace(machine.host, memory_total=32 * 2**30))
    r = search(LLAMA_7B, small, train())
    assert r.best is None
    assert any("host RAM" in x.reason for x in r.rejected if x.family == "offload")


def test_mixed_gpus_split_pipelines_by_memory():
    machine = load_profile("mixed-4090-3090")
    big = dataclasses.replace(machine.gpus[1], memory_total=48 * 2**30)
    mixed = dataclasses.replace(machine, gpus=[machine.gpus[0], big])
    t = Topology(mixed, [0, 1])
    ranges = _stage_layers(t, [0, 1], 2, 1, 32)
    assert ranges[0][0] == 0 and ranges[-1][1] == 32 and ranges[0][1] == ranges[1][0]
    assert ranges[1][1] - ranges[1][0] > ranges[0][1] - ranges[0][0]  # the 48 GiB card takes more layers
    r = search(LLAMA_7B, load_profile("mixed-4090-3090"), train(task="infer", global_batch=1, new_tokens=256))
    assert r.best is not None


def test_export_target_restricts_the_search():
    machine = load_profile("8x-a100-pcie")
    r = search(LLAMA_7B, machine, train(), options=SearchOptions(export="deepspeed"))
    par = r.best.parallelism
    assert par.backend == "deepspeed" and par.tp == par.pp == 1
    acc = search(LLAMA_7B, machine, train(), options=SearchOptions(export="accelerate"))
    assert acc.best.parallelism.pp == 1


def test_inference_plans():
    r = search(LLAMA_7B, load_profile("4x-rtx4090"), Workload(model="x", task="infer", seq_len=4096, global_batch=1, new_tokens=256))
    # The 4090s have no P2P, yet one token's all-reduces are small: TP2 halves each GPU's weight reads (below).
    assert r.best.memory[0].kv_cache == 2 * 1024**3 // r.best.parallelism.tp
    big = search(LLAMA_70B, load_profile("1x-rtx4090"), Workload(model="x", task="infer", seq_len=4096, global_batch=1, new_tokens=256))
    assert big.best is None
    assert big.suggestions and all(s.plan.fits for s in big.suggestions)
    h100 = search(LLAMA_70B, load_profile("8x-h100-sxm"), Workload(model="x", task="infer", seq_len=8192, global_batch=4, new_tokens=512))
    assert h100.best is not None and h100.best.parallelism.tp >= 2
    # The plan says whether splitting layers pays for generation, and that on CPU ranks it does not.
    text = " ".join(h100.explanation)
    assert "Tensor parallel pays here" in text and "CPU processes linked by gloo" in text
    small = search(LLAMA_7B, load_profile("8x-h100-sxm"), Workload(model="x", task="infer", seq_len=4096, global_batch=64, new_tokens=256))
    pays = [x for x in small.explanation if x.startswith("Tensor parallel")]
    assert len(pays) == 1 and ("does not pay" in pays[0]) == (small.best.parallelism.tp == 1)


def test_inference_tensor_parallel_without_p2p_is_decided_by_the_model():
    from rigpilot.engine.models.describe import describe_model

    # The issue: 13B on two 4090s without P2P was refused TP by a fixed rule though the model rated it 1.45x.
    spec = describe_model("llama-2-13b")
    r = search(spec, load_profile("4x-rtx4090"), Workload(model="llama-2-13b", task="infer", seq_len=2048, global_batch=1, new_tokens=256), gpus=[0, 1])
    assert r.best.parallelism.tp == 2 and not any(x.family == "tensor parallel" for x in r.rejected)
    text = " ".join(r.explanation)
    assert "Tensor parallel pays here: 1.45x the generated tokens/s of the best plan without it (layers split over 2 GPUs)" in text
    # With the figures it rests on: the link, its bandwidth, and the all-reduces' share of the generation.
    assert "have no P2P: their traffic goes through host memory at about 10 GB/s" in text
    assert "tensor-parallel all-reduces take" in text and "over host memory (no P2P)" in text
    # Where prompts dominate, each all-reduce carries the whole prompt's activations: replicas win, said with the ratio.
    long = search(LLAMA_7B, load_profile("4x-rtx4090"), Workload(model="x", task="infer", seq_len=4096, global_batch=16, new_tokens=8))
    assert long.best.parallelism.tp == 1
    line = next(x for x in long.explanation if x.startswith("Tensor parallel"))
    assert line.startswith("Tensor parallel does not pay here") and "0.4" in line
    # Training keeps the rule: a step's all-reduces carry whole activations.
    t = search(LLAMA_7B, load_profile("4x-rtx4090"), train(global_batch=16), options=SearchOptions(suggest=False))
    assert any(x.family == "tensor parallel" for x in t.rejected) or all(p.parallelism.tp == 1 for p in [t.best, *t.runners_up])


def test_search_is_fast_enough():
    machine = load_profile("8x-h100-sxm")
    r = search(LLAMA_7B, machine, train(global_batch=64), options=SearchOptions(suggest=False))
    assert r.considered > 200
    assert r.elapsed_s < 1.0  # the benchmark holds it under 100 ms; shared CI cores get slack here


def test_validation_errors():
    machine = load_profile("4x-rtx4090")
    with pytest.raises(UserError) as too_long:
        search(LLAMA_7B, machine, train(seq_len=8192))
    assert too_long.value.reason == "seq_too_long"
    assert too_long.value.fields == {"setting": "seq_len", "value": 8192, "limit": 4096}
    with pytest.raises(UserError, match="qlora is a way to train"):
        search(LLAMA_7B, machine, train(task="infer", method="qlora"))
    with pytest.raises(UserError, match="GPU 7 does not exist; this machine has GPUs 0-3"):
        search(LLAMA_7B, machine, train(), gpus=[0, 7])
    with pytest.raises(UserError, match="no GPUs selected"):
        search(LLAMA_7B, machine, train(), gpus=[])
    empty = Machine(source=Source.SIMULATED, host=Host(), gpus=[])
    with pytest.raises(UserError, match="has no GPUs"):
        search(LLAMA_7B, empty, train())
    with pytest.raises(UserError) as out_of_range:
        search(LLAMA_7B, machine, train(global_batch=0))
    assert out_of_range.value.reason == "out_of_range"
    facts = {k: v for k, v in out_of_range.value.fields.items() if k != "terms"}
    assert facts == {"setting": "global_batch", "value": 0, "lo": 1, "hi": MAX_BATCH}
    # The sentence names the setting, not its flag: each client words it (engine.schema.worded).
    assert out_of_range.value.fields["terms"]["refs"] == {"batch": {"setting": "batch", "value": None}}
    with pytest.raises(UserError) as unknown:
        search(LLAMA_7B, machine, train(precision="int3"))
    assert (unknown.value.reason, unknown.value.fields["setting"], unknown.value.fields["value"]) == (
        "not_a_choice", "precision", "int3")
    assert "bf16" in unknown.value.fields["choices"]


def test_subset_of_gpus_and_suggestion_to_use_all():
    machine = load_profile("4x-rtx4090")
    machine = dataclasses.replace(machine, host=dataclasses.replace(machine.host, memory_total=32 * 2**30))
    spec = llama(3200, 8640, 26, 32, 32, 32000, 3_426_473_600, "open-llama-3b", ctx=2048)
    r = search(spec, machine, train(global_batch=16), gpus=[0, 1])
    assert r.best is None and r.gpu_indices == [0, 1]
    first = r.suggestions[0]
    assert first.kind == "gpus" and "--gpus 0,1,2,3" in first.change
    assert first.plan.fits and first.plan.parallelism.world_size == 4


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"global_batch": 2**63}, "the batch (--batch) must be between 1 and 1,048,576"),
        ({"seq_len": 10**9}, "the sequence length (--seq) must be between 1 and 2,097,152"),
        ({"token_budget": 10**30}, "the token budget must be between 1 and"),
    ],
)
def test_absurd_workloads_are_refused_at_once_in_one_line(change, words):
    from rigpilot.engine.models import describe_model

    # Before the bounds, a batch of 2^63 kept the search enumerating divisors until pytest's timeout.
    with pytest.raises(UserError) as e:
        search(describe_model("llama-2-7b"), load_profile("4x-rtx4090"), Workload(model="llama-2-7b", **change))
    assert str(e.value).startswith(words) and "\n" not in str(e.value)


# -- judgement: ranking ------------------------------------------------------------------------------------------


def _cand(tps: float, fill: float, *, offload: bool = False, family_dp: int = 8):
    from types import SimpleNamespace

    from rigpilot.engine.planner.plan import Parallelism
    from rigpilot.engine.planner.result import Candidate

    par = Parallelism(
        gpu_indices=list(range(8)), dp=family_dp, backend="fsdp", zero_stage=3, shard_degree=family_dp,
        offload_params=offload, offload_optimizer=offload,
    )
    return Candidate(par, [], None, True, fill * 80e9, int(80e9), timing=SimpleNamespace(tokens_per_s=tps))


def test_rank_prefers_headroom_within_five_percent_and_speed_beyond():
    from rigpilot.engine.planner.search import rank

    # Both fuller plans stay under TIGHT_FILL: a plan over it ranks after them whatever its speed (next test).
    fast_full, slow_roomy = _cand(1000, 0.89), _cand(960, 0.50)
    assert rank([fast_full, slow_roomy]) == [slow_roomy, fast_full]
    much_slower = _cand(940, 0.50)
    assert rank([fast_full, much_slower]) == [fast_full, much_slower]
    # Free memory beyond 20% buys nothing: between two roomy plans the faster wins.
    roomy_fast, roomier_slow = _cand(1000, 0.78), _cand(970, 0.40)
    assert rank([roomier_slow, roomy_fast]) == [roomy_fast, roomier_slow]


def test_rank_puts_plans_over_the_headroom_threshold_after_those_under_it_without_dropping_them():
    from rigpilot.engine.planner.search import TIGHT_FILL, rank

    tight_fast, roomy_slow = _cand(1000, 0.94), _cand(700, 0.60)
    assert TIGHT_FILL == 0.90
    assert rank([tight_fast, roomy_slow]) == [roomy_slow, tight_fast]  # 30% slower, but it leaves 10% free
    # Nothing leaves the headroom: the tight plans are still planned, fastest (within the tie, roomiest) first.
    tighter = _cand(990, 0.97)
    assert rank([tighter, tight_fast]) == [tight_fast, tighter]
    # A refused plan stays after every plan that runs, tight or not.
    refused = dataclasses.replace(_cand(2000, 0.5), cannot_run="the engine does not run this layout")
    assert rank([refused, tight_fast, roomy_slow]) == [roomy_slow, tight_fast, refused]


def test_a_faster_plan_over_the_threshold_ranks_after_a_roomier_one_and_the_best_says_why():
    # Mistral-7B at 4096 tokens on 4×RTX 4090: micro-batch 2 without recompute fills just over 90% of 24 GB and
    # is about 30% faster; the plan leaving 10% free is recommended, the tight one stays in the table.
    from rigpilot.engine.models.describe import describe_model
    from rigpilot.engine.planner.search import TIGHT_FILL, _plan_fill

    r = search(describe_model("mistral-7b"), load_profile("4x-rtx4090"), Workload(model="mistral-7b", seq_len=4096, global_batch=8))
    assert _plan_fill(r.best) <= TIGHT_FILL
    tight = [p for p in r.runners_up if _plan_fill(p) > TIGHT_FILL]
    assert tight and max(p.timing.tokens_per_s for p in tight) > r.best.timing.tokens_per_s / (1 - SPEED_TIE)
    assert any("a plan over 90% is ranked after the plans that leave that headroom" in n for n in r.best.notes)
    # The CLI's table marks it, under a heading that says the rule.
    from rigpilot.engine.cli.plan import render_text

    text = render_text(r)
    assert any("tight" in line and "over 90% of a GPU" in line for line in text)
    rows = [line for line in text if line.lstrip().startswith(("best", "#"))]
    assert sum("(tight)" in line for line in rows) == len(tight) and "(tight)" not in rows[0]


def test_a_tight_plan_is_still_the_best_when_nothing_roomier_fits_and_says_so():
    from rigpilot.engine.models.describe import describe_model
    from rigpilot.engine.planner.search import TIGHT_FILL, _plan_fill

    r = search(describe_model("mistral-7b"), load_profile("1x-rtx4090"), Workload(model="mistral-7b", task="infer", seq_len=4096, global_batch=8, new_tokens=256))
    assert r.best is not None and _plan_fill(r.best) > TIGHT_FILL
    tight = [n for n in r.best.notes if n.startswith("tight:")]
    assert len(tight) == 1 and "no plan leaving 10% free fits" in tight[0] and "a smaller batch leaves room" in tight[0]


def test_rank_recommends_offload_only_when_it_is_over_15_percent_faster():
    from rigpilot.engine.planner.search import rank

    plain = _cand(1000, 0.75)
    assert rank([_cand(1140, 0.5, offload=True), plain])[0] is plain
    assert rank([_cand(1170, 0.95, offload=True), plain])[0] is plain  # plain is 14.5% slower: within 15%
    assert rank([_cand(1200, 0.7, offload=True), plain])[0].par.offload  # plain is 16.7% slower
    # Two offloading plans compare by headroom like any others.
    a, b = _cand(1000, 0.97, offload=True), _cand(980, 0.6, offload=True)
    assert rank([a, b]) == [b, a]


def test_mixtral_inference_on_a6000s_takes_the_roomy_plan_of_equal_speed():
    # The issue: 46.3-46.8/48.0 GiB picked over an equally fast 24.2 GiB plan.
    from rigpilot.engine.models.describe import describe_model

    r = search(describe_model("mixtral-8x7b"), load_profile("4x-rtxa6000-bridged"), Workload(model="mixtral-8x7b", task="infer", seq_len=2048, global_batch=1, new_tokens=256))
    best = r.best.peak_memory
    assert best.total / best.capacity < 0.6
    fastest = max([r.best, *r.runners_up], key=lambda p: p.timing.tokens_per_s)
    assert fastest is not r.best and fastest.timing.tokens_per_s < r.best.timing.tokens_per_s / (1 - SPEED_TIE)
    assert any(n.startswith("ranked above") and "free on its fullest GPU" in n for n in r.best.notes)


def test_70b_lora_on_h100s_does_not_recommend_offload_for_a_few_percent():
    # The issue: ZeRO-3 offload at 2.9 GiB headroom over ZeRO-3 without it for ~9% more tokens/s. At s=2048
    # LoRA's activations (counted as ZeRO-3's half adapters and selective checkpointing keep them) no longer
    # fit without offload except fully checkpointed, over 15% slower: offload is rightly chosen there. At
    # s=1024 offload is 18% faster, which its margin brings within the 5% tie, where headroom decides.
    r = search(LLAMA_70B, load_profile("8x-h100-sxm"), Workload(model="x", method="lora", seq_len=1024, global_batch=16, **PLAIN_RECIPE), options=SearchOptions(export="deepspeed"))
    assert not r.best.parallelism.offload
    off = [p for p in r.runners_up if p.parallelism.offload]
    assert off and off[0].timing.tokens_per_s > r.best.timing.tokens_per_s  # faster, but not by 15%
    assert off[0].timing.tokens_per_s * (1 - OFFLOAD_MARGIN) <= r.best.timing.tokens_per_s / (1 - SPEED_TIE)
    assert any("offload is recommended only where" in n for n in r.best.notes)


def test_equal_speed_zero2_and_fsdp_go_to_the_one_with_headroom():
    # The same speed at 72.5 and 59.7 of 79.6 GiB: ties went to the fuller plan (ZeRO-2) before.
    from rigpilot.engine.models.describe import describe_model

    r = search(describe_model("llama-3.1-8b"), load_profile("8x-h100-sxm"), Workload(model="llama-3.1-8b", seq_len=8192, global_batch=16))
    assert r.best.parallelism.family == "FSDP"
    # The equally fast ZeRO-2 fills 91% of its GPU: over TIGHT_FILL, it now ranks after every plan that leaves
    # 10% free, and the ZeRO-2 shown is a roomier (fully checkpointed) one.
    from rigpilot.engine.planner.search import TIGHT_FILL, _plan_fill

    zero2 = next(p for p in r.runners_up if p.parallelism.family == "ZeRO-2")
    assert _plan_fill(zero2) <= TIGHT_FILL and zero2.timing.tokens_per_s < r.best.timing.tokens_per_s


def test_the_table_states_the_order_it_has():
    import json as _json

    from rigpilot.engine.cli.plan import render_text

    r = search(LLAMA_7B, load_profile("8x-h100-sxm"), train(seq_len=4096, global_batch=32))
    text = "\n".join(render_text(r))
    assert "fastest first" not in text and f"Plans, {RANKING}:" in text
    d = _json.loads(_json.dumps(r.to_dict()))
    order = [d["best"], *d["runners_up"]]
    # A plan shown after another is slower, or faster only within the tie the roomier plan wins.
    for a, b in itertools.pairwise(order):
        ta, tb = a["timing"]["tokens_per_s"], b["timing"]["tokens_per_s"]
        assert tb <= ta / (1 - SPEED_TIE) * 1.0001


def test_the_host_ram_line_asks_the_machine_whether_it_is_simulated_not_its_label():
    from rigpilot.engine.cli.plan import render_text

    machine = load_profile("8x-h100-sxm")
    r = search(LLAMA_7B, machine, train(seq_len=4096, global_batch=32))
    ram = next(line for line in render_text(r, simulated=machine.simulated) if "host RAM" in line)
    assert "the simulated machine's" in ram and "CPU ranks use this host's RAM" in ram
    r.best.machine = "simulated-looking label of a real machine"
    ram = next(line for line in render_text(r, simulated=False) if "host RAM" in line)
    assert "simulated" not in ram

"""The memory formula on the cases a Llama-only formula missed, held against real CPU steps.

Each case trains a tiny model for one step (engine/accuracy) and compares what
autograd saved with `predict_components`: within 10%, and never more than 3%
below the measurement (the direction that runs a planned job out of memory).
The tensor-parallel cases run on 2 gloo CPU ranks, split by the engine's own
`apply_tensor_parallel`. Saved activations are held within 1% here, tighter
than the benchmark: each tensor of these cases is accounted for. Every case here was out of bounds before the formula
knew about eager attention, soft-capping, window masks, fused experts,
dropout masks and how the engine's TP keeps logits and gathered inputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rigpilot.engine.models import describe_config, describe_model
from rigpilot.engine.planner.memory import GIB, MemoryModel
from rigpilot.engine.planner.model import model_facts
from rigpilot.engine.planner.plan import Parallelism, Workload

# google/gemma-2-9b's published config.json (the keys that size it).
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
    "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "num_attention_heads": 16,
    "num_hidden_layers": 42, "num_key_value_heads": 8, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "sliding_window": 4096, "vocab_size": 256000, "pad_token_id": 0, "bos_token_id": 2,
    "eos_token_id": 1,
}  # fmt: skip


# --- What the formula knows, from config.json alone -----------------------------------------------------------------


def test_gemma2_runs_eager_soft_capped_attention() -> None:
    spec = describe_config(GEMMA2_9B, id="gemma-2-9b")
    assert spec.attn_eager and spec.attn_softcap == 50.0 and spec.final_softcap == 30.0
    assert (spec.sliding_window, spec.sliding_layers) == (4096, 21)  # every other layer
    assert model_facts(spec).norms_per_layer == 4


@pytest.mark.parametrize(
    ("config", "window", "layers"),
    [
        ({"model_type": "mistral", "sliding_window": 4096}, 4096, 32),
        ({"model_type": "mistral", "sliding_window": None}, None, 0),  # v0.3: null turns the default off
        ({"model_type": "mistral"}, 4096, 32),  # the config class's default
        ({"model_type": "qwen2", "sliding_window": 4096}, None, 0),  # only with use_sliding_window
        ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 28}, 4096, 4),
        ({"model_type": "llama"}, None, 0),
    ],
)
def test_sliding_window_layers(config: dict, window: int | None, layers: int) -> None:
    base = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 32, "vocab_size": 1000}  # fmt: skip
    spec = describe_config({**base, **config})
    assert (spec.sliding_window, spec.sliding_layers) == (window, layers)


def test_window_mask_counts_from_the_window_on() -> None:
    """SDPA is handed an explicit mask (and GQA's k/v repeated) once the sequence reaches the window."""
    cfg = {"model_type": "mistral", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000, "sliding_window": 64}  # fmt: skip
    from rigpilot.engine.planner.memory import predict_components

    kw = dict(precision="bf16", method="full", optimizer="adamw", checkpointing="none", micro_batch=1)
    per_token = {
        s: predict_components(describe_config(cfg), seq_len=s, **kw)["activations_saved"] / s for s in (32, 63, 64)
    }
    windowless = {s: predict_components(describe_config({**cfg, "sliding_window": None}), seq_len=s, **kw)[
        "activations_saved"] / s for s in (32, 63, 64)}  # fmt: skip
    assert per_token[32] == pytest.approx(windowless[32]) and per_token[63] == pytest.approx(windowless[63])
    # At s = 64: a bf16 mask of s per token per layer, and k, v widened from 2 to 4 heads.
    extra = 2 * (2 * 64 + 2 * 2 * (256 - 128))
    assert per_token[64] - windowless[64] == pytest.approx(extra)


def test_gemma2_9b_fsdp_without_checkpointing_no_longer_fits_an_h100(tmp_path: Path) -> None:
    """The issue's example: full fine-tuning at s = 4096 on 8×H100 was said to fit at 70.0 of 79.6 GiB."""
    (tmp_path / "config.json").write_text(json.dumps(GEMMA2_9B))
    spec = describe_model(str(tmp_path))
    w = Workload(model=str(tmp_path), task="train", method="full", precision="bf16", seq_len=4096, global_batch=16)
    mm = MemoryModel(model_facts(spec), w)
    par = Parallelism(gpu_indices=list(range(8)), dp=8, zero_stage=3, shard_degree=8, backend="fsdp",
                      micro_batch=1, grad_accum=2)  # fmt: skip
    stage = mm.train_stage(par, 0, "hopper")
    # Eager attention keeps 16 heads × 4096² scores per layer three times over (bf16 tanh, fp32 softmax, bf16
    # probabilities): 2 GiB a layer, 84 GiB over 42 layers, before anything else.
    assert stage.activations > 84 * GIB
    assert stage.total > 80 * GIB


def test_gemma2_9b_plans_checkpoint(tmp_path: Path) -> None:
    from rigpilot.engine.hardware.simulated import load_profile
    from rigpilot.engine.planner.search import search

    (tmp_path / "config.json").write_text(json.dumps(GEMMA2_9B))
    spec = describe_model(str(tmp_path))
    w = Workload(model=str(tmp_path), task="train", method="full", precision="bf16", seq_len=4096, global_batch=16)
    result = search(spec, load_profile("8x-h100-sxm"), w)
    assert result.best is not None, "some plan must fit"
    for plan in [result.best, *result.runners_up]:
        assert plan.parallelism.checkpointing != "none", plan.parallelism


# --- Against real steps (torch) ------------------------------------------------------------------------------------

FORMULA_CASES = [
    ("gemma2", "fp32", 64),
    ("gemma2", "bf16", 128),
    ("mistral-swa", "fp32", 128),
    ("mistral-swa", "bf16", 32),  # the sequence exactly at the window
    ("qwen2-swa", "fp32", 64),  # a window in two layers of three
    ("phi3-swa", "bf16", 64),  # fused projections, concatenating rotary embedding
    pytest.param("olmoe", "bf16", 64, marks=pytest.mark.slow),  # counted on the meta device in a child process
    ("qwen3_moe", "bf16", 64),
    ("gpt2-dropout", "fp32", 64),
    ("gemma3", "bf16", 64),  # fp32 q/k-norm outputs, a sliding and a global layer
    pytest.param("gemma3", "fp32", 64, marks=pytest.mark.slow),
    ("gpt-oss", "bf16", 64),  # sink-extended fp32 scores, clamped-SwiGLU fp32 experts
    pytest.param("gpt-oss", "fp32", 128, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("model", "precision", "seq"), FORMULA_CASES)
def test_formula_holds_on_a_real_step(model: str, precision: str, seq: int) -> None:
    pytest.importorskip("torch")
    from rigpilot.engine.accuracy.compare import compare_step, format_table
    from rigpilot.engine.accuracy.measure import Case

    rows = compare_step(Case(model, precision=precision, seq_len=seq))
    assert all(r.ok for r in rows), format_table(rows)
    # Tighter than the benchmark's bounds: each of these tensors is accounted for, so the formula is within 1%.
    (act,) = [r for r in rows if r.component == "activations_saved"]
    assert act.error is not None and abs(act.error) <= 0.01, format_table(rows)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gemma3", "gpt-oss"])
def test_lora_on_gemma3_and_gpt_oss_within_five_percent(model: str) -> None:
    """The issue: saved activations of these families were under-counted by 10-13%. With a bf16 base (LoRA)
    gpt-oss's sinks are bf16, so its softmax is too: a view of it is all the value matmul keeps."""
    pytest.importorskip("torch")
    from rigpilot.engine.accuracy.compare import compare_step, format_table
    from rigpilot.engine.accuracy.measure import Case

    rows = compare_step(Case(model, precision="bf16", method="lora", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")))
    (act,) = [r for r in rows if r.component == "activations_saved"]
    assert act.error is not None and abs(act.error) <= 0.05, format_table(rows)


@pytest.mark.slow
def test_tensor_parallel_ranks_hold_what_the_formula_says() -> None:
    """TP 2 with and without sequence parallel, untied (vocabulary-parallel) and tied (whole) heads, per rank."""
    pytest.importorskip("torch")
    from rigpilot.engine.accuracy.compare import DEFAULT_TP_CASES, compare_tp, format_table

    rows = compare_tp(DEFAULT_TP_CASES)
    assert len(rows) == 4 * len(DEFAULT_TP_CASES)
    assert all(r.ok for r in rows), format_table(rows)


# Under TP 2 (with SP) the same cases are rows of DEFAULT_TP_CASES, held by the tensor-parallel test above.
SELECTIVE = [("full", 1, False), ("lora", 1, False)]


@pytest.mark.parametrize(("method", "tp", "sp"), SELECTIVE)
def test_selective_checkpointing_keeps_every_matmul_output(method: str, tp: int, sp: bool) -> None:
    """The engine's selective policy keeps each matmul's output: under LoRA the frozen base's, A's and B's
    (more than LoRA saves without checkpointing), and under TP a row-parallel matmul's whole-width output.

    A 70B LoRA plan (FSDP 4 × TP 2 with SP, selective) traced at 61.5 GiB of activations per GPU against
    the formula's 32.6 before it counted them.
    """
    pytest.importorskip("torch")
    from rigpilot.engine.accuracy.compare import LLAMA_LINEARS, compare_step, compare_tp, format_table
    from rigpilot.engine.accuracy.measure import Case

    targets = LLAMA_LINEARS if method == "lora" else None
    case = Case("llama", precision="bf16", method=method, checkpointing="selective", lora_targets=targets, tp=tp,
                sequence_parallel=sp)  # fmt: skip
    rows = compare_tp([case]) if tp > 1 else compare_step(case)
    assert all(r.ok for r in rows), format_table(rows)
    (act,) = [r for r in rows if r.component == "activations_saved"]
    assert act.error is not None and abs(act.error) <= 0.01, format_table(rows)


@pytest.mark.slow
def test_fused_experts_count_in_flops() -> None:
    """OLMoE has no formula: its fused 3-D experts, found on the meta device, are matmuls a token passes through."""
    pytest.importorskip("torch")
    from rigpilot.engine.accuracy.models import spec_for

    spec = spec_for("olmoe")  # hidden 128, 8 experts of width 64, top-2, 4 heads of 32, vocab 512, 2 layers
    experts = [lin for lin in spec.layer_linears if lin.expert]
    assert [(e.name, e.in_features, e.out_features) for e in experts] == [
        ("gate_up_proj", 128, 128),
        ("down_proj", 64, 128),
    ]
    per_layer = 4 * 128 * 128 + 128 * 8 + 2 * (128 * 128 + 64 * 128)  # attention, router, two experts
    assert model_facts(spec).matmul_params_per_token == 2 * per_layer + 512 * 128

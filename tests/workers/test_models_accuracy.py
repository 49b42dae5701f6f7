"""The memory harness: measurements that hold on their own, and the planner's predictions against them.

Real training steps of small models on the CPU (see engine/accuracy). Bounds:
parameters, gradients and optimizer state within 1% of the prediction, saved
activations within 10%, the KV cache exact.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rigpilot.engine.accuracy.compare import BOUNDS, KvCase, compare_kv, compare_step  # noqa: E402
from rigpilot.engine.accuracy.measure import Case, SavedTensorMeter, measure_kv_cache, measure_step  # noqa: E402
from rigpilot.engine.accuracy.models import MODEL_NAMES, spec_for  # noqa: E402

pytestmark = pytest.mark.slow

# --- The measurements, independent of the planner ----------------------------------------------------------------


def test_saved_tensor_meter_counts_each_storage_once_and_skips_parameters() -> None:
    w = torch.nn.Parameter(torch.randn(8, 4))
    x = torch.randn(3, 8, requires_grad=True)
    meter = SavedTensorMeter([w])
    with meter.recording():
        y = x @ w  # saves x and w; w is a parameter
        z = (y * y).sum() + (x[:, :4] * y).sum()  # y saved twice, x again through a view
    assert meter.bytes == x.nbytes + y.nbytes
    z.backward()


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_measured_parameters_are_the_described_count(model: str) -> None:
    """describe_model's count (formula, or MiniLM's safetensors headers) is what the real model allocates."""
    measured = measure_step(Case(model, micro_batch=1, seq_len=8))
    spec = spec_for(model)
    assert measured["params"] == 4 * spec.params_total
    assert measured["optimizer"] >= 2 * measured["grads"]  # AdamW: two moments per trained parameter


@pytest.mark.parametrize("model", ["llama", "gpt2", "mixtral"])
def test_kv_cache_is_two_tensors_per_layer_of_the_kv_heads(model: str) -> None:
    spec = spec_for(model)
    measured = measure_kv_cache(model, batch=2, prompt=10, new_tokens=5, dtype=torch.bfloat16)
    assert measured == 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * (10 + 5 - 1) * 2 * 2


# --- Predicted vs measured ---------------------------------------------------------------------------------------


STEP_CASES = [
    Case("llama"),
    Case("llama", precision="bf16", checkpointing="full"),
    Case("llama", precision="bf16", method="lora", lora_targets=("q_proj", "v_proj")),
    Case("qwen2", precision="bf16"),
    Case("qwen2", method="lora", checkpointing="full", lora_targets=("q_proj", "v_proj")),
    Case("mixtral", precision="bf16"),
    Case("gpt2"),
    Case("minilm"),
    Case("minilm", precision="bf16", method="lora", lora_targets=("query", "value")),
    Case("gpt2", precision="bf16"),  # gelu_new's pow runs in fp32 under CUDA autocast: its saved tensors too
]


@pytest.mark.parametrize("case", STEP_CASES, ids=lambda c: c.name)
def test_training_step_within_bounds(case: Case) -> None:
    rows = compare_step(case)
    out = [
        f"{r.component}: predicted {r.predicted:,} measured {r.measured:,} ({100 * r.error:+.2f}%)"
        for r in rows
        if not r.ok
    ]
    assert not out, "; ".join(out)
    assert {r.component: r.bound for r in rows} == {
        k: BOUNDS[k] for k in ("params", "grads", "optimizer", "activations_saved")
    }


@pytest.mark.parametrize("case", [KvCase("llama", "bf16"), KvCase("gpt2"), KvCase("qwen2", "bf16"), KvCase("mixtral")],
                         ids=lambda c: c.name)  # fmt: skip
def test_kv_cache_prediction_is_exact(case: KvCase) -> None:
    row = compare_kv(case)
    assert row.predicted == row.measured

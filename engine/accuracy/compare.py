"""Put the planner's predictions beside the measurements and say which are within bounds.

The planner is asked only through its public functions
(`rigpilot.engine.planner.memory.predict_components` and `predict_kv_cache`) with the
ModelSpec that `describe_model` gives for the very model measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from types import ModuleType

import torch

from rigpilot.engine.accuracy.measure import COMPONENTS, Case, measure_kv_cache, measure_step
from rigpilot.engine.accuracy.models import spec_for
from rigpilot.engine.models import ModelSpec

# How far a measurement may be from its prediction, relative to the prediction.
BOUNDS = {"params": 0.01, "grads": 0.01, "optimizer": 0.01, "activations_saved": 0.10, "kv_cache": 0.0}
# How far a prediction may fall short of the measurement, relative to the measurement: the direction
# that runs a planned job out of memory.
UNDER_BOUND = 0.03

LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # all-linear

DEFAULT_CASES = (
    Case("llama"),
    Case("llama", precision="bf16"),
    Case("llama", checkpointing="full"),
    Case("llama", precision="bf16", checkpointing="full"),
    Case("llama", precision="bf16", method="lora", lora_targets=("q_proj", "v_proj")),
    Case("llama", method="lora", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    Case("gpt2"),
    Case("gpt2", precision="bf16"),
    Case("qwen2", precision="bf16"),
    Case("qwen2", method="lora", checkpointing="full", lora_targets=("q_proj", "v_proj")),
    Case("mixtral"),
    Case("mixtral", precision="bf16"),
    Case("minilm"),
    Case("minilm", precision="bf16", method="lora", lora_targets=("query", "value")),
    # The cases a Llama-only formula missed: eager soft-capped attention, a sliding window the sequence
    # reaches, routed experts stored as fused 3-D parameters (OLMoE has no formula: meta-device structure).
    Case("gemma2"),
    Case("gemma2", precision="bf16", seq_len=128),
    Case("mistral-swa", seq_len=128),
    Case("mistral-swa", precision="bf16", seq_len=128),
    Case("qwen2-swa"),
    Case("phi3-swa"),
    Case("phi3-swa", precision="bf16"),
    Case("neox", precision="bf16"),
    Case("qwen3_moe", precision="bf16"),
    Case("olmoe"),
    Case("olmoe", precision="bf16"),
    Case("olmoe", precision="bf16", method="lora", lora_targets=("q_proj", "v_proj")),  # frozen experts
    Case("gemma2", precision="bf16", method="lora", lora_targets=("q_proj", "v_proj")),
    Case("gpt2-dropout"),
    # The engine's selective checkpointing keeps every matmul's output, LoRA's frozen ones and adapters too.
    Case("llama", precision="bf16", checkpointing="selective"),
    Case("llama", precision="bf16", method="lora", checkpointing="selective", lora_targets=LLAMA_LINEARS),
)

# Measured per rank on 2 gloo CPU ranks (engine.accuracy.tp), split by the engine's apply_tensor_parallel.
DEFAULT_TP_CASES = (
    Case("llama", tp=2),
    Case("llama", tp=2, sequence_parallel=True),
    Case("llama", precision="bf16", tp=2, sequence_parallel=True),
    Case("qwen2", tp=2),  # a tied head: whole logits on every rank
    Case("qwen2", precision="bf16", tp=2, sequence_parallel=True),
    Case("gemma2", precision="bf16", tp=2, sequence_parallel=True),  # four norms, eager heads split, tied head
    Case("qwen3_moe", precision="bf16", tp=2, sequence_parallel=True),  # experts and router whole on every rank
    Case("mistral-swa", tp=2, seq_len=128),  # one KV head per rank: the repeat for the mask is a view
    # LoRA split with its base layers (A whole beside a column-parallel base, B whole beside a row-parallel one).
    Case("llama", precision="bf16", method="lora", tp=2, lora_targets=LLAMA_LINEARS),
    Case("llama", precision="bf16", method="lora", tp=2, sequence_parallel=True, lora_targets=LLAMA_LINEARS),
    # Selective checkpointing under TP: row-parallel matmuls output the whole width before their reduction.
    Case("llama", precision="bf16", tp=2, sequence_parallel=True, checkpointing="selective"),
    Case("llama", precision="bf16", method="lora", tp=2, sequence_parallel=True, checkpointing="selective",
         lora_targets=LLAMA_LINEARS),
)


@dataclass(frozen=True)
class KvCase:
    model: str
    dtype: str = "fp32"  # "fp32" | "bf16"
    batch: int = 2
    prompt: int = 24
    new_tokens: int = 9

    @property
    def name(self) -> str:
        return f"{self.model} {self.dtype} generate b{self.batch} {self.prompt}+{self.new_tokens}"

    @property
    def cached_tokens(self) -> int:
        return self.prompt + self.new_tokens - 1


DEFAULT_KV_CASES = (KvCase("llama"), KvCase("llama", "bf16"), KvCase("gpt2"), KvCase("qwen2", "bf16"),
                    KvCase("mixtral"))  # fmt: skip


@dataclass(frozen=True)
class Row:
    """One case and component: the formula's prediction beside the measurement (and other estimates)."""

    case: str
    component: str
    predicted: int | None  # None: the planner's memory model is not available
    measured: int
    # Further estimates of the same bytes, shown in their own columns when a row has them; None: not made.
    traced: int | None = None

    @property
    def bound(self) -> float:
        return BOUNDS[self.component]

    @property
    def error(self) -> float | None:
        """(measured - predicted) / predicted."""
        if self.predicted is None:
            return None
        if self.predicted == 0:
            return 0.0 if self.measured == 0 else float("inf")
        return (self.measured - self.predicted) / self.predicted

    @property
    def under(self) -> float | None:
        """How far the prediction falls short of the measurement, relative to it (negative: above it)."""
        if self.predicted is None or self.measured == 0:
            return None
        return (self.measured - self.predicted) / self.measured

    @property
    def ok(self) -> bool | None:
        if self.error is None:
            return None
        under = self.under
        return abs(self.error) <= self.bound and (under is None or under <= UNDER_BOUND)


def planner_memory() -> ModuleType:
    return import_module("rigpilot.engine.planner.memory")


def compare_step(case: Case, memory: ModuleType | None = None) -> list[Row]:
    measured = measure_step(case)
    predicted = _predict(spec_for(case.model), case, memory or planner_memory())
    return [Row(case.name, c, predicted[c], measured[c]) for c in COMPONENTS]


def compare_tp(cases: list[Case] | tuple[Case, ...], memory: ModuleType | None = None) -> list[Row]:
    """Rows of tensor-parallel cases, measured together in one group of gloo ranks per TP degree."""
    from rigpilot.engine.accuracy.tp import measure_tp_steps

    memory = memory or planner_memory()
    rows: list[Row] = []
    for tp in sorted({c.tp for c in cases}):
        group = [c for c in cases if c.tp == tp]
        for case, measured in zip(group, measure_tp_steps(group), strict=True):
            predicted = _predict(spec_for(case.model), case, memory)
            rows += [Row(case.name, c, predicted[c], measured[c]) for c in COMPONENTS]
    return rows


def compare_kv(case: KvCase, memory: ModuleType | None = None) -> Row:
    dtype = torch.bfloat16 if case.dtype == "bf16" else torch.float32
    measured = measure_kv_cache(case.model, batch=case.batch, prompt=case.prompt, new_tokens=case.new_tokens,
                                dtype=dtype)  # fmt: skip
    memory = memory or planner_memory()
    dtype_bytes = 2 if case.dtype == "bf16" else 4
    predicted = memory.predict_kv_cache(spec_for(case.model), case.batch, case.cached_tokens, dtype_bytes)
    return Row(case.name, "kv_cache", predicted, measured)


def _predict(spec: ModelSpec, case: Case, memory: ModuleType) -> dict[str, int]:
    parallel = {"tp": case.tp, "sequence_parallel": case.sequence_parallel} if case.tp > 1 else {}
    return memory.predict_components(
        spec,
        precision=case.precision,
        method=case.method,
        optimizer=case.optimizer,
        checkpointing=case.checkpointing,
        micro_batch=case.micro_batch,
        seq_len=case.seq_len,
        lora_rank=case.lora_rank,
        lora_targets=list(case.lora_targets) if case.lora_targets else None,
        **parallel,
    )


def format_table(rows: list[Row]) -> str:
    """A fixed-width predicted-vs-measured table, one row per case and component.

    error is (measured - predicted) / predicted; a row is out of bounds ("NO") when |error| exceeds
    its bound or the prediction falls more than 3% below the measurement. A traced column appears
    when any row has a traced figure.
    """
    traced = any(r.traced is not None for r in rows)
    head = f"{'case':<44} {'component':<18} {'predicted':>12}"
    head += f" {'traced':>12}" if traced else ""
    head += f" {'measured':>12} {'error':>8} {'bound':>6}  ok"
    lines = [head, "-" * len(head)]
    for r in rows:
        pred = "-" if r.predicted is None else f"{r.predicted:,}"
        err = "-" if r.error is None else f"{100 * r.error:+.2f}%"
        ok = "skip" if r.ok is None else ("yes" if r.ok else "NO")
        line = f"{r.case:<44} {r.component:<18} {pred:>12}"
        if traced:
            line += f" {'-' if r.traced is None else f'{r.traced:,}':>12}"
        line += f" {r.measured:>12,} {err:>8} {100 * r.bound:>5.0f}%  {ok}"
        lines.append(line)
    return "\n".join(lines)

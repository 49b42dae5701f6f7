"""Which plans the memory tracer traces: the recipes it would count wrong are left to the formula, saying why."""

from __future__ import annotations

from rigpilot.engine.planner.traceable import why_not_traced

PLAIN = {"task": "train", "method": "full", "optimizer": "adamw"}
FSDP = {"backend": "fsdp", "dp": 2}


def test_plain_and_pure_bf16_plans_are_traced():
    assert why_not_traced(PLAIN, FSDP) is None
    assert why_not_traced({**PLAIN, "master_weights": "bf16", "loss_chunks": 8, "activation_offload": True}, FSDP) is None


def test_recipes_the_tracer_would_count_as_torch_adamw_are_left_to_the_formula():
    eight_bit = why_not_traced({**PLAIN, "optimizer": "adamw8bit"}, FSDP)
    in_backward = why_not_traced({**PLAIN, "optimizer_in_backward": True}, FSDP)
    assert eight_bit is not None and "8-bit AdamW" in eight_bit and "formula's figure stands" in eight_bit
    assert in_backward is not None and "in backward" in in_backward and "formula's figure stands" in in_backward
    # Inference plans carry no optimizer: a stray field does not stop their trace.
    assert why_not_traced({"task": "infer", "weight_bits": 16, "optimizer": "adamw8bit"}, {"tp": 2}) is None

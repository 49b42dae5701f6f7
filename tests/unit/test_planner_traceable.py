"""Which plans the memory tracer traces: every training recipe; the plans it cannot run are left to the formula."""

from __future__ import annotations

from rigpilot.engine.planner.traceable import why_not_traced

PLAIN = {"task": "train", "method": "full", "optimizer": "adamw"}
FSDP = {"backend": "fsdp", "dp": 2}


def test_plain_and_pure_bf16_plans_are_traced():
    assert why_not_traced(PLAIN, FSDP) is None
    assert why_not_traced({**PLAIN, "master_weights": "bf16", "loss_chunks": 8, "activation_offload": True}, FSDP) is None


def test_eight_bit_adamw_and_the_step_in_backward_are_traced():
    # The tracer runs torchao's 8-bit state and the worker's OptimizerInBackward (engine.workers.memtrace).
    assert why_not_traced({**PLAIN, "optimizer": "adamw8bit"}, FSDP) is None
    assert why_not_traced({**PLAIN, "optimizer_in_backward": True}, FSDP) is None
    assert why_not_traced({**PLAIN, "optimizer": "adamw8bit", "optimizer_in_backward": True}, {"backend": "single"}) is None
    # Inference plans carry no optimizer: a stray field does not stop their trace.
    assert why_not_traced({"task": "infer", "weight_bits": 16, "optimizer": "adamw8bit"}, {"tp": 2}) is None

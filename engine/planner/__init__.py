"""The parallelism planner: will a model fit on these GPUs, and what is the fastest way to split it?

Pure Python over the machine model (`rigpilot.engine.hardware.machine`) and a `ModelSpec`:
no torch, no Qt, no GPU. The entry point is `search`; `predict_components` and
`predict_kv_cache` are the single-GPU formulas the accuracy harness checks.
"""

from rigpilot.engine.planner.export import accelerate_config, deepspeed_config, export, slurm_script, torchrun_command
from rigpilot.engine.planner.links import Calibration, Topology
from rigpilot.engine.planner.memory import MemoryModel, plan_memory, predict_components, predict_kv_cache
from rigpilot.engine.planner.plan import (
    PLAN_VERSION,
    HostMemory,
    LoraSettings,
    MemoryBreakdown,
    Parallelism,
    Plan,
    Timing,
    Workload,
)
from rigpilot.engine.planner.search import Rejection, SearchOptions, SearchResult, Suggestion, search
from rigpilot.engine.planner.speed import SpeedModel

__all__ = [
    "PLAN_VERSION",
    "Calibration",
    "HostMemory",
    "LoraSettings",
    "MemoryBreakdown",
    "MemoryModel",
    "Parallelism",
    "Plan",
    "Rejection",
    "SearchOptions",
    "SearchResult",
    "SpeedModel",
    "Suggestion",
    "Timing",
    "Topology",
    "Workload",
    "accelerate_config",
    "deepspeed_config",
    "export",
    "plan_memory",
    "predict_components",
    "predict_kv_cache",
    "search",
    "slurm_script",
    "torchrun_command",
]

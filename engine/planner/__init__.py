"""The parallelism planner: will a model fit on these GPUs, and what is the fastest way to split it?

Pure Python over the machine model (`rigpilot.engine.hardware.machine`) and a `ModelSpec`:
no torch, no Qt, no GPU. The entry point is `search.search`; `memory.predict_components` and
`memory.predict_kv_cache` are the single-GPU formulas the accuracy harness checks.

Nothing is imported here: a client that needs only the plan's data types (`plan.Plan`) must not load the
search and its models with them (the GUI reads plans; only the engine plans).
"""

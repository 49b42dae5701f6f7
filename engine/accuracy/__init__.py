"""Predicted-vs-measured GPU memory: the planner's memory model held against real training steps.

Runs in its own process with torch (the planner never imports it): builds
small models on the CPU, runs real forward/backward/AdamW steps and measures
what each component actually holds, then asks `rigpilot.engine.planner.memory` for its
prediction of the same step. `benchmarks/memory_accuracy.py` prints the table;
`tests/workers/test_models_accuracy.py` holds the bounds.
"""

"""Pure-Python units, in this process: the planner, the models, the hardware readers and importers, the schema,
the CLI's parsing and the engine service's parts on their own. No engine service, no torchrun, no window.

No fixtures of its own yet; canned planner inputs are in tests/support/planner_inputs.py.
"""

"""Torch at work: worker ranks under torchrun on CPU (gloo), real training steps the planner's formulas are held
to, plan traces and calibration runs, the warm worker.

Jobs are written and run with tests/support/worker_jobs.py; the plain reference loop is
tests/support/reference_loop.py. No fixtures shared across modules yet.
"""

"""The engine environment: installing and repairing the per-user PyTorch environment the job workers run in."""

"""The Planner page: pick a model and GPUs, see ranked plans, their memory per GPU and why, export or launch one."""

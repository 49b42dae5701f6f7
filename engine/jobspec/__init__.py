"""The job's description: what the engine, its ranks and the planner agree a job is.

`spec` (job.json: the settings, each declared once, and the layout), `secrets` (tokens kept out of job.json)
and `datasets` (the data formats a job reads). Below the workers and the planner, which both read it;
no torch, no sockets.
"""

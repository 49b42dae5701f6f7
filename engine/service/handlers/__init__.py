"""The engine's socket requests, each declared on its handler (engine.service.handling), by what they serve:
`session` the connection itself, `machine` the GPUs and the planner, `jobs` the job queue, `output` what a job
writes (results, logs, metrics, subscriptions), `scaling` scaling studies, `cluster` other engines and multi-node
jobs. engine.service.requests gathers them."""

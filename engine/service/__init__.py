"""The engine service's socket layer: one headless process per user that serves clients.

Clients (the GUI, the CLI) talk to it over a Unix socket (or TLS) with the versioned JSON messages of
`rigpilot.engine.api` (its protocol, client, TLS and pins). The service itself is `server` (start-up, shutdown, listeners, events), `connection` (one
client's queues), `login` (a TCP client's way in) and `requests`, every request it answers, each declared with its
arguments on its handler in `handlers/` (`handling` says how). `nodes` keeps the other engines this one may work
with and `multinode` runs a job across them; `planworker` runs the planner out of process. The jobs themselves
(state machine, records, metrics, recovery) live in `rigpilot.engine.jobs`, how ranks start in
`rigpilot.engine.launch`.

This package never imports torch: the service must start fast and stay small;
torch lives only in the job processes it starts.
"""

"""The engine service: one headless process per user that runs jobs and serves telemetry.

Clients (the GUI, the CLI) talk to it over a Unix socket with versioned JSON
messages (`protocol`). It keeps jobs in SQLite and a folder per job (`store`),
launches and watches them through torchrun (`supervisor`), persists telemetry
(`telemetry_store`) and serves metrics straight from the rank files (`metrics`).

This package never imports torch: the service must start fast and stay small;
torch lives only in the job processes it starts. Keep this file free of imports
because every job rank imports `rigpilot.engine.service.rankexec` at start.
"""

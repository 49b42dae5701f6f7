"""The engine's socket API: the versioned JSON protocol (`protocol`), the client every front end uses
(`client`), TLS for remote clients (`tls`) and the fingerprints a client pins (`pins`).

Shared by the engine service (engine.service), the CLI, the GUI, engines talking to each other
(multi-node) and the job bookkeeping (its notice codes). No torch, no Qt; importing it starts nothing.
"""

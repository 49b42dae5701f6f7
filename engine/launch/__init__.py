"""Starting processes: the ranks (torchrun command line and environment, the rank exec wrapper, the warm
worker) and the engine itself (its systemd user unit).

Keep this file free of imports: every job rank imports `rigpilot.engine.launch.rankexec` at start.
"""

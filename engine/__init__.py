"""Rigpilot's headless core: hardware, planner, jobs and the engine service. Never imports Qt."""

__version__ = "0.1.0"

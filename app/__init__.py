"""Rigpilot's desktop GUI (PySide6). A client of the engine service; never imports torch."""

"""The machine check (`rigpilot doctor`) in the window: its view-model, its state from the engine, its view."""

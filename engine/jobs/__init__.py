"""Jobs: what the engine runs (training, inference, user scripts, calibration) and their records."""

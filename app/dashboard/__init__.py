"""The Dashboard page: GPU cards, the telemetry chart, host and processes."""

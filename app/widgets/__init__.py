"""Widgets and helpers shared by the pages: charts, ring buffers, meters, units, palette."""

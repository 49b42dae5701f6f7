# Shortcuts for people who like make; dev.py does the work and needs only python3.
.PHONY: app test setup lint bench
app:
	python3 dev.py app
test:
	python3 dev.py test
setup:
	python3 dev.py setup
lint:
	python3 dev.py lint
bench:
	.venv/bin/python benchmarks/telemetry_sample.py

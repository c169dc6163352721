"""Benchmarks run on a GPU as ``python -m k3lab.bench.<name>``; each writes data/results/<name>_h200.json."""

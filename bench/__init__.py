"""Benchmarks (one script per question, printing JSON), and the workloads they share with the
tests: prompt sets and grids (workloads.py), synthetic metrics histories (metrics_history.py)
and a headless Chromium driver (browser.py)."""

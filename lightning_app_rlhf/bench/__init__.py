"""Benchmark harness: PPO throughput side by side with TRL 1.12's PPOTrainer, and the placements against each other.

Run ``python -m lightning_app_rlhf.bench --help``. Every measurement runs in a fresh subprocess (ours through the
CLI, the peer through its own runner), so thread settings and peak memory belong to that run alone.
"""

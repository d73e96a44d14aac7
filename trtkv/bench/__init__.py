"""``trtkv bench``: latency, throughput and KV-memory sweeps of several engines measured in one run."""
from .runner import BenchConfig, load_engines, parse_batch_sizes, parse_size, run_bench

__all__ = ["BenchConfig", "load_engines", "parse_batch_sizes", "parse_size", "run_bench"]

"""Benchmarks and chaos tooling: the serving benchmark, mmserve against vLLM, multi-turn, transport, encoder and preprocessing throughput, chaos runs."""

"""Wiring: config schema, the Ray Serve application, the CLI and the tiny model generator; benchmarks and chaos tooling in bench/."""

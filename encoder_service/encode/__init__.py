"""Encoding: the towers, tensor parallelism, the runner of one TP rank, batch planning and the step policy."""

"""Structured outputs: a request's grammar (spec.py, pure) and its compiled form and matcher (grammars.py)."""

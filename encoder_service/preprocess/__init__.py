"""Preprocessing, on CPU and without Ray: media loading, HF processors, mm_hash, placeholders, the processor cache, and preparing a request (cache lookup, encode the misses)."""

"""Encoder service: media loading, preprocessing, mm_hash, encoder models with TP, the encoder cache, Serve deployments."""

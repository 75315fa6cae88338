"""LLM engine: sequences, block pool, KV cache manager, scheduler, model runner, models, sampler, Serve deployment."""

"""LLM engine: sequences, block pool, KV cache manager, scheduler, model runner, models, sampler; the Serve replica in serve/."""

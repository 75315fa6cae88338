"""The LLM pool's Ray Serve replica class and its metrics: Ray Serve lives here; the engine stays in llm_service/."""

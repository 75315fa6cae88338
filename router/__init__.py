"""Router: OpenAI protocol models, HTTP ingress, request orchestration, encoder scheduling, LLM replica routing."""

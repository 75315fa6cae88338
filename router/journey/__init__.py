"""A request's journey through the pools, once it is parsed and admitted: the ``Orchestrator`` (one per
model) with its ``prepare`` calls to the encoder pool (``prepare_calls.py``) and its submissions to the
LLM pool (``llm_client.py``), the pools' handles (``model_handles.py``), the LLM request spec
(``llm_spec.py``), the end-to-end deadline (``deadline.py``) and the output's detokenizer. It imports
the protocol room, never the HTTP room."""

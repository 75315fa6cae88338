"""Tool calls out of the model (pure: no torch, no Ray), one format per family.

- ``calls.py``: the records (``ToolCall``, ``ParsedOutput``) and the stream's events
  (``ContentDelta``, ``CallStart``, ``ArgumentsDelta``), ``collect`` (events -> the message)
- ``stream.py``: ``MarkerStream``, the incremental parser of formats that wrap each call in markers
- ``hermes.py``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5-VL, Qwen3-VL)
- ``qwen3_xml.py``: ``<tool_call><function=name><parameter=key>value</parameter>...`` (Qwen3.5)
- ``gemma4.py``: ``<|tool_call>call:name{key:<|"|>text<|"|>}<tool_call|>`` (Gemma 4's template)
- ``pythonic.py``: ``[name(key="text"), ...]`` as the whole answer (Gemma 3, as vLLM serves it)
- ``formats.py``: ``ToolFormat`` (a parser and a grammar per format) and ``TOOL_FORMATS``, by name
- ``reasoning.py``: thinking (``<think>...</think>``, Gemma 4's thought channel) split from the content
- ``grammar.py``: ``tool_choice`` required / named as an EBNF grammar: the family's call syntax
  around calls to the allowed functions, their arguments held to each JSON schema
"""

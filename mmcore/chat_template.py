"""What a chat template reads (pure: jinja2 only), asked by both sides that render a prompt."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence


def template_variables(chat_template: object) -> frozenset[str]:
    """The variables a chat template reads and does not set itself (``chat_template``: a tokenizer's,
    a string or named ones; a template transformers' extensions keep jinja2 from parsing reads none)."""
    import jinja2
    from jinja2 import meta

    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    env = jinja2.Environment()
    out: set[str] = set()
    for source in templates:
        if isinstance(source, str):
            with contextlib.suppress(jinja2.TemplateSyntaxError):
                out |= meta.find_undeclared_variables(env.parse(source))
    return frozenset(out)


def template_takes_tools(chat_template: object) -> bool:
    """The chat template reads ``tools`` (a variable it does not set itself): the family's own
    templates do where the family was trained to call tools (Qwen's hermes block, Gemma 4's
    declarations); Gemma 3's has none. ``chat_template``: a tokenizer's, a string or named ones."""
    import jinja2
    from jinja2 import meta

    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    env = jinja2.Environment()
    for source in templates:
        if not isinstance(source, str):
            continue
        try:
            if "tools" in meta.find_undeclared_variables(env.parse(source)):
                return True
        except jinja2.TemplateSyntaxError:  # transformers' extensions (e.g. {% generation %})
            if "tools" in source:
                return True
    return False


def check_template_syntax(source: str) -> None:
    """A ``ValueError`` (with the line) if ``source`` does not parse as a chat template the way
    transformers compiles one: jinja2 with loop controls and its ``{% generation %}`` block."""
    import jinja2
    from jinja2 import ext, nodes

    class _Generation(ext.Extension):  # transformers' AssistantTracker tag, parsed only
        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it an instance attribute)

        def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = jinja2.Environment(extensions=[ext.loopcontrols, _Generation])
    try:
        env.parse(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"jinja syntax error on line {e.lineno}: {e.message}") from e


_PROBE_CALL = {"id": "call_0", "type": "function", "function": {"name": "probe", "arguments": {}}}
PROBE_TOOLS = [{"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}]


def probe_tool_chat(modality: str | None) -> list[dict[str, object]]:
    """A user turn, a call, and its result: text, then a ``modality`` part unless None."""
    content: list[dict[str, object]] = [{"type": "text", "text": "done"}]
    if modality is not None:
        content.append({"type": modality})
    return [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
        {"role": "tool", "tool_call_id": "call_0", "content": content},
    ]


def tool_result_modalities(
    render: Callable[[list[dict[str, object]]], str], modalities: Sequence[str]
) -> frozenset[str]:
    """The modalities a chat template renders in a tool result: those whose part changes the rendered
    prompt (Qwen's templates put them inside ``<tool_response>``; Gemma 4's renders only the text of a
    tool result, so an image there would have no place in the prompt). ``render``: the template applied
    to messages (with ``PROBE_TOOLS``); a template that fails on the probe is taken to render them."""
    try:
        bare = render(probe_tool_chat(None))
    except Exception:
        return frozenset(modalities)
    out = set()
    for modality in modalities:
        try:
            if render(probe_tool_chat(modality)) != bare:
                out.add(modality)
        except Exception:
            out.add(modality)
    return frozenset(out)

"""What a chat template reads (pure: jinja2 only), asked by both sides that render a prompt."""

from __future__ import annotations


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

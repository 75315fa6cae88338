"""A text completion's pieces in the completions API's shape: the ``text_completion`` stream events
(the echoed prompt first), and logprobs as ``{tokens, token_logprobs, top_logprobs, text_offset}``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llm_service.outputs import RequestOutput, TokenLogprob
from router.http.choices import ChoiceState
from router.journey.orchestrator import Orchestrator
from router.protocol.chat_output import ChoiceLogprobs, TokenLogprobEntry, TopLogprob
from router.protocol.completions import CompletionChoice, CompletionChunk, CompletionLogprobs


@dataclass(frozen=True)
class Echo:
    """What a choice's text starts with: the prompt's text when echoed ("" otherwise) and, with
    ``logprobs``, its tokens: the first (nothing scores it) and the others' logprob entries."""

    text: str = ""
    first_token: str = ""
    scored: tuple[TokenLogprobEntry, ...] = ()

    def logprobs(self) -> CompletionLogprobs:
        out = completion_logprobs(self.scored, len(self.first_token))
        return CompletionLogprobs(
            tokens=[self.first_token, *out.tokens],
            token_logprobs=[None, *out.token_logprobs],
            top_logprobs=[None, *out.top_logprobs],
            text_offset=[0, *out.text_offset],
        )


class CompletionEvents:
    """``text_completion`` chunks: the echoed prompt first (its logprobs with it), then each piece."""

    def __init__(self, request_id: str, model: str, echoes: list[Echo], logprobs: bool) -> None:
        self.request_id, self.model, self.echoes, self.logprobs = request_id, model, echoes, logprobs
        self.offsets = [len(e.text) for e in echoes]  # where each choice's next piece starts
        self.sent = [0] * len(echoes)  # logprob entries each choice's events carried so far

    def _event(self, index: int, text: str, lp: CompletionLogprobs | None, finish: str | None) -> str:
        choice = CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish)
        chunk = CompletionChunk(id=self.request_id, model=self.model, choices=[choice])
        return f"data: {chunk.model_dump_json(exclude={'usage'})}\n\n"

    def opening(self, state: ChoiceState) -> str:
        echo = self.echoes[state.index]
        if not echo.text:
            return ""
        return self._event(state.index, echo.text, echo.logprobs() if self.logprobs else None, None)

    def delta(self, state: ChoiceState, text: str, out: RequestOutput) -> str:
        """Its logprobs cover every token since the last event (a token whose text was held back,
        an incomplete character or a possible stop string, comes with the next)."""
        lp = None
        if self.logprobs:
            i = state.index
            new = state.logprobs[self.sent[i] :]
            self.sent[i] = len(state.logprobs)
            lp = completion_logprobs(new, self.offsets[i])
            self.offsets[i] += sum(len(e.token) for e in new)
        return self._event(state.index, text, lp, state.finish)


def entries(orch: Orchestrator, out: RequestOutput) -> ChoiceLogprobs | None:
    if out.new_logprobs is None:
        return None
    return ChoiceLogprobs(content=[entry(orch, lp) for lp in out.new_logprobs])


def entry(orch: Orchestrator, lp: TokenLogprob) -> TokenLogprobEntry:
    tok = orch.decode([lp.token_id])
    top = [TopLogprob(token=orch.decode([t]), logprob=v) for t, v in lp.top]
    return TokenLogprobEntry(token=tok, logprob=lp.logprob, top_logprobs=top)


def completion_logprobs(entries: Sequence[TokenLogprobEntry], offset: int) -> CompletionLogprobs:
    """The completions API's shape; ``offset``: where the first token starts in the choice's text.
    A token's alternatives include the token itself, as vLLM's do."""
    out = CompletionLogprobs()
    for e in entries:
        out.tokens.append(e.token)
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append({**{t.token: t.logprob for t in e.top_logprobs}, e.token: e.logprob})
        out.text_offset.append(offset)
        offset += len(e.token)
    return out


def joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )

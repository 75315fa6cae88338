"""Compiled grammars and per-request matchers (xgrammar, as vLLM and SGLang default to).

``GrammarBackend.compile`` turns a ``StructuredSpec`` into a compiled grammar once per distinct spec
(an LRU of ``cache_size``; failures are remembered too, so a bad schema sent again is refused at
once). JSON grammars allow no free whitespace: separators are ``,`` and ``:`` alone, as OpenAI's
strict mode writes, so a model cannot spend its ``max_tokens`` on newlines. ``compile_async``
compiles on the backend's own threads with a deadline, so a slow compile blocks neither the event
loop nor the engine's step, and a grammar that cannot start (no first token allowed, e.g. a regex
that matches nothing) is refused before the request is queued.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from llm_service.errors import RequestRejected
from llm_service.structured.spec import StructuredSpec, spec_problem

JSON_SEPARATORS = (",", ":")
# xgrammar 0.2.8 writes a length-bounded string's characters as ``[^"\\\r\n]``, which lets a raw
# control character (U+0000-U+001F) into the string: invalid JSON (json.loads and pydantic refuse it).
# Its unbounded strings exclude them; bounded ones get the same class here.
_LOOSE_STRING_CHAR = '([^\\"\\\\\\r\\n])'
_JSON_STRING_CHAR = '([^\\0-\\x1f\\"\\\\])'


def bad_spec(spec: StructuredSpec, why: str) -> RequestRejected:
    return RequestRejected("bad_structured_output", f"{spec.field} ({spec.kind}): {why}", param=spec.field)


class GrammarBackend:
    """One per engine: the tokenizer's vocabulary as xgrammar sees it, the compiler and its cache."""

    def __init__(
        self,
        tokenizer: Any,  # a transformers tokenizer of the model's directory
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        cache_size: int = 256,
        compile_timeout_s: float = 10.0,
        compile_threads: int = 2,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        # xgrammar reads the tokenizer's special tokens (<|im_start|>, <|image_pad|>, <unk>, ...) as
        # their literal text, so a grammar would let them into a JSON string; a structured output
        # never writes one but its stop tokens.
        stop = set(stop_token_ids)
        self.forbidden_token_ids = tuple(
            sorted(
                i
                for i, t in tokenizer.added_tokens_decoder.items()
                if t.special and i not in stop and i < vocab_size
            )
        )
        self._allowed_words = _allowed_words(vocab_size, self.forbidden_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()  # grammar or RequestRejected
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], Future[object]] = {}
        self._pool = ThreadPoolExecutor(compile_threads, thread_name_prefix="grammar-compile")

    @classmethod
    def for_model(cls, model_dir: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> GrammarBackend:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_dir), vocab_size, stop_token_ids)

    # ---- compiling ---------------------------------------------------------------------------------
    def compile(self, spec: StructuredSpec) -> Any:
        """The compiled grammar (cached); raises RequestRejected naming ``spec.field`` if it cannot be."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
        if hit is None:
            hit = self._compile_uncached(spec)
            with self._lock:
                self._cache[spec.key] = hit
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, RequestRejected):
            raise bad_spec(spec, hit.message)
        return hit

    async def compile_async(self, spec: StructuredSpec) -> None:
        """Compile (or find) ``spec``'s grammar off the event loop within ``compile_timeout_s``."""
        with self._lock:
            if spec.key in self._cache:
                fut = None
            else:
                fut = self._pending.get(spec.key)
                if fut is None:
                    fut = self._pool.submit(self._compile_quietly, spec)
                    self._pending[spec.key] = fut
                    fut.add_done_callback(lambda _f: self._pending.pop(spec.key, None))
        if fut is not None:
            try:
                await asyncio.wait_for(asyncio.wrap_future(fut), self.compile_timeout_s)
            except TimeoutError:
                raise bad_spec(spec, f"took longer than {self.compile_timeout_s:g} s to compile") from None
        self.compile(spec)  # a cache hit now: raises what the compile found

    def _compile_quietly(self, spec: StructuredSpec) -> object:
        try:
            return self.compile(spec)
        except RequestRejected as e:
            return e

    def _compile_uncached(self, spec: StructuredSpec) -> object:
        try:
            problem = spec_problem(spec)
            if problem is not None:
                return RequestRejected("bad_structured_output", problem)
            grammar = self._compile_kind(spec)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse/convert errors
            return RequestRejected("bad_structured_output", _first_line(e))
        if not self._can_start(grammar):
            return RequestRejected(
                "bad_structured_output", "no output can match it (no first token is allowed)"
            )
        return grammar

    def _compile_kind(self, spec: StructuredSpec) -> Any:
        c = self._compiler
        if spec.kind in ("json", "json_object"):
            schema = spec.value if spec.kind == "json" else '{"type":"object"}'
            grammar = self._xgr.Grammar.from_json_schema(
                schema, any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=True
            )
            return c.compile_grammar(str(grammar).replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "choice":
            options = json.loads(spec.value)
            return c.compile_grammar(
                "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
            )
        return c.compile_grammar(spec.value)

    def _can_start(self, grammar: Any) -> bool:
        mask = self.allocate(1)
        GrammarState(self._xgr.GrammarMatcher(grammar), self._allowed_words).fill(mask, 0)
        return bool(mask.any())

    # ---- matching ----------------------------------------------------------------------------------
    def matcher(self, spec: StructuredSpec, generated: list[int] | tuple[int, ...] = ()) -> GrammarState:
        """A fresh matcher for ``spec``, advanced over ``generated`` (a resumed request's tokens)."""
        state = GrammarState(self._xgr.GrammarMatcher(self.compile(spec)), self._allowed_words)
        for t in generated:
            if not state.accept(t):
                raise bad_spec(spec, f"its earlier output token {t} does not match the grammar")
        return state

    def allocate(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def fill_rows(states: list[GrammarState], bitmask: torch.Tensor, rows: list[int]) -> None:
    """Fill ``bitmask``'s ``rows`` for ``states`` (one each) in one call into xgrammar's C++ (its
    batch matcher: no Python per row), then keep the special tokens out of all of them at once."""
    if not states:
        return
    import xgrammar as xgr

    _batch_matcher(xgr).batch_fill_next_token_bitmask([st._m for st in states], bitmask, rows)
    allowed = states[0]._allowed
    if rows[-1] == len(rows) - 1 and rows == list(range(len(rows))):  # the first rows: a view
        bitmask[: len(rows)] &= allowed  # ~3 us, where an indexed read-and-write costs ~35 us
        return
    index = torch.tensor(rows)
    bitmask.index_copy_(0, index, bitmask.index_select(0, index) & allowed)


def accept_rows(states: list[GrammarState], tokens: list[int]) -> list[bool]:
    """Advance each state by its token (one call); a state whose stop token was taken stays as it is."""
    import xgrammar as xgr

    live = [i for i, st in enumerate(states) if not st._m.is_terminated()]
    ok = [True] * len(states)
    if live:
        taken = xgr.BatchGrammarMatcher.batch_accept_token(
            [states[i]._m for i in live], [tokens[i] for i in live]
        )
        for i, good in zip(live, taken, strict=True):
            ok[i] = bool(good)
    return ok


_BATCH: list[Any] = []


def _batch_matcher(xgr: Any) -> Any:
    if not _BATCH:  # one thread: the engine's step thread is the only caller
        _BATCH.append(xgr.BatchGrammarMatcher(max_threads=1))
    return _BATCH[0]


class GrammarState:
    """One request's matcher: which tokens may come next, advanced by each accepted token."""

    def __init__(self, matcher: Any, allowed_words: torch.Tensor) -> None:
        self._m = matcher
        self._allowed = allowed_words

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)
        bitmask[row] &= self._allowed

    def accept(self, token_id: int) -> bool:
        if self._m.is_terminated():
            return True  # its stop token was taken; the request ends with it
        return bool(self._m.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())


def _allowed_words(vocab_size: int, forbidden: tuple[int, ...]) -> torch.Tensor:
    """xgrammar's packed layout (bit ``t % 32`` of word ``t // 32``) with every bit set but ``forbidden``'s."""
    words = [0xFFFFFFFF] * ((vocab_size + 31) // 32)
    for t in forbidden:
        words[t // 32] &= ~(1 << (t % 32)) & 0xFFFFFFFF
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    # xgrammar prefixes "[hh:mm:ss] /path/file.cc:NNN: "; the rest is the message
    return text.split(": ", 1)[-1] if text.startswith("[") else text

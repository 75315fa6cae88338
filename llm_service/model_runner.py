"""Runs one scheduled batch: builds flat inputs, runs the model over the paged KV cache, samples."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from llm_service.attention import TorchPagedAttention, build_metadata
from llm_service.batch_inputs import flat_embeds, flat_ids, flat_positions, step_seq
from llm_service.config import EngineConfig
from llm_service.errors import RequestFaults, RequestRejected
from llm_service.kv_cache_sizing import KVCacheSizing, sliding_window
from llm_service.kv_handoff import KVBlocks
from llm_service.kv_io import DTYPES, read_kv_blocks, write_kv_blocks
from llm_service.linear_states import LinearStates
from llm_service.logits_processors import GrammarMasks
from llm_service.models import build_decoder, load_text_config
from llm_service.models.weights import load_weights
from llm_service.mrope import prompt_mrope_positions
from llm_service.multimodal import MultiModalInput
from llm_service.outputs import TokenLogprob
from llm_service.runner_state import RunnerState, generator_bytes, resume_generator
from llm_service.sampler import NoAllowedToken, NonFiniteLogits, SamplerState, prompt_logprobs, sample
from llm_service.scheduler import ScheduledChunk, SchedulerOutput
from llm_service.sequence import Request
from llm_service.structured.grammars import accept_rows, fill_rows

if TYPE_CHECKING:
    from llm_service.structured.grammars import GrammarState

logger = logging.getLogger(__name__)

PROMPT_LOGPROBS_ROWS = 512  # prompt positions scored per lm_head call (a vocabulary's row each)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.text_config = load_text_config(config.model)
        model = build_decoder(self.text_config, TorchPagedAttention())
        load_weights(model, config.model)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.linear_states = self._make_linear_states()
        self.sizing = KVCacheSizing(
            self.text_config, config, self.dtype, sliding_window(self.text_config, config)
        )
        self.window = self.sizing.window
        self.window_cap = self.sizing.window_cap
        self.num_blocks = config.num_kv_blocks or self.sizing.derive_num_blocks(self.device)
        self.num_window_blocks = min(self.num_blocks, self.window_cap)  # and a null block besides
        self.kv_caches = self.sizing.allocate(self.num_blocks, self.num_window_blocks, self.device)
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.states: dict[str, RunnerState] = {}  # by request id, while the request is in the engine
        self.sampler_state = SamplerState()  # the last batch's parameter tensors, the penalties' counts

    def _make_linear_states(self) -> LinearStates | None:
        """A hybrid model's state cache (its ``state_shapes``): running slots, then snapshot slots."""
        shapes = getattr(self.model, "state_shapes", None)
        if shapes is None:
            return None
        c = self.config
        self.num_state_slots = c.num_state_slots or c.max_num_seqs
        self.num_state_snapshots = 0
        if c.enable_prefix_caching:
            self.num_state_snapshots = (
                self.num_state_slots if c.num_state_snapshots is None else c.num_state_snapshots
            )
        slots = self.num_state_slots + self.num_state_snapshots
        states = LinearStates(shapes(), slots, self.device, self.dtype)
        mib = slots * LinearStates.slot_bytes(shapes(), self.dtype) / 2**20
        logger.info(
            "state cache: %d running + %d snapshot slots of linear-attention states (%.1f MiB)",
            self.num_state_slots,
            self.num_state_snapshots,
            mib,
        )
        self.model.linear_states = states
        return states

    @property
    def block_bytes(self) -> int:
        """One block's K and V over every layer that writes KV (what a block of tokens costs)."""
        return self.sizing.block_bytes

    def prepare_request(
        self, req: Request, mm_inputs: list[MultiModalInput], grammar: GrammarState | None = None
    ) -> None:
        """Move the request's embeddings to the device, precompute M-RoPE positions and its RNG; kept
        in ``states`` once every check passed."""
        state = RunnerState([(m.offset, m.length, self._on_device(m.embeddings)) for m in mm_inputs])
        state.grammar = grammar
        if self.model.uses_mrope:
            cfg = self.text_config
            pos, delta = prompt_mrope_positions(
                req.num_prompt_tokens, mm_inputs, cfg.spatial_merge_size, cfg.tokens_per_second
            )
            state.mrope, state.delta = pos.to(self.device), delta
        if getattr(self.model, "bidirectional_mm", False):
            req.attention_spans = [(m.offset, m.length) for m in mm_inputs if m.modality == "image"]
            self._check_spans_fit(req)
        seed = req.sampling_params.seed
        if seed is not None:
            state.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.states[req.request_id] = state

    # ---- E/P/D: a request's KV blocks out of one replica and into another (llm_service/kv_io.py)
    def read_kv_blocks(
        self,
        request_id: str,
        block_ids: list[int],
        from_block: int,
        window_ids: Sequence[int] = (),
        window_from: int = 0,
        state_slot: int | None = None,
        snapshot_slot: int | None = None,
    ) -> KVBlocks:
        """``kv_io.read_kv_blocks`` of this runner's caches."""
        return read_kv_blocks(
            self, request_id, block_ids, from_block, window_ids, window_from, state_slot, snapshot_slot
        )

    def write_kv_blocks(
        self,
        block_ids: list[int],
        blocks: KVBlocks,
        window_ids: Sequence[int] = (),
        state_slot: int | None = None,
        snapshot_slot: int | None = None,
    ) -> None:
        """``kv_io.write_kv_blocks`` into this runner's caches."""
        write_kv_blocks(self, block_ids, blocks, window_ids, state_slot, snapshot_slot)

    def release(self, request_id: str) -> None:
        """The request left the engine (finished, aborted or failed): drop its state; unknown ids are ignored."""
        self.states.pop(request_id, None)
        self.sampler_state.release(request_id)

    def _on_device(self, embeddings: torch.Tensor | None) -> torch.Tensor | None:
        return None if embeddings is None else embeddings.to(device=self.device, dtype=self.dtype)

    def supply(self, req: Request, mm_inputs: list[MultiModalInput]) -> list[tuple[int, int]]:
        """Embeddings for items the request was given without (matched by offset); returns the
        ``(offset, end)`` of those it still lacks."""
        state = self.states[req.request_id]
        by_offset = {m.offset: m for m in mm_inputs}
        missing = {off: end - off for off, end in state.missing()}
        for off, m in by_offset.items():
            if missing.get(off) != m.length:
                raise RequestRejected(
                    "bad_mm_input", f"no item without embeddings of {m.length} rows at {off}"
                )
        state.mm = [
            (off, n, self._on_device(by_offset[off].embeddings) if emb is None and off in by_offset else emb)
            for off, n, emb in state.mm
        ]
        return state.missing()

    def _check_spans_fit(self, req: Request) -> None:
        budget = self.config.max_num_batched_tokens
        for offset, length in req.attention_spans:
            if length > budget:
                raise RequestRejected(
                    "bad_mm_input",
                    f"image at offset {offset} is {length} tokens, which attend each other both ways and "
                    f"so must be computed in one step; max_num_batched_tokens is {budget}",
                )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, tuple[int, TokenLogprob | None]]:
        """Compute the scheduled chunks; return ``{request_id: (token, logprob)}`` for those that sample."""
        chunks = out.chunks
        if not chunks:
            return {}
        ids = flat_ids(chunks, self.device)
        embeds = flat_embeds(self.model, self.states, chunks, ids)
        positions = flat_positions(self.model, self.states, chunks, self.device)
        meta = build_metadata(
            [(c.start, c.num_tokens, c.block_table) for c in chunks],
            self.config.block_size,
            self.device,
            [c.request.attention_spans for c in chunks],
        )
        if self.window is not None:
            meta.windowed = build_metadata(
                [(c.start, c.num_tokens, c.window_table or []) for c in chunks],
                self.config.block_size,
                self.device,
                [c.request.attention_spans for c in chunks],
            )
        if self.linear_states is not None:
            meta.states = self.linear_states.step([step_seq(c) for c in chunks])
        if getattr(self.model, "takes_token_ids", False):  # Gemma 4's per-layer embeddings
            hidden = self.model(embeds, positions, self.kv_caches, meta, token_ids=ids)
        else:
            hidden = self.model(embeds, positions, self.kv_caches, meta)
        _check_finite(chunks, hidden)
        sampled = self._sample(chunks, hidden)
        self._score_prompts(chunks, hidden)
        if meta.states is not None:  # only now: a failed step is replayed for the others
            assert self.linear_states is not None
            self.linear_states.commit(meta.states)
        return sampled

    def _sample(
        self, chunks: list[ScheduledChunk], hidden: torch.Tensor
    ) -> dict[str, tuple[int, TokenLogprob | None]]:
        rows, sampling = [], []
        end = 0
        for c in chunks:
            end += c.num_tokens
            if c.samples:
                rows.append(end - 1)
                sampling.append(c.request)
        if not sampling:
            return {}
        logits = self.model.compute_logits(hidden[rows])
        gens = [self._generator(r.request_id) for r in sampling]
        params = [r.sampling_params for r in sampling]
        try:
            tokens, logprobs = sample(
                logits,
                params,
                gens,
                sampling,
                self._grammar_masks(sampling),
                self.sampler_state,
                [r.request_id for r in sampling],
            )
        except NonFiniteLogits as e:
            msg = "the model produced NaN or infinite logits for this request's inputs"
            raise RequestFaults({sampling[i].request_id: msg for i in e.rows}) from e
        except NoAllowedToken as e:
            msg = "no token is allowed next (its structured output's grammar and min_tokens leave none)"
            raise RequestFaults({sampling[i].request_id: msg for i in e.rows}) from e
        return {r.request_id: (t, lp) for r, t, lp in zip(sampling, tokens, logprobs, strict=True)}

    def _score_prompts(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> None:
        """Keep the prompt logprobs of the chunks whose request asks for them: position ``p``'s
        logits score prompt token ``p + 1`` (kept by the request, ``Request.prompt_logprobs``)."""
        row = 0
        for c in chunks:
            req, k = c.request, c.request.sampling_params.prompt_logprobs
            last = min(c.start + c.num_tokens, req.num_prompt_tokens - 1)
            for lo in range(c.start, last if k is not None else c.start, PROMPT_LOGPROBS_ROWS):
                hi = min(lo + PROMPT_LOGPROBS_ROWS, last)
                logits = self.model.compute_logits(hidden[row + lo - c.start : row + hi - c.start])
                scored = prompt_logprobs(logits, req.prompt_token_ids[lo + 1 : hi + 1], k or 0)
                req.prompt_logprobs.update(zip(range(lo + 1, hi + 1), scored, strict=True))
            row += c.num_tokens

    def _grammar_masks(self, sampling: list[Request]) -> GrammarMasks | None:
        """The next-token bitmasks of the rows with a structured output (None: no such row)."""
        grammars = [(i, self.states[r.request_id].grammar) for i, r in enumerate(sampling)]
        rows = [(i, g) for i, g in grammars if g is not None]
        if not rows:
            return None
        words = (self.text_config.vocab_size + 31) // 32
        bitmask = torch.full((len(sampling), words), -1, dtype=torch.int32)
        fill_rows([g for _, g in rows], bitmask, [i for i, _ in rows])
        return GrammarMasks(bitmask, [i for i, _ in rows])

    def accept_sampled(self, sampled: Mapping[str, tuple[int, object]]) -> None:
        """Advance the structured outputs' matchers by the step's tokens (after the step stands)."""
        grammars = [
            (rid, st.grammar, tok)
            for rid, (tok, _) in sampled.items()
            if (st := self.states.get(rid)) and st.grammar
        ]
        if not grammars:
            return
        ok = accept_rows([g for _, g, _ in grammars], [t for _, _, t in grammars])
        for (rid, _, token), good in zip(grammars, ok, strict=True):
            if not good:
                logger.error("request %s: token %d was sampled against its grammar", rid, token)

    def _generator(self, request_id: str) -> torch.Generator:
        own = self.states[request_id].generator
        return self.default_generator if own is None else own

    def generator_state(self, request_id: str) -> bytes | None:
        """A seeded request's generator state, for a decode replica to resume from (E/P/D); None
        for an unseeded one (it draws from the engine's shared generator, as on any replica)."""
        return generator_bytes(self.states.get(request_id))

    def resume_generator(self, request_id: str, raw: bytes) -> None:
        """Continue a seeded request's draws from where a prefill replica's generator left them
        (``generator_state``); ``runner_state.resume_generator`` says what it raises."""
        resume_generator(request_id, self.states[request_id].generator, raw)

    def rng_states(self, out: SchedulerOutput) -> dict[str, torch.Tensor]:
        """The seeded generators' states of the step's requests, to replay the step exactly."""
        gens = ((c.request.request_id, self.states[c.request.request_id].generator) for c in out.chunks)
        return {rid: g.get_state() for rid, g in gens if g is not None}

    def restore_rng_states(self, out: SchedulerOutput, states: dict[str, torch.Tensor]) -> None:
        for c in out.chunks:
            if (state := states.get(c.request.request_id)) is not None:
                generator = self.states[c.request.request_id].generator
                assert generator is not None, f"request {c.request.request_id} has no seeded generator"
                generator.set_state(state)


def _check_finite(chunks: list[ScheduledChunk], hidden: torch.Tensor) -> None:
    """Raise RequestFaults naming each chunk whose hidden states hold NaN/inf, before its KV is cached.

    A non-finite K/V a chunk wrote shows in its own final hidden states, and a NaN at a later
    position of a chunk reaches the earlier ones too (masked attention weights are 0, and 0 * NaN is
    NaN): such blocks must never enter the prefix cache under a hash that other prompts share.
    """
    if bool(torch.isfinite(hidden).all()):  # the common case in one reduction
        return
    bad = ~torch.isfinite(hidden).all(-1)
    parts = bad.split([c.num_tokens for c in chunks])
    msg = "the model produced NaN or infinite activations for this request's inputs"
    raise RequestFaults(
        {c.request.request_id: msg for c, p in zip(chunks, parts, strict=True) if bool(p.any())}
    )

"""Runs one scheduled batch: builds flat inputs, runs the model over the paged KV cache, samples."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from llm_service.attention import TorchPagedAttention, build_metadata
from llm_service.config import EngineConfig
from llm_service.errors import RequestFaults, RequestRejected
from llm_service.kv_cache_manager import cdiv
from llm_service.kv_handoff import KVBlocks
from llm_service.kv_io import DTYPES, read_kv_blocks, write_kv_blocks
from llm_service.linear_states import LinearStates, StepSeq
from llm_service.logits_processors import GrammarMasks
from llm_service.models import build_decoder, load_text_config
from llm_service.models.weights import load_weights
from llm_service.mrope import prompt_mrope_positions
from llm_service.multimodal import MultiModalInput
from llm_service.outputs import TokenLogprob
from llm_service.sampler import NoAllowedToken, NonFiniteLogits, SamplerState, prompt_logprobs, sample
from llm_service.scheduler import ScheduledChunk, SchedulerOutput
from llm_service.sequence import Request
from llm_service.structured.grammars import accept_rows, fill_rows
from llm_service.window_kv_cache_manager import window_blocks_needed

if TYPE_CHECKING:
    from llm_service.structured.grammars import GrammarState

logger = logging.getLogger(__name__)

CPU_KV_CACHE_CAP_BYTES = 1 << 30
PROMPT_LOGPROBS_ROWS = 512  # prompt positions scored per lm_head call (a vocabulary's row each)


@dataclass
class RunnerState:
    """What the runner keeps for one request, from ``prepare_request`` until it leaves (``release``)."""

    # (offset, length, embeddings on the device) per media item, in prompt order; None: not supplied yet
    mm: list[tuple[int, int, torch.Tensor | None]] = field(default_factory=list)
    mrope: torch.Tensor | None = None  # M-RoPE models: the prompt's positions [3, num_prompt_tokens]
    delta: int = 0  # M-RoPE models: past the prompt, text positions are shifted by it
    generator: torch.Generator | None = None  # a seeded request's own RNG
    grammar: GrammarState | None = None  # a structured output's matcher, advanced by each token

    def missing(self) -> list[tuple[int, int]]:
        """``(offset, end)`` of the items it has no embeddings for, in prompt order."""
        return [(off, off + n) for off, n, emb in self.mm if emb is None]


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
        self.window = self._window()
        # what the batch can read of the window layers' own pool at once (0: they have none)
        self.window_cap = (
            0
            if self.window is None
            else window_blocks_needed(
                config.max_num_seqs, config.max_num_batched_tokens, self.window, config.block_size
            )
        )
        self.num_blocks = config.num_kv_blocks or self._derive_num_blocks()
        self.num_window_blocks = min(self.num_blocks, self.window_cap)  # and a null block besides
        bs = config.block_size
        # one cache per KV-writing layer (Gemma 4: shared layers own none, full layers are wider);
        # a sliding-window layer's holds the window group's blocks only
        self.kv_caches = [
            torch.zeros(
                (2, self.num_blocks if w is None else self.num_window_blocks + 1, bs, h, d),
                dtype=self.dtype,
                device=self.device,
            )
            for (h, d), w in zip(self.text_config.kv_layer_specs(), self._layer_windows(), strict=True)
        ]
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

    def _layer_windows(self) -> list[int | None]:
        """Per KV cache: its layers' window when the window layers keep their own blocks, else None."""
        windows = self.text_config.kv_layer_windows()
        return windows if self.window is not None else [None] * len(windows)

    def _window(self) -> int | None:
        """The sliding window whose layers get their own block group: models with one window size and
        full layers beside (a model of window layers only, or of several sizes, keeps one group)."""
        windows = self.text_config.kv_layer_windows()
        sizes = {w for w in windows if w is not None}
        if len(sizes) != 1 or None not in windows or not self.config.sliding_window_blocks:
            return None
        return sizes.pop()

    def _bytes_per_block(self, windowed: bool | None) -> int:
        """One block's K and V over the layers that write KV (``windowed``: only the window layers'
        caches, or only the others'; None: all of them: what a block of tokens costs unwindowed)."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_token = sum(
            h * d
            for (h, d), w in zip(
                self.text_config.kv_layer_specs(), self.text_config.kv_layer_windows(), strict=True
            )
            if windowed is None or (w is not None) == windowed
        )
        return 2 * self.config.block_size * per_token * elem

    @property
    def block_bytes(self) -> int:
        """One block's K and V over every layer that writes KV (what a block of tokens costs)."""
        return self._bytes_per_block(None)

    def _blocks_for(self, budget: int, want: int | None) -> int:
        """Full-group blocks that ``budget`` bytes hold (at most ``want``), after the window group's
        blocks (as many as the batch can hold at once, ``window_blocks_needed``) where there is one."""
        if self.window is None:
            n = budget // self.block_bytes
            return n if want is None else min(want, n)
        both = budget // self.block_bytes  # every layer's block: no fewer full blocks than this
        n_window = min(self.window_cap, both if want is None else min(want, both))
        n = (budget - (n_window + 1) * self._bytes_per_block(True)) // self._bytes_per_block(False)
        return max(0, n if want is None else min(want, n))

    def _derive_num_blocks(self) -> int:
        c = self.config
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * c.kv_cache_memory_fraction) - (total - free)
            n = self._blocks_for(budget, None)
            if n <= 0:
                raise RuntimeError(f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free)")
        else:
            want = c.max_num_seqs * cdiv(min(c.max_model_len, 2048), c.block_size)
            n = max(1, self._blocks_for(CPU_KV_CACHE_CAP_BYTES, want))
        if self.window is None:
            mib = n * self.block_bytes / 2**20
        else:
            n_window = min(n, self.window_cap) + 1
            mib = (n * self._bytes_per_block(False) + n_window * self._bytes_per_block(True)) / 2**20
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", n, c.block_size, mib)
        return int(n)

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

    def _positions(self, req: Request, start: int, end: int) -> torch.Tensor:
        if not self.model.uses_mrope:
            return torch.arange(start, end, device=self.device)
        state, n = self.states[req.request_id], req.num_prompt_tokens
        assert state.mrope is not None, f"request {req.request_id} has no M-RoPE positions"
        parts = []
        if start < n:
            parts.append(state.mrope[:, start : min(end, n)])
        if end > n:
            parts.append(torch.arange(max(start, n), end, device=self.device).expand(3, -1) + state.delta)
        return torch.cat(parts, dim=1)

    def _positions_all(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Every chunk's positions, in batch order; decode runs built from ints, not per-chunk tensors."""
        if not self.model.uses_mrope:
            flat = [p for c in chunks for p in range(c.start, c.start + c.num_tokens)]
            return torch.tensor(flat, dtype=torch.long, device=self.device)
        parts: list[torch.Tensor | list[int]] = []
        for c in chunks:
            req, start, end = c.request, c.start, c.start + c.num_tokens
            if start < req.num_prompt_tokens:
                parts.append(self._positions(req, start, end))
                continue
            # past the prompt: text positions, shifted; all 3 axes alike
            delta = self.states[req.request_id].delta
            if not parts or not isinstance(parts[-1], list):
                parts.append([])
            parts[-1].extend(range(start + delta, end + delta))  # type: ignore[union-attr]
        tensors = [
            p
            if isinstance(p, torch.Tensor)
            else torch.tensor(p, dtype=torch.long, device=self.device).expand(3, -1)
            for p in parts
        ]
        return torch.cat(tensors, dim=-1)

    def _ids_all(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        ids = [t for c in chunks for t in _token_ids(c.request, c.start, c.start + c.num_tokens)]
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _embeds_all(self, chunks: list[ScheduledChunk], ids: torch.Tensor) -> torch.Tensor:
        """Every chunk's input rows, in batch order: one embedding lookup for the whole batch (``ids``),
        then each chunk's slices of its media items' embeddings written over their placeholder rows."""
        emb = self.model.embed_tokens(ids)
        width = getattr(self.model, "mm_row_width", emb.shape[1])
        if width > emb.shape[1]:  # DeepStack (Qwen3-VL): an item's levels ride after its main columns
            emb = torch.cat([emb, emb.new_zeros(emb.shape[0], width - emb.shape[1])], dim=1)
        row = 0
        for c in chunks:
            start, end = c.start, c.start + c.num_tokens
            for offset, length, embeds in self.states[c.request.request_id].mm:
                lo, hi = max(start, offset), min(end, offset + length)
                if lo >= hi:  # a chunk may hold only a slice of the item, or none of it
                    continue
                if embeds is None:  # the scheduler parks such a request: never here
                    raise RequestFaults({c.request.request_id: f"no embeddings for the item at {offset}"})
                emb[row + lo - start : row + hi - start] = embeds[lo - offset : hi - offset]
            row += c.num_tokens
        return emb

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, tuple[int, TokenLogprob | None]]:
        """Compute the scheduled chunks; return ``{request_id: (token, logprob)}`` for those that sample."""
        chunks = out.chunks
        if not chunks:
            return {}
        ids = self._ids_all(chunks)
        embeds = self._embeds_all(chunks, ids)
        positions = self._positions_all(chunks)
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
            meta.states = self.linear_states.step([_step_seq(c) for c in chunks])
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
        state = self.states.get(request_id)
        if state is None or state.generator is None:
            return None
        return bytes(state.generator.get_state().numpy().tobytes())

    def resume_generator(self, request_id: str, raw: bytes) -> None:
        """Continue a seeded request's draws from where a prefill replica's generator left them
        (``generator_state``). Raises ``ValueError`` for a request without a seed, or a state this
        device's generator cannot take (a CPU and a CUDA generator's differ in size)."""
        generator = self.states[request_id].generator
        if generator is None:
            raise ValueError(f"{request_id}: a generator state for a request without a seed")
        size = generator.get_state().numel()
        if len(raw) != size:
            raise ValueError(
                f"{request_id}: a generator state of {len(raw)} bytes, this replica's "
                f"{self.device.type} generator's takes {size}"
            )
        try:
            generator.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        except RuntimeError as e:  # torch checks the state's contents too
            raise ValueError(f"{request_id}: a malformed generator state: {e}") from e

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


def _step_seq(c: ScheduledChunk) -> StepSeq:
    """A chunk's state slots: it reads its own (or the snapshot it restores) and writes its own."""
    st = c.request.state
    assert st is not None, f"request {c.request.request_id} runs without a state slot"
    read = st.slot if st.restore_from is None else st.restore_from
    captures = [(pos - c.start, slot) for pos, slot in st.captures]
    return StepSeq(c.num_tokens, read, st.slot, c.start == 0, captures)


def _token_ids(req: Request, start: int, end: int) -> list[int]:
    """``req.all_token_ids[start:end]`` without building the whole list (a decode reads one id)."""
    n = len(req.prompt_token_ids)
    if start >= n:
        return req.output_token_ids[start - n : end - n]
    if end <= n:
        return req.prompt_token_ids[start:end]
    return req.prompt_token_ids[start:] + req.output_token_ids[: end - n]

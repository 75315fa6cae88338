"""What the model runner keeps per request (``RunnerState``: its media embeddings on the device, M-RoPE
positions, seeded generator, grammar matcher), and a seeded generator's state out of one replica and
into another (E/P/D: the decode side resumes the prefill side's draws)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llm_service.structured.grammars import GrammarState


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


def generator_bytes(state: RunnerState | None) -> bytes | None:
    """A seeded request's generator state as bytes; None for an unseeded one (or no state)."""
    if state is None or state.generator is None:
        return None
    return bytes(state.generator.get_state().numpy().tobytes())


def resume_generator(request_id: str, generator: torch.Generator | None, raw: bytes) -> None:
    """Set ``generator`` to a state ``generator_bytes`` gave. Raises ``ValueError`` for a request
    without a seed, or a state this device's generator cannot take (a CPU and a CUDA generator's
    differ in size)."""
    if generator is None:
        raise ValueError(f"{request_id}: a generator state for a request without a seed")
    size = generator.get_state().numel()
    if len(raw) != size:
        raise ValueError(
            f"{request_id}: a generator state of {len(raw)} bytes, this replica's "
            f"{generator.device.type} generator's takes {size}"
        )
    try:
        generator.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    except RuntimeError as e:  # torch checks the state's contents too
        raise ValueError(f"{request_id}: a malformed generator state: {e}") from e

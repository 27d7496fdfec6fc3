"""Slots: several clients' prompt caches in one llama.cpp context (llama-server's --parallel).

The context is split into ``count`` slots of ``n_ctx // count`` tokens each. Replies are still
computed one at a time, in the engine's turn; what a slot adds is that its cached prompt (its
KV cells and recurrent state) survives another client's replies, so two apps taking turns both
reuse their prefixes. The context holds the active slot; the others are parked in memory as
llama.cpp's per-sequence state (KV cells and recurrent state only, no logits), which the context
fit counts (budget.working_estimate).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kimitui.engine.llama_glue import clear_context, restore_sequence, sequence_state
from kimitui.engine.state import EngineError, EngineState, Lifecycle


# llama-server's --slot-prompt-similarity default: a cached prompt sharing less of a new prompt
# than this is not worth its slot (a shared chat template's opening is not a conversation).
SIMILARITY = 0.1


@dataclass
class Slot:
    id: int
    tokens: list[int] = field(default_factory=list)  # its cached prompt, while parked
    state: bytearray = field(default_factory=bytearray)  # llama.cpp's state of sequence 0 for them, while parked
    used_at: float = 0.0


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Slots:
    def __init__(self, count: int, lifecycle: Lifecycle) -> None:
        if count < 1:
            raise ValueError("at least one slot")
        self.slots = [Slot(i) for i in range(count)]
        self.active = 0
        self.lifecycle = lifecycle  # a swap touches llama.cpp's context: only inside a reply

    @property
    def count(self) -> int:
        return len(self.slots)

    def cached(self, llm, slot: Slot) -> list[int]:
        return llm.input_ids[: llm.n_tokens].tolist() if slot.id == self.active else slot.tokens

    def choose(self, llm, prompt: list[int], asked: int | None) -> int:
        """The slot a reply runs in, as llama-server picks it: the one asked for; else the one
        whose cached prompt shares the longest prefix with ``prompt``, if that prefix is more
        than SIMILARITY of the prompt; else the least recently used (an unused one first)."""
        if asked is not None:
            if not 0 <= asked < self.count:
                raise EngineError(f"id_slot: {asked} is not a slot (there are {self.count}: 0 to {self.count - 1})")
            return asked
        if self.count == 1:
            return 0  # nothing to choose: no prefix compared on every reply
        best, best_share = None, SIMILARITY
        for slot in self.slots:
            share = common_prefix(self.cached(llm, slot), prompt) / max(1, len(prompt))
            if share > best_share:
                best, best_share = slot, share
        # The least recently used; among equals the last, as llama-server picks.
        return (best or min(reversed(self.slots), key=lambda s: s.used_at)).id

    def activate(self, llm, slot_id: int) -> None:
        """Put ``slot_id``'s cached prompt in the context, parking the active slot's. Called in
        the engine's turn, as a reply begins (before its prompt is evaluated)."""
        self.lifecycle.require(EngineState.GENERATING)
        self.slots[slot_id].used_at = time.monotonic()
        if slot_id == self.active:
            return
        current = self.slots[self.active]
        current.tokens = llm.input_ids[: llm.n_tokens].tolist()
        current.state = sequence_state(llm)
        if not current.state:
            current.tokens = []  # llama.cpp could not copy it: the slot starts afresh next time
        # Cleared whole (only sequence 0 is used), so the next tokens fill the cells from the
        # first, as on a fresh context.
        wanted = self.slots[slot_id]
        restore_sequence(llm, wanted.tokens, wanted.state)
        wanted.tokens, wanted.state = [], bytearray()
        self.active = slot_id

    # -- saved slots (llama-server's POST /slots/{id}?action=save|restore|erase) ----------

    def save(self, llm, slot_id: int, store, name: str) -> tuple[int, int]:
        """Write ``slot_id``'s cached prompt and its state to ``store`` as ``name`` (the file
        format of saved conversations). Returns (tokens, bytes written)."""
        self.lifecycle.require(EngineState.GENERATING)
        slot = self._slot(slot_id)
        if slot.id == self.active:
            tokens, state = llm.input_ids[: llm.n_tokens].tolist(), sequence_state(llm)
        else:
            tokens, state = slot.tokens, slot.state
        if not tokens or not state:
            raise EngineError(f"id_slot: slot {slot_id} holds no prompt to save")
        return len(tokens), store.save(name, tokens, state)

    def restore(self, llm, slot_id: int, store, name: str) -> tuple[int, int]:
        """Put the saved ``name`` (checked whole: StateRefused says why not) in ``slot_id``.
        Returns (tokens, bytes read)."""
        self.lifecycle.require(EngineState.GENERATING)
        self._slot(slot_id)
        saved = store.load(name)
        if saved is None:
            raise FileNotFoundError(store.path(name))
        # Into the context, so llama.cpp checks it now (a parked slot's bytes are taken on trust).
        self.activate(llm, slot_id)
        if not restore_sequence(llm, saved.tokens, saved.state):
            raise EngineError(f"{store.path(name)}: llama.cpp could not restore it (the slot is empty now)")
        return len(saved.tokens), store.path(name).stat().st_size

    def erase(self, llm, slot_id: int) -> int:
        """Empty ``slot_id``'s cached prompt. Returns the tokens it held."""
        self.lifecycle.require(EngineState.GENERATING)
        slot = self._slot(slot_id)
        if slot.id == self.active:
            held = llm.n_tokens
            clear_context(llm)
        else:
            held = len(slot.tokens)
            slot.tokens, slot.state = [], bytearray()
        return held

    def _slot(self, slot_id: int) -> Slot:
        if not 0 <= slot_id < self.count:
            raise EngineError(f"id_slot: {slot_id} is not a slot (there are {self.count}: 0 to {self.count - 1})")
        return self.slots[slot_id]

    def forget(self) -> None:
        """Drop every parked prompt (the model is closed: its states mean nothing to another)."""
        for slot in self.slots:
            slot.tokens, slot.state = [], bytearray()
        self.active = 0

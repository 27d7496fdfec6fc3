"""What a user interface asks of an engine: the in-process one (session.Engine) and the one
across HTTP (server.client.RemoteEngine) both implement it, and the app takes either. What the
HTTP server asks of the engine it serves (ServingEngine): session.Engine implements it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Sequence

from kimitui.engine.metrics import EngineMetrics
from kimitui.engine.pinning import PinProgress
from kimitui.engine.state import EngineState, Lifecycle

if TYPE_CHECKING:  # the server's types, not loaded for the UI
    from kimitui.engine.generation import Generation, Sampling
    from kimitui.engine.slots import Slots
    from kimitui.engine.turns import TurnQueue
    from kimitui.model.gguf_file import ModelInfo


@dataclass(frozen=True)
class PinOutcome:
    pinned_bytes: int  # 0: nothing pinned here (a remote engine, or the stock load)
    note: str | None  # why the pinned set is not what was asked for (not locked, kept mapped), when it is not
    whole_model: bool  # the model fits: nothing streams


@dataclass(frozen=True)
class TuningValues:
    """The live-tunable settings of a streaming engine, as they are now."""

    budget: int
    prefetch_depth: int
    shard_size: int
    policy: str
    expert_policy: str
    io_threads: int
    expert_lookahead: bool
    expert_trim_below: float  # expert trimming (lossy): 0 = off
    expert_trim_cumulative: float  # 1 = off


class Reply(Protocol):
    """One generation: iterate for its TokenEvents; ``result`` once it ends."""

    result: object

    def __iter__(self) -> Iterator: ...
    def cancel(self) -> None: ...


class ChatEngine(Protocol):
    metrics: EngineMetrics
    load_s: float | None  # how long the load took, once it has
    lifecycle: Lifecycle  # its state: a reply is asked for only where ``lifecycle.refusal()`` is None

    def label(self) -> tuple[str, int | None]:
        """(model name, file bytes): what the status bar names; a remote one knows it once loaded."""

    def load(self, on_progress: Callable[[float], None] | None = None) -> None:
        """Block until the model answers; EngineError says why not."""

    def notices(self) -> list[str]:
        """What the user should know once loaded (fast start unavailable, context shrunk, ...)."""

    def pin(self, on_progress: Callable[[PinProgress], None] | None = None) -> PinOutcome: ...

    def chat(self, messages: list[dict], sampling, keep: str | None = None) -> Reply:
        """A reply to ``messages``; ``keep`` names the conversation whose state the engine may
        keep on disk between replies and restarts (ignored where it keeps none)."""

    def resumes(self, key: str) -> bool:
        """Whether the conversation ``key`` would resume from a saved state, its tokens not evaluated."""

    def forget_state(self, key: str) -> None:
        """The conversation ``key`` was deleted: what the engine kept of it goes."""

    def abort_load(self) -> None: ...

    def tuning(self) -> TuningValues | None:
        """The values live tuning starts from; None where this engine is not tuned from here."""

    def lossy_setting(self) -> str | None:
        """A setting on that changes what the model computes (expert trimming: "trim <5%"), for
        the status bar; None where nothing does, or where it is the server's to say."""

    def retune(self, **changes) -> str:
        """Apply ``changes`` (fields of TuningValues); a line saying when they take effect.
        EngineError for a value that cannot be taken, with nothing changed."""


class LoadedModel(Protocol):
    """What the server reads of the loaded llama.cpp model: its vocabulary's size, and the
    tokens the active slot holds in the context."""

    n_tokens: int

    def n_vocab(self) -> int: ...


class ServingEngine(Protocol):
    """What the HTTP server (server/) asks of the engine it serves: prompts of its own, decoded
    in slots and in turn, beside what it reports (state, queue, template, vocabulary)."""

    model_path: Path
    n_ctx: int  # the whole context, every slot's share together
    slot_ctx: int  # the tokens one reply may fill, prompt included
    context_words: str  # how the context is split, as a refusal of a long prompt says it
    template_text: str  # the chat template in use
    end_of_generation: tuple[int, ...]  # the tokens ignore_eos bans
    lifecycle: Lifecycle
    state: EngineState
    load_error: str | None
    load_progress: float
    metrics: EngineMetrics
    turns: TurnQueue
    slots: Slots
    llm: LoadedModel

    def inspect(self) -> ModelInfo: ...
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]: ...
    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str: ...
    def token_bytes(self, token: int) -> bytes: ...

    def grammar_error(self, grammar: str) -> str | None:
        """Why llama.cpp would refuse this GBNF grammar, or None."""

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None):
        """``messages`` through the chat template: ``.prompt`` is the text. ChatTemplateError says why not."""

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], tuple[str, ...]]:
        """The rendered prompt's token ids and the template's stop strings."""

    def complete(self, prompt: str | list[int], sampling: Sampling, slot: int | None = None, progress: bool = False) -> Generation:
        """A reply to ``prompt`` in ``slot`` (None: the best fit); ``progress``: PromptProgress events first."""

    def slot_file(self, action: str, slot_id: int, directory: Path, name: str = "") -> tuple[int, int]:
        """llama-server's slot actions (save, restore, erase) in the engine's turn: (tokens, bytes)."""

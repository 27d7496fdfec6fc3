"""What the engine needs of llama-cpp-python and ggml beyond their public calls: load
parameters (repacking, callbacks), the log, chat-template compiles, decode timing, graph-node
names and tensors read in the eval callback, and stderr captured around grammar parses."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import psutil

from kimitui.errors import UserError
from kimitui.engine.state import EngineError


# Used when a GGUF carries no chat template (base models): plain ChatML.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


_params_lock = threading.Lock()


class DecodeClock:
    """Seconds spent inside llama_decode: compute, plus what the eval callback waited for
    reads (stall). A token's wall time beyond it is sampling, detokenizing and Python."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.tokens = 0  # tokens decoded: a prompt's share tells how much of it came from the cache

    def attach(self, ctx) -> None:
        """Time every decode of ``ctx`` (llama-cpp-python's LlamaContext)."""
        decode = ctx.decode

        def timed(batch):
            started = time.perf_counter()
            try:
                return decode(batch)
            finally:
                self.seconds += time.perf_counter() - started
                self.tokens += batch.batch.n_tokens

        ctx.decode = timed


class CancelFlag:
    """A flag llama.cpp reads between graph nodes, so that a cancel stops a prompt's evaluation
    within a layer, at no cost per node: the abort callback is libc's own ``strlen`` over two
    bytes, [flag, 0], which returns 1 (abort) once the flag is set and 0 before (a bool return
    is the result register's low byte on x86-64 and arm64). A Python callback there would cost
    a call per node, every token. Set from any thread."""

    def __init__(self) -> None:
        import llama_cpp.llama_cpp as C

        self._bytes = ctypes.create_string_buffer(2)
        strlen = ctypes.cast(ctypes.CDLL(None).strlen, ctypes.c_void_p).value
        self.callback = C.ggml_abort_callback(strlen)
        self.address = ctypes.addressof(self._bytes)

    def set(self) -> None:
        self._bytes[0] = 1

    def clear(self) -> None:
        self._bytes[0] = 0

    @property
    def is_set(self) -> bool:
        return self._bytes[0] != b"\x00"

    def attach(self, ctx) -> None:
        """Make this flag ``ctx``'s abort callback (a streaming context has its own, which asks it)."""
        import llama_cpp

        llama_cpp.llama_set_abort_callback(ctx.ctx, self.callback, self.address)


def ggml_base(llama_library: str):
    """libggml-base next to libllama: ggml_get_name() reads a graph node's name."""
    import glob
    import os

    candidates = sorted(glob.glob(os.path.join(os.path.dirname(llama_library), "libggml-base.*")))
    if not candidates:
        raise EngineError("cannot find libggml-base next to libllama (llama-cpp-python changed?)")
    lib = ctypes.CDLL(candidates[0])
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_get_name.argtypes = (ctypes.c_void_p,)
    lib.ggml_get_data.restype = ctypes.c_void_p
    lib.ggml_get_data.argtypes = (ctypes.c_void_p,)
    return lib


# The node that holds the token embeddings, computed before layer 0: most graphs name it
# "embd" (build_inp_embd); kimi-k3 renames that same node "inp_embd".
LAYER_ZERO_NODES = (b"embd", b"inp_embd")


WATCHED_NODES = (b"l_out-", b"ffn_moe_topk-")  # each followed by its layer number (their one "-")


def numbered(name: bytes, prefix: bytes) -> int | None:
    """N for a graph node named exactly ``prefix`` + N ("l_out-12"), else None."""
    if not name.startswith(prefix):
        return None
    tail = name[len(prefix):]
    return int(tail) if tail.isdigit() else None


# ggml_tensor's int64 ne[4] and size_t nb[4] sit right after its type and buffer fields, a
# layout ggml has kept for years; data pointers come through ggml's own accessor.
GGML_NE_OFFSET, GGML_NB_OFFSET = 16, 48


def token_columns(tensor: int) -> int:
    """ne[1] of a node shaped [width, n_tokens] (the embeddings): the tokens its graph computes."""
    return ctypes.c_int64.from_address(tensor + GGML_NE_OFFSET + 8).value


def topk_ids(ggml, tensor: int) -> set[int]:
    """Expert ids in a router's top-k node: int32, ne = [k, n_tokens], rows nb[1] apart."""
    k, n_tokens = (ctypes.c_int64 * 2).from_address(tensor + GGML_NE_OFFSET)
    row_stride = (ctypes.c_size_t * 2).from_address(tensor + GGML_NB_OFFSET)[1]
    data = ggml.ggml_get_data(tensor)
    ids: set[int] = set()
    for token in range(n_tokens):
        ids.update((ctypes.c_int32 * k).from_address(data + token * row_stride))
    return ids


def last_row_f32(ggml, tensor: int):
    """The one token's row of a float32 activation [n_embd, 1] (decode); None otherwise.

    ggml_tensor starts with its type (0 = GGML_TYPE_F32), then ne at +16 as for the top-k."""
    import numpy as np

    if ctypes.c_int.from_address(tensor).value != 0:
        return None
    n_embd, n_tokens = (ctypes.c_int64 * 2).from_address(tensor + GGML_NE_OFFSET)
    if n_tokens != 1:  # prefill reads its experts per batch anyway
        return None
    return np.ctypeslib.as_array((ctypes.c_float * n_embd).from_address(ggml.ggml_get_data(tensor))).copy()


def default_threads() -> int:
    return max(1, psutil.cpu_count(logical=False) or psutil.cpu_count() or 1)


@contextmanager
def llama_params(progress: Callable[[float], bool] | None, repack: bool, eval_cb=None, abort_cb=None, rs_snapshots: int = 0):
    """Give Llama() a progress callback and the repack switch, which its constructor lacks.

    llama-cpp-python builds its llama_model_params from ``llama_model_default_params()``
    inside ``Llama.__init__`` and exposes neither field, so the default is wrapped for the
    duration of one constructor call. The ctypes callback object lives until the load ends.
    """
    import llama_cpp.llama_cpp as C

    original = C.llama_model_default_params
    original_ctx = C.llama_context_default_params
    c_progress = None
    if progress is not None:
        c_progress = C.llama_progress_callback(lambda value, _user: bool(progress(float(value))))

    def patched():
        params = original()
        if c_progress is not None:
            params.progress_callback = c_progress
        params.use_extra_bufts = repack
        return params

    def patched_ctx():
        params = original_ctx()
        if eval_cb is not None:
            params.cb_eval = eval_cb
        if abort_cb is not None:
            params.abort_callback = abort_cb
        params.n_rs_seq = rs_snapshots  # recurrent-state snapshots for taking drafts back (speculation.py)
        return params

    with _params_lock:
        C.llama_model_default_params = patched
        C.llama_context_default_params = patched_ctx
        try:
            yield
        finally:
            C.llama_model_default_params = original
            C.llama_context_default_params = original_ctx


@contextlib.contextmanager
def templates_checked_later():
    """llama-cpp-python compiles the model's chat templates inside ``Llama()``, for chat handlers
    kimitui never uses, and a template that does not compile fails the whole load. Meanwhile its
    formatter keeps a template that fails to compile as a handler that is never called; the
    engine compiles the template itself afterwards and says why chat cannot work (see
    ``Engine._make_formatter``), while plain completions go on."""
    import llama_cpp.llama_chat_format as chat_format

    original = chat_format.Jinja2ChatFormatter

    class Tolerant(original):
        def __init__(self, *args, **kwargs):
            try:
                super().__init__(*args, **kwargs)
            except Exception:  # noqa: BLE001 - reported by the engine's own compile
                self._env = None

    chat_format.Jinja2ChatFormatter = Tolerant
    try:
        yield
    finally:
        chat_format.Jinja2ChatFormatter = original


_log_sink = None


def silence_llama_log(llama_cpp) -> None:
    """Send llama.cpp's log lines nowhere, without a Python call per line, and leave the
    process's output descriptors where they are.

    llama-cpp-python installs a Python log callback; a load logs thousands of lines, each one a
    wait for the GIL while the UI starts beside it. libc's getpid stands in as the callback: it
    takes no arguments, so under the C calling conventions of x86-64 and arm64 (arguments in
    registers, cleaned up by the caller) it ignores the level, text and user pointer it is given.
    """
    global _log_sink
    if _log_sink is None:
        _log_sink = ctypes.cast(ctypes.CDLL(None).getpid, llama_cpp.llama_log_callback)
    llama_cpp.llama_log_set(_log_sink, None)
    # With its log silenced, llama-cpp-python's ``verbose=False`` has nothing left to hide, yet it
    # still points the process's stdout and stderr (descriptors 1 and 2, and sys.stdout/stderr)
    # at /dev/null for the whole load: a terminal UI drawing beside a load in a worker thread, or
    # a line the main thread prints meanwhile, would be lost.
    from llama_cpp import _internals, llama as llama_module

    _internals.suppress_stdout_stderr = llama_module.suppress_stdout_stderr = _DescriptorsKept


class _DescriptorsKept:
    """Takes the place of llama-cpp-python's ``suppress_stdout_stderr``: redirects nothing."""

    def __init__(self, disable: bool = True) -> None:
        pass

    def __enter__(self) -> "_DescriptorsKept":
        return self

    def __exit__(self, *_) -> None:
        return None


class LlamaLog:
    """llama.cpp's warnings and errors, the last few kept: a failure's reason is often only there.

    Installed after a load (llama.cpp logs nothing while it decodes, so this costs nothing),
    and for the second try of a load that failed (see ``Engine._load``); the load itself logs
    through ``silence_llama_log``."""

    WARN, ERROR, CONT = 3, 4, 5  # ggml_log_level

    def __init__(self) -> None:
        import llama_cpp

        self.lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=32)  # (level, text)
        self._keeping = False
        self._callback = llama_cpp.llama_log_callback(self._line)

    def _line(self, level: int, text: bytes, _user) -> None:
        line = (text or b"").decode("utf-8", "replace")
        if level == self.CONT and self._keeping and self.lines:
            kept_level, kept = self.lines[-1]
            self.lines[-1] = (kept_level, kept + line.rstrip("\n"))
            return
        self._keeping = level in (self.WARN, self.ERROR)
        if self._keeping:
            self.lines.append((level, line.strip()))

    def install(self) -> None:
        import llama_cpp

        llama_cpp.llama_log_set(self._callback, None)

    def reason(self) -> str | None:
        """The first error line (the cause; later ones are what failed because of it), else the
        last warning, without llama.cpp's function-name prefix."""
        errors = [text for level, text in self.lines if level == self.ERROR and text]
        line = errors[0] if errors else (self.lines[-1][1] if self.lines else None)
        return line.split(": ", 1)[-1] if line and ": " in line else line


_llama_log: LlamaLog | None = None


def llama_log() -> LlamaLog:
    global _llama_log
    if _llama_log is None:
        _llama_log = LlamaLog()
    return _llama_log


_stderr_lock = threading.Lock()


class _Caught:
    text = ""  # what was written, once the block is over


@contextlib.contextmanager
def stderr_caught():
    """What C code writes to file descriptor 2 meanwhile, caught in a temporary file."""
    import tempfile

    caught = _Caught()
    with _stderr_lock, tempfile.TemporaryFile() as file:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(file.fileno(), 2)
        try:
            yield caught
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            file.seek(0)
            caught.text = file.read().decode("utf-8", errors="replace")


def chat_formatter():
    """llama-cpp-python's Jinja formatter with a sandbox whose lists may grow: Kimi K2's template
    builds its tool-call list with ``.append``, which the immutable sandbox refuses. Attribute
    access stays sandboxed."""
    import jinja2
    from jinja2.sandbox import SandboxedEnvironment
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    class ChatFormatter(Jinja2ChatFormatter):
        def __init__(self, template: str, **kwargs) -> None:
            super().__init__(template, **kwargs)
            environment = SandboxedEnvironment(
                loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                extensions=[Jinja2ChatFormatter.IgnoreGenerationTags, jinja2.ext.loopcontrols],
            )
            environment.filters["tojson"] = self.tojson
            self._environment = environment.from_string(template)

    return ChatFormatter


def clear_context(llm) -> None:
    """Empty the context whole: llama-cpp-python's reset() clears llama.cpp's memory only for
    recurrent models; an attention cache keeps its cells, and its head where it was, until they
    are overwritten, and a different cell layout can change a greedy token."""
    import llama_cpp

    llm.reset()
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)


def keeps_recurrent_state(model) -> bool:
    """Before the load, from the GGUF's keys (a ModelMap): the model keeps a recurrent state
    (Mamba's and the hybrids' ``ssm.*``, RWKV's ``wkv.*``, LFM2's ``shortconv.*``, Kimi K3's KDA),
    as ``is_recurrent`` says once it is loaded."""
    from kimitui.engine.budget import state_copy_bytes

    return state_copy_bytes(model) > 0 or any(
        key.split(".", 1)[1].startswith(("ssm.", "wkv.", "shortconv.")) for key in model.hparams
    )


def is_recurrent(llm) -> bool:
    """The model keeps a recurrent state (Kimi K3's KDA): the context cannot be taken back a
    few tokens, only cleared."""
    import llama_cpp

    model = llm._model.model
    return bool(llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model))


def keep_counted(llm) -> None:
    """After an evaluation stopped part-way (a cancel): keep what llama-cpp-python counts as
    evaluated, so the next reply reuses that prefix, and drop the cells of the micro-batches it
    does not count. A recurrent state (Kimi K3's KDA) cannot be taken back a few tokens: there
    the context is cleared whole."""
    if is_recurrent(llm) or not llm._ctx.kv_cache_seq_rm(-1, llm.n_tokens, -1):
        clear_context(llm)


def sequence_state(llm) -> bytearray:
    """llama.cpp's state of sequence 0 (KV cells and recurrent state, no logits) for the
    tokens the context holds, written by llama.cpp straight into the bytes returned (one copy);
    empty when the context holds nothing or llama.cpp could not copy it."""
    import ctypes

    import llama_cpp

    if not llm.n_tokens:
        return bytearray()
    ctx = llm._ctx.ctx
    size = llama_cpp.llama_state_seq_get_size(ctx, 0)
    state = bytearray(size)
    view = (ctypes.c_uint8 * size).from_buffer(state)
    written = llama_cpp.llama_state_seq_get_data(ctx, view, size, 0)
    del view
    del state[written:]
    return state


def restore_sequence(llm, tokens: list[int], state: bytearray) -> bool:
    """Put ``state`` (from sequence_state, for ``tokens``) in an emptied context; False, with
    the context empty, when llama.cpp refuses it. The logits are not part of it: the next
    evaluation re-evaluates at least the prompt's last token (llama-cpp-python's generate
    does so when told ``_requires_eval``)."""
    import ctypes

    import llama_cpp

    clear_context(llm)
    if not tokens or not state:
        return False
    view = (ctypes.c_uint8 * len(state)).from_buffer(state)
    restored = llama_cpp.llama_state_seq_set_data(llm._ctx.ctx, view, len(state), 0)
    del view
    if not restored:
        clear_context(llm)
        return False
    llm.input_ids[: len(tokens)] = tokens
    llm.n_tokens = len(tokens)
    llm._requires_eval = True
    return True


def builtin_chat_templates() -> tuple[str, ...]:
    """The names of llama.cpp's built-in chat templates (llama3, chatml, command-r, ...)."""
    import llama_cpp

    count = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * count)()
    llama_cpp.llama_chat_builtin_templates(names, count)
    return tuple(name.decode() for name in names)


class BuiltinChatFormatter:
    """A built-in chat template, rendered by llama.cpp itself (``llama_chat_apply_template``, its
    non-Jinja path). Such a template knows roles and text only: tools and tool calls are refused,
    never dropped."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *, messages: list[dict], tools: list[dict] | None = None):
        import llama_cpp
        from llama_cpp.llama_chat_format import ChatFormatterResponse

        if tools:
            raise ValueError(f"the built-in template {self.name} renders no tools")
        if any(m.get("tool_calls") for m in messages):
            raise ValueError(f"the built-in template {self.name} renders no tool calls")
        texts = [(m["role"].encode(), (m.get("content") or "").encode()) for m in messages]
        chat = (llama_cpp.llama_chat_message * len(texts))(*(llama_cpp.llama_chat_message(r, c) for r, c in texts))
        size = 2 * sum(len(c) + len(r) for r, c in texts) + 256
        for _ in range(2):  # the first call says how long the prompt is when the buffer is short
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_chat_apply_template(self.name.encode(), chat, len(texts), True, buf, size)
            if n < 0:
                raise ValueError(f"llama.cpp's built-in template {self.name} cannot render these messages")
            if n <= size:
                return ChatFormatterResponse(prompt=buf.raw[:n].decode("utf-8", errors="replace"), added_special=False)
            size = n
        raise ValueError(f"llama.cpp's built-in template {self.name} gave no prompt")


def chat_template_file(path: str) -> str | None:
    if not path:
        return None
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"model.chat_template_file: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None

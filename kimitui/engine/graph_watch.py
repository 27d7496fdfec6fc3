"""llama.cpp's callbacks per graph node for a streamed model: the eval callback, which feeds
the streamer (layer starts, routing, staged expert matrices) and points weights out of the
bounded layout's phantom mappings, and the abort callback, which stops a token that cannot go
on (a failed read, a cancelled reply).

A C callback must not raise: whatever fails is handed to the streamer, whose error the abort
callback then reports, so the token stops instead of computing on wrong weights.
"""

from __future__ import annotations

import ctypes
from time import perf_counter
from typing import TYPE_CHECKING, Protocol

from kimitui.engine.addressing import SRC_OFFSET
from kimitui.engine.llama_glue import LAYER_ZERO_NODES, WATCHED_NODES, last_row_f32, numbered, token_columns, topk_ids
from kimitui.engine.trimming import routing_views
from kimitui.engine.state import EngineError

if TYPE_CHECKING:
    from kimitui.engine.addressing import WeightPointers
    from kimitui.engine.llama_glue import CancelFlag
    from kimitui.engine.streaming import Streamer


class GraphHost(Protocol):
    """What the callbacks read, each time: a re-pin replaces the streamer."""

    streamer: Streamer | None
    pointers: WeightPointers | None  # while weights still point into phantoms
    cancel_flag: CancelFlag | None
    space: object | None  # addressing's WholeFiles or Windows (``bounded``)


class GraphWatch:
    """The callbacks for one llama.cpp context; ``c_callbacks`` must live as long as it."""

    def __init__(self, host: GraphHost, ggml) -> None:
        self._host = host
        self._ggml = ggml  # ggml's base library (llama_glue.ggml_base)
        self._get_name = ggml.ggml_get_name
        self._staged_nodes: dict[int, bytes] = {}  # graph node -> the staged routed tensor it computes with
        self._routes: dict[int, int] = {}  # layer -> its ffn_moe_topk node, while expert trimming waits for the weights
        self._watched: tuple[bytes, ...] | None = None  # this graph's (``_numbered_nodes``), None until found

    def c_callbacks(self) -> tuple:
        """(eval callback, abort callback), as llama.cpp's context parameters take them."""
        import llama_cpp.llama_cpp as C

        return C.ggml_backend_sched_eval_callback(self.on_eval), C.ggml_abort_callback(self.on_abort)

    def on_eval(self, tensor, ask, _user) -> bool:
        # ggml asks about every graph node, ~17,600 a token at Kimi K3's full size: what the
        # asking costs (pure overhead) and what the observed nodes cost (the streaming work,
        # stalls included) are counted apart (kimitui bench-scale shows both per token). Asking
        # about a staged matrix node reads or waits for its slices: that is streaming work too.
        # Neither path raises: each hands its failures to the streamer.
        started = perf_counter()
        name = self._get_name(tensor) or b""
        if not ask:
            go_on = self._observed(tensor, name)
            streamer = self._host.streamer
            if streamer is not None:
                streamer.eval_observed += 1
                streamer.eval_observe_s += perf_counter() - started
            return go_on
        wanted = self._ask(tensor, name)
        streamer = self._host.streamer
        if streamer is not None:
            streamer.eval_asks += 1
            if wanted and tensor in self._staged_nodes:
                streamer.eval_observe_s += perf_counter() - started
            else:
                streamer.eval_ask_s += perf_counter() - started
        return wanted

    def _ask(self, tensor: int, name: bytes) -> bool:
        """Whether to observe ``tensor`` once computed: the node before each layer (the
        embeddings, then l_out-<i>), each router's top-k, and with router look-ahead each MoE
        layer's FFN input. Only the nodes themselves, never views of them: ggml names a view
        of l_out-5 "l_out-5 (reshaped)" (K3's residual attention makes one at each block
        boundary). Before ggml computes a node, its weights are pointed and, in a staged layer,
        each routed matrix's slices read."""
        host = self._host
        pointers = host.pointers
        if pointers is not None and pointers.active:
            if name in LAYER_ZERO_NODES:
                pointers.graph_started()
            elif name == b"result_output":
                pointers.graph_ended()  # before its own weights: they were pointed in an earlier graph, or count now
            try:
                pointers.point(tensor)
            except EngineError as exc:  # a phantom address outside every tensor: a bug, stopped here
                if host.streamer is not None:
                    host.streamer.fail(str(exc))
        streamer = host.streamer
        if streamer is not None and streamer.staging and self._staged(streamer, tensor, name):
            return True
        # Every node passes here: one builtin test first, the digits only for the few that match.
        if name in LAYER_ZERO_NODES:
            self._staged_nodes.clear()  # a graph cut short left its nodes here
            self._routes.clear()
            self._watched = None  # found at the next node: live tuning applies when layer 0 is observed
            return True
        watched = self._watched
        if watched is None:
            watched = self._watched = self._numbered_nodes(streamer)
        return name.startswith(watched) and name.partition(b"-")[2].isdigit()

    @staticmethod
    def _numbered_nodes(streamer: Streamer | None) -> tuple[bytes, ...]:
        """The prefixes of the numbered nodes a graph observes (each followed by its layer
        number): the layer ends and routers', with expert trimming the routing weights, with
        router look-ahead each MoE layer's FFN input. Each prefix's one "-" is its last
        character, which the layer-number test in ``_ask`` counts on."""
        if streamer is None:
            return WATCHED_NODES
        return (
            WATCHED_NODES
            + ((b"ffn_moe_weights-",) if streamer.trimmer is not None else ())
            + ((b"ffn_norm-",) if streamer.predictor is not None else ())
        )

    def _staged(self, streamer: Streamer, tensor: int, name: bytes) -> bool:
        """A staged layer's routed matrix node: its experts' slices read just before it."""
        try:
            weight = ctypes.c_void_p.from_address(tensor + SRC_OFFSET).value
            weight_name = self._get_name(weight) if weight else None
            if weight_name and streamer.on_expert_matrix(weight_name):
                self._staged_nodes[tensor] = weight_name
                return True
        except Exception as exc:  # noqa: BLE001 - a C callback must not raise: the token stops instead
            streamer.fail(f"streaming failed before graph node {name.decode(errors='replace')}: {type(exc).__name__}: {exc}")
        return False

    def _observed(self, tensor: int, name: bytes) -> bool:
        """A watched node, computed: the streamer told. Always True: False would make ggml skip
        the rest of the graph split (silently wrong logits); a failure stops the token through
        the abort callback instead."""
        streamer = self._host.streamer
        if streamer is None:
            return True
        try:
            if tensor in self._staged_nodes:
                streamer.on_expert_matrix_done(self._staged_nodes.pop(tensor))
            elif (layer := numbered(name, b"ffn_moe_topk-")) is not None:
                if streamer.trimmer is not None:
                    self._routes[layer] = tensor  # trimmed, then read, once its weights are gathered
                else:
                    streamer.on_experts(layer, topk_ids(self._ggml, tensor))
            elif (layer := numbered(name, b"ffn_moe_weights-")) is not None:
                ids_tensor = self._routes.pop(layer, None)
                if ids_tensor is not None:
                    if streamer.trimmer is not None:
                        streamer.trim_routes(layer, *routing_views(self._ggml, ids_tensor, tensor))
                    else:
                        streamer.on_experts(layer, topk_ids(self._ggml, ids_tensor))
            elif (layer := numbered(name, b"ffn_norm-")) is not None:
                hidden = last_row_f32(self._ggml, tensor)
                if hidden is not None:
                    streamer.on_router_input(layer, hidden)
            elif name in LAYER_ZERO_NODES:
                streamer.chunk_tokens = token_columns(tensor)
                streamer.on_layer_start(0)
            else:
                streamer.on_layer_start(numbered(name, b"l_out-") + 1)
        except Exception as exc:  # noqa: BLE001 - a C callback must not raise
            streamer.fail(f"streaming failed at graph node {name.decode(errors='replace')}: {type(exc).__name__}: {exc}")
        return True

    def on_abort(self, _user) -> bool:
        host = self._host
        streamer, flag, space = host.streamer, host.cancel_flag, host.space
        if streamer is None and space is not None and space.bounded:
            return True  # no streamer fills the slots (a pin that failed): nothing computes on them
        return (streamer is not None and streamer.error is not None) or (flag is not None and flag.is_set)

"""`kimitui quality --variant FILE`: what a lossy setting costs, measured before it is used.

One text is fed teacher-forced through the model as it is and through the variant (a
requantized copy, the model with expert trimming, or in the context speculation makes, whose
keys and values are cached as Q8_0; or several of these); at every position both next-token
distributions are compared: the KL divergence of the variant from the model, whether their top
choices agree, and each one's perplexity on the text's actual next tokens. A model against itself
gives KL 0 and 100% agreement; anything lossy shows up as KL above 0.

Expert trimming skips only experts that are not in memory, so what it costs depends on the
budget; here every routed expert counts as a miss, which is the most a rule can cost.

Both run on stock llama-cpp-python (plain mmap, no repacking, as every baseline here), one at a
time, each scoring the whole text in one pass with its logits kept.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from kimitui.engine import kv_cache
from kimitui.errors import UserError

# The built-in text: plain English prose of several registers (narrative, instructions, facts,
# dialogue), written for this check, about 400 tokens for most vocabularies.
BUILT_IN_TEXT = """\
The ferry left the harbour a little after six, when the fog had begun to lift from the water and
the gulls were already quarrelling over the fishing boats. Maria stood at the rail with her coat
buttoned to the chin and watched the town shrink behind her: the church tower, the red roofs of
the warehouses, the long grey wall of the breakwater where her father used to take her on Sunday
afternoons to count the ships.

To make a good cup of tea, first warm the pot with a little hot water and pour it away. Put in one
spoonful of leaves for each person and one for the pot, then add water that has just come to the
boil. Let it stand for three to five minutes, depending on how strong you like it, and stir once
before pouring. Milk, if you take it, can go in before or after; people have argued about the
order for more than a century without settling it.

Water boils at 100 degrees Celsius at sea level, but at lower temperatures higher up, because the
air pressure is lower. On the summit of Mount Everest, at almost 8,849 metres, it boils at about
70 degrees, which is why climbers find it hard to cook pasta or rice properly. A pressure cooker
works the other way round: by raising the pressure inside the pot, it lets the water reach about
120 degrees before it boils, so food cooks faster.

"Are you sure this is the right road?" asked Tom, peering at the map on his knees.
"Quite sure," said his sister. "We turn left after the bridge, then follow the river until we see
the mill. The house is just beyond it, on the hill."
"You said that an hour ago."
"And I was right an hour ago too. We simply haven't reached the bridge yet."

The library opens at nine on weekdays and at ten on Saturdays; it is closed on Sundays and public
holidays. Members may borrow up to eight books at a time for three weeks, and renew them twice by
telephone or online, unless another reader has reserved them.
"""


class _TrimEverything:
    """An eval callback that trims every MoE layer's routing by ``rule`` as if no routed expert
    were in memory (trimming.py does the rewriting, as in the engine)."""

    def __init__(self, rule, architecture: str) -> None:
        import llama_cpp.llama_cpp as C

        from kimitui.engine.llama_glue import ggml_base
        from kimitui.engine.trimming import SOFTMAX_WEIGHTED_ARCHS, RouteTrimmer

        self._ggml = ggml_base(C._lib._name)
        self.trimmer = RouteTrimmer(rule, softmax_weighted=architecture in SOFTMAX_WEIGHTED_ARCHS)
        self._routes: dict[int, int] = {}
        self.error: str | None = None
        self.c_callback = C.ggml_backend_sched_eval_callback(self._on_eval)

    def _on_eval(self, tensor, ask, _user) -> bool:
        from kimitui.engine.llama_glue import numbered
        from kimitui.engine.trimming import routing_views

        name = self._ggml.ggml_get_name(tensor) or b""
        topk, weights = numbered(name, b"ffn_moe_topk-"), numbered(name, b"ffn_moe_weights-")
        if ask:
            return topk is not None or weights is not None
        try:  # a C callback must not raise: the error is reported once the pass returns
            if topk is not None:
                self._routes[topk] = tensor
            elif weights is not None and weights in self._routes:
                ids, gathered = routing_views(self._ggml, self._routes.pop(weights), tensor)
                self.trimmer.trim(ids, gathered, lambda experts: [False] * len(experts))
        except Exception as exc:  # noqa: BLE001
            self.error = self.error or f"{type(exc).__name__}: {exc}"
        return True


@dataclass(frozen=True)
class QualityResult:
    tokens: int  # positions compared (each predicts the next token)
    kl_mean: float
    kl_median: float
    kl_p99: float
    kl_max: float
    top1_agreement: float
    ppl_model: float
    ppl_variant: float
    routes_skipped: float | None = None  # expert trimming: the share of (token, expert) routes it skipped


def _logits(path: Path, text: str, n_ctx: int, threads: int | None, expected: tuple[list[int], int] | None = None,
            trim: _TrimEverything | None = None, cache=None):
    """(the text's tokens, the model's logits at every position but the last, its vocabulary
    size). `expected`: the first model's tokens and vocabulary size, which this one must match;
    `trim`: expert trimming applied while it computes; `cache`: the context's kv_cache.KVCache
    (default: llama-cpp-python's)."""
    import numpy as np
    from llama_cpp import Llama

    from kimitui.engine.llama_glue import llama_params
    from kimitui.model.gguf_map import split_set

    try:
        with llama_params(None, repack=False, eval_cb=trim.c_callback if trim is not None else None):
            llm = Llama(  # llama.cpp opens a split set at its first file only
                str(split_set(path)[0]), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=min(n_ctx, 512), logits_all=True,
                n_threads=threads, verbose=False, **(cache or kv_cache.PLAIN).llama_params(),
            )
    except ValueError as exc:
        raise UserError(f"{path}: llama.cpp could not load it ({exc})") from None
    try:
        own = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)[:n_ctx]
        if expected is not None and (own, llm.n_vocab()) != expected:
            raise UserError(
                f"{path}: its vocabulary differs from the model's ({llm.n_vocab()} tokens against "
                f"{expected[1]}, or the text tokenizes differently): the two cannot be compared token by token"
            )
        if len(own) < 2:
            raise UserError("the text is shorter than two tokens: nothing to predict")
        try:
            llm.eval(own)
            if trim is not None and trim.error is not None:
                raise UserError(f"{path}: expert trimming failed ({trim.error})")
            return own, np.array(llm.scores[: len(own) - 1], dtype=np.float32), llm.n_vocab()
        except (RuntimeError, MemoryError) as exc:
            raise UserError(f"{path}: scoring {len(own)} tokens failed ({type(exc).__name__}: {exc}); try a smaller --n-ctx") from None
    finally:
        llm.close()


def compare(model: Path, variant: Path, text: str, *, n_ctx: int = 512, threads: int | None = None,
            trim=None, variant_cache=None) -> QualityResult:
    """``trim``: a TrimRule the variant runs with, every routed expert counted as a miss;
    ``variant_cache``: the kv_cache.KVCache the variant's context is made with (drafts_cache:
    the one speculation makes)."""
    import numpy as np

    from kimitui.model import read_model_info

    trimming = _TrimEverything(trim, read_model_info(variant).architecture) if trim is not None and trim.on else None
    tokens, base, n_vocab = _logits(model, text, n_ctx, threads)
    _, other, _ = _logits(variant, text, n_ctx, threads, expected=(tokens, n_vocab), trim=trimming,
                          cache=variant_cache)
    targets = np.array(tokens[1:])
    kl = np.empty(len(targets))
    nll_base = np.empty(len(targets))
    nll_other = np.empty(len(targets))
    agree = 0
    for start in range(0, len(targets), 64):  # float64 a block of rows at a time
        end = min(start + 64, len(targets))
        lp = _log_softmax(base[start:end])
        lq = _log_softmax(other[start:end])
        kl[start:end] = np.maximum(0.0, (np.exp(lp) * (lp - lq)).sum(axis=1))
        rows = np.arange(end - start)
        nll_base[start:end] = -lp[rows, targets[start:end]]
        nll_other[start:end] = -lq[rows, targets[start:end]]
        agree += int((lp.argmax(axis=1) == lq.argmax(axis=1)).sum())
    return QualityResult(
        tokens=len(targets),
        kl_mean=float(kl.mean()),
        kl_median=float(np.median(kl)),
        kl_p99=float(np.percentile(kl, 99)),
        kl_max=float(kl.max()),
        top1_agreement=agree / len(targets),
        ppl_model=float(np.exp(nll_base.mean())),
        ppl_variant=float(np.exp(nll_other.mean())),
        routes_skipped=(trimming.trimmer.routes_skipped / trimming.trimmer.routes) if trimming and trimming.trimmer.routes else None,
    )


def drafts_cache(path: Path):
    """The cache a context that may check drafts of ``path``'s model is made with (kv_cache.py)."""
    from kimitui.model.gguf_map import load_model_map

    model = load_model_map(path)
    return kv_cache.for_drafts(model.hparams, model.architecture)


def _log_softmax(logits):
    import numpy as np

    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", type=Path, help="the model as it is (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--variant", type=Path, help="the lossy variant: a requantized copy (any file of a split set; default: the model, with --trim-*)")
    parser.add_argument("--trim-below", type=float, metavar="SHARE",
                        help="the variant skips each routed expert whose share of its token's routing weight is below SHARE (engine.expert_trim_below)")
    parser.add_argument("--trim-cumulative", type=float, metavar="SHARE",
                        help="the variant skips a token's routed experts past those whose shares reach SHARE (engine.expert_trim_cumulative)")
    parser.add_argument("--speculation-cache", action="store_true",
                        help="the variant runs in the context engine.speculate makes: keys and values cached as Q8_0 (BF16 where heads do not divide into its blocks) with flash attention")
    parser.add_argument("--text", type=Path, help="a UTF-8 text file to score (default: a built-in text of about 400 tokens)")
    parser.add_argument("--n-ctx", type=int, default=512, help="tokens of the text scored, at most (default 512)")
    parser.add_argument("--threads", type=int, help="compute threads (default: llama.cpp's)")


def run(args: argparse.Namespace) -> int:
    from kimitui.model import default_model_path
    from kimitui.model.gguf_map import split_set

    from kimitui.config import key_spec
    from kimitui.engine.trimming import TrimRule
    from kimitui.model.gguf_map import load_model_map

    model = args.model or default_model_path()
    below = 0.0 if args.trim_below is None else args.trim_below
    cumulative = 1.0 if args.trim_cumulative is None else args.trim_cumulative
    for flag, key, value in (("--trim-below", "expert_trim_below", below), ("--trim-cumulative", "expert_trim_cumulative", cumulative)):
        spec = key_spec(f"engine.{key}")
        if not spec.low <= value <= spec.high:
            raise UserError(f"{flag} {value:g}: give {spec.low:g}..{spec.high:g}")
    trim = TrimRule(below, cumulative)
    if args.variant is None and not trim.on and not args.speculation_cache:
        raise UserError("give --variant FILE, --trim-below / --trim-cumulative to measure expert trimming, or --speculation-cache")
    variant = args.variant or model
    for path in {model, variant}:
        split_set(path)  # one line naming a missing file or set member
    if trim.on and not load_model_map(variant).n_expert:
        raise UserError(f"{variant}: no routed experts, nothing for --trim-below / --trim-cumulative to skip")
    if args.n_ctx < 2:
        raise UserError(f"--n-ctx {args.n_ctx}: give 2 or more")
    if args.text is None:
        text = BUILT_IN_TEXT
    else:
        try:
            text = args.text.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"--text {args.text}: {getattr(exc, 'strerror', None) or exc}") from None
    cache = drafts_cache(variant) if args.speculation_cache else None
    r = compare(model, variant, text, n_ctx=args.n_ctx, threads=args.threads, trim=trim, variant_cache=cache)
    print(f"{r.tokens} positions of {'the built-in text' if args.text is None else args.text}, teacher-forced")
    if trim.on:
        print(f"variant: {variant.name} with expert {trim.label()}, every routed expert counted as a miss (the most it can "
              f"cost): {r.routes_skipped or 0:.1%} of the routes skipped")
    if cache is not None:
        print(f"variant: {variant.name} in speculation's context (its KV cache {cache.name})")
    print(f"KL divergence of the variant from the model: mean {r.kl_mean:.5f}, median {r.kl_median:.5f}, "
          f"p99 {r.kl_p99:.5f}, max {r.kl_max:.5f} nats")
    print(f"top-1 agreement: {r.top1_agreement:.1%}")
    print(f"perplexity: model {r.ppl_model:.3f}, variant {r.ppl_variant:.3f} ({r.ppl_variant / r.ppl_model - 1:+.2%})")
    return 0

"""Structured output: grammars compiled once per engine (xgrammar), one matcher per request, and each step
a token bitmask applied to the logits rows of the constrained requests only.

xgrammar is imported on the first constrained request, so a machine without it serves everything else
and refuses only those requests (a ValueError naming `structured_output`). JSON grammars have no free
whitespace (`any_whitespace=False`: the separators are xgrammar's fixed ", " and ": "), so a model cannot
spin in blanks. A grammar ends on a stop token: the mask allows only the stop tokens once the grammar is
complete and can go no further, and the request ends when one is accepted.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from mixserve.engine.sampling_params import StructuredOutput

log = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept per engine (by spec): a repeated schema is not compiled again


def _one_line(exc: Exception) -> str:
    """xgrammar's C++ errors begin with '[time] file.cc:line: '; keep the message, on one line."""
    text = " ".join(str(exc).split())
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", text)


class RequestGrammar:
    """One request's place in its grammar. It advances only on accepted tokens, so a request preempted
    and recomputed keeps its place (the recompute samples the next token, never an old one again)."""

    def __init__(self, matcher: Any, request_id: str) -> None:
        self.matcher = matcher
        self.request_id = request_id

    def accept(self, token_id: int) -> bool:
        """Advance on a sampled token; True when the grammar has ended (a stop token accepted)."""
        if self.matcher.accept_token(token_id):
            return bool(self.matcher.is_terminated())
        # the mask allowed it only if something after the mask moved the choice: the output no longer
        # follows the grammar, and going on could not bring it back
        log.error("request %s: token %d is outside its grammar; the request ends here",
                  self.request_id, token_id)
        return True

    def allowed(self, draft: Sequence[int]) -> int:
        """How many leading tokens of `draft` the grammar accepts from here (up to and with the stop token
        that ends it); the matcher is left where it was."""
        return self.walk(draft)[0]

    def walk(self, draft: Sequence[int], bitmask: torch.Tensor | None = None, first: int = 0
             ) -> tuple[int, list[int]]:
        """Accept `draft` token by token while the grammar allows it, filling row first + j of `bitmask`
        (if given) with the mask after draft[:j]; then roll back. Returns the tokens accepted and the
        filled rows that allow less than all."""
        m, taken, masked = self.matcher, 0, []
        for j in range(len(draft) + 1):
            if m.is_terminated():
                break
            if bitmask is not None and m.fill_next_token_bitmask(bitmask, first + j):
                masked.append(first + j)
            if j == len(draft) or not m.accept_token(draft[j]):
                break
            taken += 1
        if taken:
            m.rollback(taken)
        return taken, masked


class StepMasks:
    """The bitmask of one step's sampled rows; `indices`: the rows whose mask allows less than all."""

    def __init__(self, bitmask: torch.Tensor, indices: list[int]) -> None:
        self.bitmask = bitmask
        self.indices = indices

    def apply(self, logits: torch.Tensor) -> None:
        """Set the disallowed tokens of the constrained rows of `logits` (one row per sampled row) to
        -inf, in place; the other rows are not touched."""
        import xgrammar as xgr

        if not self.indices:
            return  # every constrained row allows every token this step
        bitmask = self.bitmask.to(logits.device)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=self.indices)


class Grammars:
    """The engine's grammar compiler (built on first use from its tokenizer), its compiled-grammar cache
    and the per-step mask.

    The step fills the bitmask after `runner.forward` returns and before the logits are read: on a GPU the
    forward is still running then, so the fill overlaps it for free. On a CPU the forward is synchronous;
    filling on a worker thread meanwhile (xgrammar releases the GIL) was measured and dropped: a fill costs
    less than the hand-off, and the apply needs the logits (docs/api.md, "Structured output")."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self._hf = getattr(tokenizer, "hf", tokenizer)
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's vocabulary)
        self._stop_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        # validate() may compile on a server thread while the step loop compiles: the cache is locked
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._bitmask: torch.Tensor | None = None

    def matcher(self, spec: StructuredOutput, request_id: str) -> RequestGrammar:
        """A fresh matcher for a request; ValueError naming `structured_output` if it cannot compile."""
        compiled = self.compile(spec)  # first: it says so in one line when xgrammar is missing
        import xgrammar as xgr

        return RequestGrammar(xgr.GrammarMatcher(compiled), request_id)

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of `spec` (cached); ValueError naming `structured_output` on a bad one."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return cached
            compiler = self._get_compiler()
        try:
            if spec.kind == "json_schema":
                grammar = compiler.compile_json_schema(spec.spec, any_whitespace=False)
            elif spec.kind == "json_object":
                # any object: the schema {"type": "object"} without strict mode (extra keys allowed), as
                # the builtin JSON grammar allows free whitespace and a top-level array
                grammar = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                       strict_mode=False)
            elif spec.kind == "regex":
                grammar = compiler.compile_regex(spec.spec)
            else:  # choice: EBNF string literals take JSON's escapes
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choices)
                grammar = compiler.compile_grammar(f"root ::= {alternatives}")
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"structured_output: cannot compile the {spec.kind} "
                             f"({_one_line(exc)})") from None
        with self._lock:
            self._cache[spec] = grammar
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def masks(self, grammars: Sequence[RequestGrammar | None]) -> StepMasks | None:
        """The bitmask of one step's sampled rows (row i: grammars[i], None = unconstrained); None when
        no row is constrained, so a batch without grammars does no work here."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < len(grammars):
            self._bitmask = xgr.allocate_token_bitmask(max(len(grammars), 8), self.vocab_size)
        bitmask = self._bitmask[: len(grammars)]
        matchers = [(i, grammars[i].matcher) for i in rows]  # type: ignore[union-attr]
        # fill says False where the row allows every token: no need to mask it
        return StepMasks(bitmask, [i for i, m in matchers if m.fill_next_token_bitmask(bitmask, i)])

    def draft_masks(self, groups: Sequence[tuple[RequestGrammar | None, Sequence[int]]]) -> StepMasks | None:
        """The bitmask of the speculating decodes' rows, group after group (1 + len(draft) rows each): row j
        of a group with a grammar is its mask after drafts[:j]. Rows past a draft the grammar refuses (or
        past its end) stay unmasked: verification stops at that draft, so they are never read."""
        if all(g is None for g, _ in groups):
            return None
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(sum(len(d) + 1 for _, d in groups), self.vocab_size)
        indices, first = [], 0
        for grammar, draft in groups:
            if grammar is not None:
                indices += grammar.walk(draft, bitmask, first)[1]
            first += len(draft) + 1
        return StepMasks(bitmask, indices)

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError:
                raise ValueError("structured_output: not available on this server (the xgrammar package "
                                 "is not installed)") from None
            info = xgr.TokenizerInfo.from_huggingface(self._hf, vocab_size=self.vocab_size,
                                                      stop_token_ids=self._stop_ids)
            # one compile thread: the step loop waits for it, and the cores belong to the forward
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

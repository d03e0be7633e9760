"""Structured output on xgrammar, the grammar engine vLLM defaults to: JSON schemas, regexes,
choices and EBNF (GBNF) grammars compiled against the model's tokenizer into token masks.

`Grammars` compiles a request's OutputConstraint where the request is built (Triton's threads,
not the step loop); xgrammar caches compiled grammars by their text. `GrammarMatchers` (the
driver's) holds one matcher per constrained sequence: each step fills the token bitmask of all
the step's constrained rows in one batched call, the sampler applies it, and the engine feeds
each sampled token back. EOS is in a mask exactly when the grammar may end.
"""
import json
import threading

import torch

from tritonlm.errors import InvalidRequestError
from tritonlm.output_constraints import OutputConstraint


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise InvalidRequestError("structured output needs the xgrammar package "
                                  "(pip install 'tritonlm[structured]')") from e
    return xgrammar


class Grammars:
    """Compiles constraints for one model's tokenizer; safe from any thread. The compiler (and
    the tokenizer's vocabulary table) is made on the first constrained request."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int]):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()

    def compile(self, constraint: OutputConstraint):
        """The compiled grammar; InvalidRequestError for one that does not compile."""
        xgr = _xgrammar()
        compiler = self._get_compiler(xgr)
        kind, spec = constraint.kind, constraint.spec
        try:
            if kind in ("json", "json_object"):
                # Compact JSON: free whitespace lets a small model pad until max_tokens.
                return compiler.compile_json_schema(spec or '{"type": "object"}',
                                                    any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(_choice_grammar(constraint.choices))
            return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequestError(f"the {kind} constraint does not compile: {e}") from e

    def _get_compiler(self, xgr):
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler


def _choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarMatchers:
    """The matchers of the constrained sequences, by sequence id (the driver's, engine thread)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.by_seq: dict[int, object] = {}
        self.grammars: dict[int, object] = {}
        self._batch = None

    def add(self, seq_id: int, grammar) -> None:
        self.by_seq[seq_id] = _xgrammar().GrammarMatcher(grammar)
        self.grammars[seq_id] = grammar

    def fork(self, parent_id: int, child_id: int) -> None:
        """A sequence of the same request (n / best_of), starting after the prompt as well."""
        if parent_id in self.grammars:
            self.add(child_id, self.grammars[parent_id])

    def release(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self.by_seq.pop(seq_id, None)
            self.grammars.pop(seq_id, None)

    def token_bitmask(self, rows: list[tuple[int, list[int]]]) -> torch.Tensor:
        """[len(rows), ceil(V / 32)] int32 for rows (seq_id, proposals): bit t of a row set where
        token t may come next after the sequence's tokens, then `proposals` (a speculative
        verification's row, its matcher walked there and back). Past a proposal the grammar
        refuses (or ends at) every token is allowed: the draw before it cannot keep it, so no
        draw after it is kept."""
        xgr = _xgrammar()
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        plain = [i for i, (_, proposals) in enumerate(rows) if not proposals]
        if plain:
            self._batch.batch_fill_next_token_bitmask([self.by_seq[rows[i][0]] for i in plain],
                                                      bitmask, plain)
        for i, (seq_id, proposals) in enumerate(rows):
            if not proposals:
                continue
            matcher, walked = self.by_seq[seq_id], 0
            while walked < len(proposals) and not matcher.is_terminated() \
                    and matcher.accept_token(proposals[walked]):
                walked += 1
            if walked == len(proposals) and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, i)
            else:
                bitmask[i] = -1
            matcher.rollback(walked)
        return bitmask

    def accept(self, seq_id: int, token: int) -> bool:
        """Feed a sampled token; False when the grammar is done (it took an end token, or
        rejected this one): the sequence ends here."""
        matcher = self.by_seq.get(seq_id)
        if matcher is None:
            return True
        return matcher.accept_token(token) and not matcher.is_terminated()

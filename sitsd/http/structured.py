"""Whether a request's grammar compiles, checked before the request reaches the engine.

The daemon's runner compiles grammars with its own `GrammarCompiler` (`sitsd.runtime.grammar`);
this module keeps one per served engine for the API, so a schema that does not compile is a 400
naming `response_format` (or `structured_outputs`), never a failed engine step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sitsd.api.inference import EngineLike
from sitsd.http.errors import bad_request
from sitsd.types import GrammarSpec

if TYPE_CHECKING:
    from sitsd.runtime.grammar import GrammarCompiler


class GrammarChecker:
    """`check(engine, spec)`: raises 400 unless `spec` compiles over the engine's vocabulary."""

    def __init__(self) -> None:
        self._compiler: tuple[EngineLike, GrammarCompiler] | None = None

    def __call__(self, engine: EngineLike, spec: GrammarSpec) -> None:
        # Imported here: it needs torch, which the HTTP server must not import on the event
        # loop at start-up (the engine's thread imports it while the model loads).
        from sitsd.runtime.grammar import GrammarCompiler, GrammarError

        if self._compiler is None or self._compiler[0] is not engine:
            compiler = GrammarCompiler.for_tokenizer(engine.tokenizer, engine.model_info.vocab_size)
            self._compiler = (engine, compiler)
        try:
            self._compiler[1].check(spec)
        except GrammarError as exc:
            field = "response_format" if spec.kind.startswith("json") else "structured_outputs"
            raise bad_request(field, f"the grammar does not compile: {exc}") from None

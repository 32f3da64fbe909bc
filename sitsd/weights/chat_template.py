"""Chat templates: render a list of messages into a prompt string, the way `transformers` does.

A chat template is Jinja2 source that ships with a checkpoint (`tokenizer_config.json`,
`chat_template.jinja` or GGUF metadata). Templates are untrusted code, so they run in jinja2's
immutable sandbox with the same globals and filters `transformers` gives them (`raise_exception`,
`strftime_now`, a JSON `tojson`, a guarded `namespace`), which is what keeps a rendered prompt
byte-identical to `tokenizer.apply_chat_template(..., tokenize=False)`.

This module only renders text. Finding the template in a checkpoint is the loaders' job, and
turning the text into ids is the tokenizer's (`sitsd.weights.tokenizer`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The model has no chat template, the template is broken, or it rejected the messages."""


def _raise_exception(message: str) -> None:
    # Templates call this to refuse a conversation (e.g. "roles must alternate").
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own `tojson` HTML-escapes `<`, `>`, `&` and `'`, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's `namespace()`, refusing underscore attributes (no way into CPython internals)."""

    # No named `self`: like jinja's Namespace, so that `namespace(self=...)` still works.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attribute {name!r} on a namespace"
            )


def _plain(value: Any) -> Any:
    """A copy of `value` built from JSON types only, so the sandbox never sees a rich object."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: Jinja2 source of the template.
        special_tokens: Strings the template may refer to (`bos_token`, `eos_token`, ...);
            entries whose value is None are left undefined, as `transformers` does.

    A template that does not compile is kept; the syntax error is raised as a
    `ChatTemplateError` on the first `render`, so a broken template never blocks plain
    completions.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None):
        self.source = source
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._compile_error: str | None = None
        self._template: jinja2.Template | None = None
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["dict"] = _TemplateDict()
        env.globals["namespace"] = _TemplateNamespace
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            self._compile_error = f"the model's chat template does not compile: {exc}"

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render `messages` into the prompt text.

        Args:
            messages: Chat turns, each a dict with at least `role` and `content`.
            add_generation_prompt: Append the header that opens the assistant's turn.
            **extra: More template variables (e.g. `tools`), passed through as plain data.

        Returns:
            The prompt string, special tokens spelled out as text.

        Raises:
            ChatTemplateError: The template does not compile, raised, or failed on the input.
        """
        if self._template is None:
            raise ChatTemplateError(self._compile_error)
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise ChatTemplateError("messages must be a list of dicts with 'role' and 'content'")
        variables: dict[str, Any] = {"tools": None, "documents": None, **self._special_tokens}
        variables.update(_plain(extra))
        try:
            return self._template.render(
                messages=_plain(messages),
                add_generation_prompt=bool(add_generation_prompt),
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(
                f"the chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from exc

"""The serving-side tokenizer: Hugging Face ``tokenizers`` + the engine's tokenizer files, no transformers.

Reads from an engine's tokenizer directory:

- ``tokenizer.json`` -- the fast-tokenizer definition (normalizer, pre-tokenizer, model, post-processor,
  decoder, added tokens);
- ``tokenizer_config.json`` -- special tokens (``bos_token``, ``eos_token``, ...), ``add_bos_token`` /
  ``add_eos_token`` and possibly ``chat_template``;
- ``chat_template.jinja`` -- the chat template, if stored apart (it wins over the config's).

``encode`` gives the ids transformers' ``AutoTokenizer`` gives; ``apply_chat_template`` renders the
template the way transformers does (a sandboxed jinja2 environment with ``trim_blocks``/``lstrip_blocks``,
the loop-controls extension, ``raise_exception``, ``strftime_now`` and a ``tojson`` that keeps non-ASCII),
compiled once per template: compiling SmolLM2's takes ~2 ms, rendering it ~0.07 ms. jinja2 is imported with
the first compilation (:meth:`Tokenizer.prepare_chat_template`), not with this module: ~70 ms that a
process's cold start would otherwise pay before its engine loads.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from kilnlm.runtime.errors import EngineError, RequestError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_content(value: Any) -> str | None:
    """Special tokens are stored either as a string or as an AddedToken-like dict with ``content``."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, backend: HFTokenizer, config: dict[str, Any], chat_template: str | None) -> None:
        self.backend = backend
        self.config = config
        self.chat_template = chat_template
        self.special_tokens: dict[str, str] = {
            key: tok for key in SPECIAL_TOKEN_KEYS if (tok := _token_content(config.get(key))) is not None
        }
        self.bos_token_id = self._token_id(self.special_tokens.get("bos_token"))
        self.eos_token_id = self._token_id(self.special_tokens.get("eos_token"))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.add_eos_token = bool(config.get("add_eos_token", False))
        self._compiled_template: tuple[str, Any] | None = None  # (source, its jinja2.Template)

    @classmethod
    def from_dir(cls, tokenizer_dir: str | os.PathLike) -> "Tokenizer":
        """Load from a directory holding ``tokenizer.json`` (required), ``tokenizer_config.json`` and
        ``chat_template.jinja`` (optional). Raises :class:`EngineError` if ``tokenizer.json`` is missing
        or unreadable."""
        root = Path(tokenizer_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise EngineError(f"{path} is missing: the engine has no fast tokenizer; rebuild it with `kilnlm build`")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises plain Exception on malformed files
            raise EngineError(f"{path} cannot be loaded ({exc}): rebuild the engine with `kilnlm build`") from None
        config_path = root / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = root / "chat_template.jinja"
        chat_template = template_path.read_text() if template_path.is_file() else config.get("chat_template")
        if isinstance(chat_template, list):  # a list of named templates: use the default one
            named = {t["name"]: t["template"] for t in chat_template}
            chat_template = named.get("default")
        return cls(backend, config, chat_template)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    # --------------------------------------------------------------------------------- encode/decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the post-processor's tokens and, where the
        config asks for them and the post-processor did not add them, BOS / EOS."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
                ids = [self.bos_token_id] + ids
            if self.add_eos_token and self.eos_token_id is not None and ids[-1:] != [self.eos_token_id]:
                ids = ids + [self.eos_token_id]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    # ---------------------------------------------------------------------------------- chat template
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_vars: Any
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the engine's chat template.

        Raises :class:`RequestError` if the engine has no chat template or the template rejects the
        messages (its ``raise_exception``)."""
        from jinja2.exceptions import TemplateError

        template = self._chat_template()
        try:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **template_vars
            )
        except TemplateError as exc:
            raise RequestError(f"the chat template rejected the messages: {exc}") from None

    def prepare_chat_template(self) -> None:
        """Compile the chat template now (importing jinja2), so that the first request does not: for a
        thread that prepares the tokenizer while the engine loads. An engine without a template, or with
        one that does not compile, is left for :meth:`apply_chat_template` to report."""
        try:
            self._chat_template()
        except RequestError:
            pass

    def _chat_template(self) -> Any:
        """``chat_template`` compiled as a ``jinja2.Template``, once per source (the attribute may be
        replaced). Raises :class:`RequestError` if there is none or it does not compile."""
        source = self.chat_template
        if not source:
            raise RequestError("this engine's tokenizer has no chat template: send a plain prompt instead of messages")
        compiled = self._compiled_template
        if compiled is not None and compiled[0] == source:
            return compiled[1]
        import jinja2.ext
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise RequestError(f"the engine's chat template does not compile: {exc}; rebuild the engine with a "
                               "valid tokenizer_config.json") from None
        self._compiled_template = (source, template)
        return template


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

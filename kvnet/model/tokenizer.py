"""Tokenizers: the `Tokenizer` protocol, the built-in byte-level tokenizer and Hugging Face tokenizers.

This module owns the mapping between text and token ids, chat-template rendering, and the identity string
that goes into the model fingerprint (two tokenizers that map text differently must never share KV blocks).
It knows nothing about the model, the cache or the network. `load_tokenizer` picks the tokenizer a
checkpoint directory carries: `HFTokenizer` over its ``tokenizer.json`` (the ``tokenizers`` library), with
BOS/EOS, ``add_bos_token`` and the chat template from its configs.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn, Protocol, runtime_checkable

from kvnet.errors import InvalidTokenError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
"""Files whose bytes define a Hugging Face tokenizer; their digest names it (`tokenizer_files_identity`)."""

NUM_BYTE_TOKENS = 256
"""Ids 0..255 are the raw bytes of the UTF-8 text."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the model, the generation loop and the fingerprint need from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids (ids are 0..vocab_size-1)."""
        ...

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence id."""
        ...

    @property
    def eos_id(self) -> int:
        """End-of-sequence id; generation may stop on it."""
        ...

    def tokenize(self, text: str, *, bos: bool = True) -> list[int]:
        """Token ids of `text`, prefixed with `bos_id` when `bos` is true."""
        ...

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`; special ids are dropped."""
        ...

    def identity(self) -> str:
        """A stable string naming this exact text-to-ids mapping, for the model fingerprint."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS=256, EOS=257, PAD=258 (vocab 259).

    Deterministic and dependency-free, so every node maps a prompt to the same ids without any files.
    """

    bos_id: int = NUM_BYTE_TOKENS
    eos_id: int = NUM_BYTE_TOKENS + 1
    pad_id: int = NUM_BYTE_TOKENS + 2
    vocab_size: int = NUM_BYTE_TOKENS + 3

    def tokenize(self, text: str, *, bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if bos else ids

    def detokenize(self, token_ids: Sequence[int]) -> str:
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise InvalidTokenError(f"token id {token_id} outside [0, {self.vocab_size})")
        # A model may emit a byte sequence that is not valid UTF-8 mid-generation; replace, never raise.
        return bytes(t for t in token_ids if t < NUM_BYTE_TOKENS).decode("utf-8", errors="replace")

    def identity(self) -> str:
        # Any change to the id layout must change this string (and so the fingerprint).
        return (
            f"kvnet-bytes-v1:bytes=0-{NUM_BYTE_TOKENS - 1},bos={self.bos_id},eos={self.eos_id},"
            f"pad={self.pad_id},vocab={self.vocab_size}"
        )


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files cannot be used as given; the message names the file and key."""


ChatMessage = Mapping[str, Any]
"""One chat turn as Hugging Face templates expect it: ``{"role": ..., "content": ...}``."""


def tokenizer_files_identity(directory: Path) -> str | None:
    """``"hf-files-sha256:<hex>"`` over the tokenizer files in `directory`; None if there are none."""
    present = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
    if not present:
        return None
    digest = hashlib.sha256()
    for name in present:
        data = (directory / name).read_bytes()
        digest.update(struct.pack(">I", len(name)) + name.encode() + struct.pack(">Q", len(data)) + data)
    return f"hf-files-sha256:{digest.hexdigest()}"


def read_json_object(path: Path, error: type[ValueError] = TokenizerError) -> dict[str, Any]:
    """The JSON object in `path`, ``{}`` when there is no such file; `error` naming the file otherwise."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"cannot read {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise error(f"{path} must hold a JSON object")
    return value


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_template_exception(message: str) -> NoReturn:
    raise TokenizerError(f"chat template: {message}")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (byte-level BPE and the rest) behind the `Tokenizer` protocol.

    Special tokens follow the checkpoint: BOS/EOS from ``tokenizer_config.json`` (else ``config.json``'s
    ``bos_token_id``/``eos_token_id``), and BOS is prepended only when ``add_bos_token`` says so; without
    that key the tokenizer's own post-processor decides, as in transformers.
    """

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        directory = Path(directory)
        path = directory / "tokenizer.json"
        try:
            self._tokenizer = RustTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for any bad file
            raise TokenizerError(f"cannot load {path}: {exc}") from exc
        tokenizer_config = read_json_object(directory / "tokenizer_config.json")
        model_config = read_json_object(directory / "config.json")
        self.vocab_size: int = max(
            self._tokenizer.get_vocab_size(with_added_tokens=True), int(model_config.get("vocab_size") or 0)
        )
        self.bos_id: int = self._special_id(tokenizer_config, model_config, "bos")
        self.eos_id: int = self._special_id(tokenizer_config, model_config, "eos")
        add_bos = tokenizer_config.get("add_bos_token")
        add_eos = tokenizer_config.get("add_eos_token")
        # None: the post-processor in tokenizer.json adds what it adds (Llama 3 style).
        self.add_bos_token: bool | None = None if add_bos is None else bool(add_bos)
        self.add_eos_token: bool = bool(add_eos)
        template = tokenizer_config.get("chat_template")
        if isinstance(template, list):  # several named templates: the "default" one is the chat template
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._special_texts = {
            name: _token_text(tokenizer_config.get(f"{name}_token")) or "" for name in ("bos", "eos")
        }
        self._identity = tokenizer_files_identity(directory) or ""

    def _special_id(
        self, tokenizer_config: Mapping[str, Any], model_config: Mapping[str, Any], name: str
    ) -> int:
        text = _token_text(tokenizer_config.get(f"{name}_token"))
        if text is not None:
            token_id = self._tokenizer.token_to_id(text)
            if token_id is None:
                raise TokenizerError(f"tokenizer_config.json: {name}_token {text!r} is not in the vocabulary")
            return int(token_id)
        token_id = model_config.get(f"{name}_token_id")
        if isinstance(token_id, list):  # config.json may list several stop ids; the first is the EOS
            token_id = token_id[0] if token_id else None
        if isinstance(token_id, int) and not isinstance(token_id, bool):
            return token_id
        raise TokenizerError(
            f"no {name}_token in tokenizer_config.json and no {name}_token_id in config.json"
        )

    def tokenize(self, text: str, *, bos: bool = True) -> list[int]:
        """Token ids of `text`; with `bos`, the checkpoint's special tokens are added as its configs say."""
        use_post_processor = bos and self.add_bos_token is None
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=use_post_processor).ids
        if bos and self.add_bos_token:
            ids.insert(0, self.bos_id)
        if bos and self.add_eos_token:
            ids.append(self.eos_id)
        return ids

    def detokenize(self, token_ids: Sequence[int]) -> str:
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise InvalidTokenError(f"token id {token_id} outside [0, {self.vocab_size})")
        text: str = self._tokenizer.decode(list(token_ids), skip_special_tokens=True)
        return text

    def apply_chat_template(
        self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of `messages`, rendered with the checkpoint's Jinja chat template as transformers
        renders it (sandboxed; ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
        ``raise_exception``). `TokenizerError` without a template or when the template rejects the input."""
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template (tokenizer_config.json: chat_template)")
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        environment.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent
        )
        environment.globals["raise_exception"] = _raise_template_exception
        environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return environment.from_string(self.chat_template).render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self._special_texts["bos"],
                eos_token=self._special_texts["eos"],
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template: {exc}") from exc

    def tokenize_chat(
        self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered chat; the template writes its own special tokens, so none are added."""
        return self.tokenize(
            self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt), bos=False
        )

    def identity(self) -> str:
        return self._identity


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer a checkpoint directory carries: `HFTokenizer` when it has ``tokenizer.json``; the
    byte tokenizer when its ``config.json`` names the byte tokenizer's identity; else `TokenizerError`."""
    directory = Path(directory)
    if (directory / "tokenizer.json").is_file():
        return HFTokenizer(directory)
    named = read_json_object(directory / "config.json").get("kvnet_tokenizer_identity")
    if named == ByteTokenizer().identity():
        return ByteTokenizer()
    raise TokenizerError(f"{directory} has no tokenizer.json and does not name kvnet's byte tokenizer")

"""Chat prompts from the CMF's `tokenizer_config.chat_template` (spec §6.1), rendered with
Hugging Face semantics: a sandboxed jinja2 environment with trim_blocks / lstrip_blocks and
loop controls, `raise_exception`, `strftime_now` and a non-ASCII-escaping `tojson`, the
special tokens as strings, and the rendered text tokenized without adding special tokens.
A file without a template gets ChatML.
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pipeline.ground.errors import CmfdeployError
from pipeline.ground.tokenizer import Tokenizer

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(CmfdeployError):
    """A chat template that does not compile, or that refuses the messages."""


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render_chat(template: str | None, messages: list[dict], *, add_generation_prompt: bool = True,
                special_tokens: dict[str, str | None] | None = None, source: str = "tokenizer_config") -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(CHATML if template is None else template)
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **(special_tokens or {}))
    except jinja2.exceptions.TemplateError as error:
        raise ChatTemplateError(f"{source}: chat_template: {error}") from None


def chat_ids(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> np.ndarray:
    """Token ids of the rendered conversation."""
    def token(i: int | None) -> str | None:
        return None if i is None else tokenizer.hf.id_to_token(i)

    special = {
        "bos_token": token(tokenizer.bos_id),
        "eos_token": token(tokenizer.eos_ids[0]) if tokenizer.eos_ids else None,
        "pad_token": token(tokenizer.pad_id),
    }
    text = render_chat(tokenizer.chat_template, messages, add_generation_prompt=add_generation_prompt,
                       special_tokens=special, source=f"{tokenizer.source}: tokenizer_config")
    return tokenizer.encode(text)

"""Tokenizer: a thin wrapper over `transformers.AutoTokenizer` for chat prompts and EOS/pad ids."""

from __future__ import annotations

import json
from pathlib import Path

import transformers

# Llama-3 chat templates print today's date unless given one; a fixed date keeps prompts
# (and therefore runs) reproducible. Override with `Tokenizer(..., template_kwargs=...)`.
_DEFAULT_TEMPLATE_KWARGS = {"date_string": "26 Jul 2024"}


# A folder holds a tokenizer when it has one of these (what AutoTokenizer reads).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer:
    """Loads a tokenizer from a local directory and renders chat prompts with its template."""

    def __init__(self, path: str | Path, *, template_kwargs: dict | None = None):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {path}")
        if not any((self.path / f).is_file() for f in TOKENIZER_FILES):
            raise FileNotFoundError(f"{path}: no tokenizer files (expected one of "
                                    f"{', '.join(TOKENIZER_FILES)} in a Hugging Face model folder)")
        try:
            self.hf = transformers.AutoTokenizer.from_pretrained(str(self.path),
                                                                 trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds
            raise ValueError(f"{path}: its tokenizer does not load ({type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})"
                             ) from None
        self.template_kwargs = dict(_DEFAULT_TEMPLATE_KWARGS, **(template_kwargs or {}))
        self.eos_ids = self._eos_ids()
        pad = self.hf.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]

    def _eos_ids(self) -> tuple[int, ...]:
        """The tokenizer's EOS plus any listed in generation_config.json (e.g. Llama's <|eot_id|>)."""
        ids = [] if self.hf.eos_token_id is None else [int(self.hf.eos_token_id)]
        gen = self.path / "generation_config.json"
        if gen.is_file():
            extra = json.loads(gen.read_text()).get("eos_token_id")
            for i in extra if isinstance(extra, list) else [extra]:
                if i is not None and int(i) not in ids:
                    ids.append(int(i))
        if not ids:
            raise ValueError(f"{self.path}: tokenizer defines no EOS token")
        return tuple(ids)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens added."""
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def chat(self, user: str, *, system: str | None = None,
             add_generation_prompt: bool = True) -> str:
        """The system + user messages rendered by the model's chat template."""
        messages = ([{"role": "system", "content": system}] if system else [])
        messages.append({"role": "user", "content": user})
        return self.hf.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           **self.template_kwargs)

    def encode_chat(self, user: str, *, system: str | None = None) -> list[int]:
        """Token ids of the rendered chat prompt, ending with the assistant header."""
        return self.encode(self.chat(user, system=system))

"""A GGUF file's tokenizer as Hugging Face files: tokenizer.json built from its tokenizer.ggml.* fields, and configs.

Two kinds, named by tokenizer.ggml.model:

- `gpt2`: byte-level BPE with the file's merges, text split first by the regex of the
  vocabulary named in tokenizer.ggml.pre (the split its merges were learned on).
- `llama`: SentencePiece BPE (Llama 2, Mistral, Gemma). SentencePiece merges, at each step,
  the adjacent pair whose joined piece scores highest; as BPE merge ranks that is every way
  to cut each normal piece into two normal pieces, ranked by the whole piece's score. Spaces
  are '▁', one prepended to the text when add_space_prefix says so (at its start only, as
  transformers reads it; llama.cpp prepends one after each special token too), and
  characters outside the vocabulary fall back to the <0xXX> byte tokens.

In both, control tokens (<|im_start|>, <start_of_turn>) and user-defined ones (<think>,
Gemma's runs of spaces, tabs and newlines) are matched whole, longest first, before
anything else, as SentencePiece and llama.cpp match them. (transformers' GGUF tokenizer
merges Gemma's space runs as BPE instead, which differs from 32 spaces in a row on.) Only
control tokens are special (left out of decoded text), as in transformers' GGUF loader.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from modeling.gguf.metadata import GgufConversionError, GgufMetadata

# llama.cpp's token types (LLAMA_TOKEN_TYPE_*).
_NORMAL = 1
_CONTROL = 3
_USER_DEFINED = 4
_SPACE = "▁"  # SentencePiece's spelling of a space

# The splits byte-level vocabularies were trained on: Llama 3's (numbers in runs of up to
# three digits) and Qwen2's (every digit alone); both keep contractions and newlines apart.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# Descriptive token ids (infill, classification, masking): no serving path reads them.
_DESCRIPTIVE_IDS = (
    "sep",
    "seperator",
    "cls",
    "mask",
    "prefix",
    "suffix",
    "middle",
    "fim_pre",
    "fim_suf",
    "fim_mid",
    "fim_pad",
    "fim_rep",
    "fim_sep",
)


def tokenizer_config(metadata: GgufMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens, whether BOS/EOS are added, the chat template when the file has one."""
    template = _chat_template(metadata)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **({"chat_template": template} if template is not None else {}),
        **_special_tokens(metadata),
        "add_bos_token": _adds_bos(metadata),
        "add_eos_token": _adds_eos(metadata),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }


def special_tokens_map(metadata: GgufMetadata) -> dict[str, Any]:
    return {
        **{name: token for name, token in _special_tokens(metadata).items() if token is not None},
        "additional_special_tokens": _tokens_of_type(metadata, _CONTROL),
    }


def generation_config(metadata: GgufMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: the token ids; eos_token_id a list when more than one token ends a generation."""
    eos_ids = eos_token_ids(metadata)
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "pad_token_id": config["pad_token_id"],
    }
    return {key: value for key, value in generation.items() if value not in (None, [])}


def build_tokenizer(metadata: GgufMetadata) -> Tokenizer:
    """The tokenizer that the GGUF's tokenizer.ggml.* fields describe."""
    kind = metadata.require("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(metadata)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(metadata)
    else:
        raise GgufConversionError(
            f"tokenizer.ggml.model {kind!r} is not supported (gpt2: byte-level BPE, llama: SentencePiece BPE)"
        )
    if metadata.get("tokenizer.ggml.add_sep_token", False):
        raise GgufConversionError("tokenizer.ggml.add_sep_token true is not supported")
    for name in _DESCRIPTIVE_IDS:
        metadata.get(f"tokenizer.ggml.{name}_token_id")
    tokenizer.post_processor = _post_processor(metadata, byte_level=kind == "gpt2")
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in _tokens_of_type(metadata, _CONTROL)]
    )
    tokenizer.add_tokens(
        [AddedToken(token, special=False, normalized=False) for token in _tokens_of_type(metadata, _USER_DEFINED)]
    )
    return tokenizer


def eos_token_ids(metadata: GgufMetadata) -> list[int]:
    """The ids that end a generation: the file's EOS, its end-of-turn and end-of-message tokens (llama.cpp stops at
    every one), and Gemma 3's <end_of_turn>, which Google's own generation_config lists beside <eos>."""
    ids = [metadata.get(f"tokenizer.ggml.{name}_token_id") for name in ("eos", "eot", "eom")]
    if metadata.arch == "gemma3":
        tokens = _tokens(metadata)
        ids.append(tokens.index("<end_of_turn>") if "<end_of_turn>" in tokens else None)
    return list(dict.fromkeys(int(token_id) for token_id in ids if token_id is not None))


def _byte_level_bpe(metadata: GgufMetadata) -> Tokenizer:
    metadata.get("tokenizer.ggml.scores")  # byte-level BPE ranks by the merges list; llama.cpp reads no scores for it
    if metadata.get("tokenizer.ggml.add_space_prefix", False):
        raise GgufConversionError("tokenizer.ggml.add_space_prefix true is not supported for byte-level BPE")
    bpe = models.BPE(vocab=_vocab(metadata), merges=_merges(metadata), fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _byte_level_split(metadata.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_level_split(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split a byte-level vocabulary's merges were learned on, named by tokenizer.ggml.pre."""
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in ("default", "gpt2", "gpt-2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise GgufConversionError(
        f"tokenizer.ggml.pre {pre!r} is not supported (supported: smollm, default, gpt2, {', '.join(_SPLITS)})"
    )


def _merges(metadata: GgufMetadata) -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    for merge in metadata.get("tokenizer.ggml.merges", []):
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right or " " in right:
            raise GgufConversionError(f"tokenizer.ggml.merges entry {merge!r} is not two tokens")
        merges.append((left, right))
    return merges


def _sentencepiece_bpe(metadata: GgufMetadata) -> Tokenizer:
    tokens = _tokens(metadata)
    unknown_id = metadata.get("tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(
        vocab=_vocab(metadata),
        merges=_sentencepiece_merges(metadata),
        unk_token=None if unknown_id is None else tokens[unknown_id],
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))  # llama.cpp's default
    if (pre := metadata.get("tokenizer.ggml.pre", "default")) != "default":
        raise GgufConversionError(f"tokenizer.ggml.pre {pre!r} is not supported for SentencePiece (only 'default')")
    if metadata.get("tokenizer.ggml.remove_extra_whitespaces", False):
        raise GgufConversionError("tokenizer.ggml.remove_extra_whitespaces true is not supported")
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first" if space_prefix else "never", split=False
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if space_prefix else steps)
    return tokenizer


def _sentencepiece_merges(metadata: GgufMetadata) -> list[tuple[str, str]]:
    """Every cut of a normal piece into two normal pieces, best joined score first.

    A piece can be joined in several ways; those rank longest left part first, and equal
    scores rank by (left length, right length, piece id), which is transformers' order too.
    """
    tokens = _tokens(metadata)
    scores = metadata.require("tokenizer.ggml.scores")
    types = metadata.require("tokenizer.ggml.token_type")
    normal = {token for token, kind in zip(tokens, types, strict=True) if kind == _NORMAL}
    ranked = []
    for token_id, (token, score, kind) in enumerate(zip(tokens, scores, types, strict=True)):
        if kind != _NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-score, -cut, cut - len(token), token_id, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _vocab(metadata: GgufMetadata) -> dict[str, int]:
    tokens = _tokens(metadata)
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GgufConversionError(f"tokenizer.ggml.tokens repeats {len(tokens) - len(vocab)} token(s)")
    return vocab


def _tokens(metadata: GgufMetadata) -> list[str]:
    tokens: list[str] = metadata.require("tokenizer.ggml.tokens")
    return tokens


def _adds_bos(metadata: GgufMetadata) -> bool:
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise, to no byte-level one.
    return bool(metadata.get("tokenizer.ggml.add_bos_token", metadata.get("tokenizer.ggml.model") == "llama"))


def _adds_eos(metadata: GgufMetadata) -> bool:
    return bool(metadata.get("tokenizer.ggml.add_eos_token", False))


def _post_processor(metadata: GgufMetadata, *, byte_level: bool) -> processors.PostProcessor | None:
    """Add BOS (and EOS) when the GGUF says so, so that tokenizer.json alone encodes like llama.cpp."""
    tokens = _tokens(metadata)
    added: dict[str, tuple[str, int]] = {}  # "bos"/"eos" -> (token, id), for the ones added
    for key, adds in (("bos", _adds_bos(metadata)), ("eos", _adds_eos(metadata))):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if adds and token_id is None:
            raise GgufConversionError(
                f"tokenizer.ggml.add_{key}_token is true but tokenizer.ggml.{key}_token_id is missing"
            )
        if adds:
            added[key] = (tokens[token_id], token_id)
    if not added:
        return processors.ByteLevel(trim_offsets=False) if byte_level else None

    def template(sequence: str, type_id: int) -> str:
        parts = [f"{added['bos'][0]}:{type_id}"] if "bos" in added else []
        parts.append(f"${sequence}:{type_id}")
        return " ".join(parts + ([f"{added['eos'][0]}:{type_id}"] if "eos" in added else []))

    return processors.TemplateProcessing(
        single=template("A", 0), pair=f"{template('A', 0)} {template('B', 1)}", special_tokens=list(added.values())
    )


def _tokens_of_type(metadata: GgufMetadata, token_type: int) -> list[str]:
    types = metadata.get("tokenizer.ggml.token_type", [])
    return [token for token, kind in zip(_tokens(metadata), types, strict=False) if kind == token_type]


def _special_tokens(metadata: GgufMetadata) -> dict[str, str | None]:
    tokens = _tokens(metadata)
    ids = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    return {
        name: (tokens[token_id] if (token_id := metadata.get(f"tokenizer.ggml.{key}_token_id")) is not None else None)
        for name, key in ids.items()
    }


def _chat_template(metadata: GgufMetadata) -> str | list[dict[str, str]] | None:
    """tokenizer.chat_template; with named ones beside it (tool use, ...), the list form tokenizer_config takes."""
    default = metadata.get("tokenizer.chat_template")
    metadata.get("tokenizer.chat_templates")  # the names of the ones below
    named = {
        key.removeprefix("tokenizer.chat_template."): metadata.get(key)
        for key in metadata.keys_under("tokenizer.chat_template.")
    }
    if not named:
        return default
    entries = [{"name": "default", "template": default}] if default is not None else []
    return entries + [{"name": name, "template": template} for name, template in named.items()]

"""An EAGLE-style draft head: one decoder layer that reads the target's own last hidden state.

The target's final (normed) hidden state f_j at position j already decides the token
x_{j+1} it emits next. The head takes f_j and the embedding of x_{j+1}, mixes them with
one linear layer (`fc`), runs one decoder layer of the target's shape over its own KV
cache, and predicts f_{j+1}; the target's LM head, restricted to the draft vocabulary
(the N token ids the target emits most), turns that into the draft token x_{j+2}. The
next draft step feeds the predicted feature back in place of the target's.

Draft position j holds the pair (f_j, x_{j+1}). Its inputs come from the target (the
embedding table, the LM head rows), so a draft folder holds only the head's own
weights, the draft vocabulary, and the fingerprints of the target it was trained for.

`EagleHead` is the trainable form (plain differentiable torch over padded batches);
`EagleEngine` runs a saved head for serving, on the target's model code and a paged KV
cache, so ragged batches and rollback work exactly as for a target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from modeling.kernels.packing import choose_ops, pack_weights, packed_for
from modeling.model.batch import SeqSpan
from modeling.model.checkpoint import copy_hf_weights, read_safetensors
from modeling.model.config import ModelConfig, model_fingerprint, vocab_fingerprint
from modeling.model.decoder import DecoderModel, rms_norm
from modeling.model.kv_cache import DEFAULT_PAGE_SIZE, KVCache
from modeling.model.rope import apply_rope, rope_tables
from modeling.model.weights import WeightError

ARCHITECTURE = "SpecserveEagleDraft"
_LAYER = "model.layers.0."


class DraftMismatch(ValueError):
    """The draft was trained for another target (the message says which fingerprint differs)."""


@dataclass(frozen=True)
class EagleMeta:
    target_fingerprint: str  # modeling.model.config.model_fingerprint of the target folder
    vocab_fingerprint: str
    draft_vocab_size: int
    training: dict[str, Any]  # the exact distillation arguments and figures, for the record

    @staticmethod
    def read(folder: Path) -> EagleMeta:
        config = json.loads((folder / "config.json").read_text())
        if ARCHITECTURE not in config.get("architectures", []):
            raise WeightError(
                f"{folder} is not a specserve EAGLE draft (config.json architectures lacks {ARCHITECTURE})"
            )
        meta = config["specserve_eagle"]
        return EagleMeta(
            meta["target_fingerprint"],
            meta["vocab_fingerprint"],
            int(meta["draft_vocab_size"]),
            meta.get("training", {}),
        )


def check_target(draft: Path, target: Path) -> EagleMeta:
    """Refuse a draft trained for another target: vocabulary first (the clearer reason), then the model itself."""
    meta = EagleMeta.read(draft)
    if meta.vocab_fingerprint != vocab_fingerprint(target):
        raise DraftMismatch(
            f"the draft {draft} was trained for a target with another vocabulary "
            f"(fingerprint {meta.vocab_fingerprint}, the target's is {vocab_fingerprint(target)})"
        )
    if meta.target_fingerprint != model_fingerprint(target):
        raise DraftMismatch(
            f"the draft {draft} was trained for another target model "
            f"(fingerprint {meta.target_fingerprint}, {target} is {model_fingerprint(target)})"
        )
    return meta


def head_config(target: ModelConfig) -> ModelConfig:
    """One full-attention decoder layer of the target's shape, with its (full-attention) RoPE."""
    return replace(target, num_layers=1, sliding_layers=(), sliding_window=None, local_rope_theta=None)


def unsupported_target(target: ModelConfig) -> str:
    """Why a head cannot be made for this target ("" if it can): it reads the LM head as the tied embedding rows."""
    if not target.tie_word_embeddings:
        return "its LM head is not tied to its embeddings (draft heads read the LM head as embedding rows)"
    if target.attention_bias or target.o_bias or target.mlp_bias:
        return "its layers have biases (draft heads have none)"
    if target.qk_norm or target.gemma or target.hidden_act != "silu":
        return f"its {target.model_type} layers are not Llama's (draft heads are a Llama decoder layer)"
    if target.sliding_window is not None:
        return "it attends through sliding windows (draft heads attend to every position)"
    return ""


class EagleHead(torch.nn.Module):
    """The trainable head, in float32; the target's embedding table is a frozen buffer."""

    embed_tokens: torch.Tensor
    draft_vocab: torch.Tensor

    def __init__(self, target: ModelConfig, embed_tokens: torch.Tensor, draft_vocab: torch.Tensor) -> None:
        super().__init__()
        cfg = self.config = target
        h, q_size, kv_size = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.register_buffer("embed_tokens", embed_tokens.float(), persistent=False)
        self.register_buffer("draft_vocab", draft_vocab.long(), persistent=False)
        self.fc = torch.nn.Parameter(torch.empty(h, 2 * h))
        self.input_norm = torch.nn.Parameter(torch.ones(h))
        self.q_proj = torch.nn.Parameter(torch.empty(q_size, h))
        self.k_proj = torch.nn.Parameter(torch.empty(kv_size, h))
        self.v_proj = torch.nn.Parameter(torch.empty(kv_size, h))
        self.o_proj = torch.nn.Parameter(torch.empty(h, q_size))
        self.post_attention_norm = torch.nn.Parameter(torch.ones(h))
        self.gate_proj = torch.nn.Parameter(torch.empty(cfg.intermediate_size, h))
        self.up_proj = torch.nn.Parameter(torch.empty(cfg.intermediate_size, h))
        self.down_proj = torch.nn.Parameter(torch.empty(h, cfg.intermediate_size))
        self.norm = torch.nn.Parameter(torch.ones(h))
        with torch.no_grad():
            for weight in (
                self.q_proj,
                self.k_proj,
                self.v_proj,
                self.o_proj,
                self.gate_proj,
                self.up_proj,
                self.down_proj,
            ):
                torch.nn.init.normal_(weight, std=0.02)
            # Start as "the target's feature, shifted a little by the token": the identity on the feature half.
            self.fc.zero_()
            self.fc[:, h:].copy_(torch.eye(h))
            self.fc[:, :h].normal_(std=0.02)

    def init_layer_from(self, tensors: dict[str, torch.Tensor], layer_index: int, final_norm: torch.Tensor) -> None:
        """Copy one of the target's decoder layers (HF names) and its final norm: a far better start than noise."""
        p = f"model.layers.{layer_index}."
        names = {
            "input_norm": "input_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "q_proj": "self_attn.q_proj",
            "k_proj": "self_attn.k_proj",
            "v_proj": "self_attn.v_proj",
            "o_proj": "self_attn.o_proj",
            "gate_proj": "mlp.gate_proj",
            "up_proj": "mlp.up_proj",
            "down_proj": "mlp.down_proj",
        }
        with torch.no_grad():
            for ours, theirs in names.items():
                getattr(self, ours).copy_(tensors[p + theirs + ".weight"].float())
            self.norm.copy_(final_norm.float())

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """features `[B, T, H]` (f_0..f_{T-1}), next_tokens `[B, T]` (x_1..x_T) -> predicted f_1..f_T `[B, T, H]`."""
        cfg = self.config
        b, t, _ = features.shape
        x = torch.cat((self.embed_tokens[next_tokens], features), dim=-1) @ self.fc.T
        h = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        q = (h @ self.q_proj.T).view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = (h @ self.k_proj.T).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = (h @ self.v_proj.T).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = rope_tables(cfg.global_rope, cfg.head_dim, t, features.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        g = cfg.num_queries_per_kv
        attn = F.scaled_dot_product_attention(
            q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), is_causal=True
        )
        x = x + attn.transpose(1, 2).reshape(b, t, -1) @ self.o_proj.T
        h = rms_norm(x, self.post_attention_norm, cfg.rms_norm_eps)
        x = x + (F.silu(h @ self.gate_proj.T) * (h @ self.up_proj.T)) @ self.down_proj.T
        return rms_norm(x, self.norm, cfg.rms_norm_eps)

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary `[..., N]` from (predicted or true) features `[..., H]`."""
        return features @ self.embed_tokens[self.draft_vocab].T

    def save(self, folder: Path, target_folder: Path, meta: dict[str, Any]) -> None:
        """Write a draft folder: config.json (the target's shape, 1 layer, its fingerprints),
        the weights and the vocabulary."""
        folder.mkdir(parents=True, exist_ok=True)
        hf = json.loads((target_folder / "config.json").read_text())
        hf.update(
            architectures=[ARCHITECTURE],
            num_hidden_layers=1,
            specserve_eagle={
                "target_fingerprint": model_fingerprint(target_folder),
                "vocab_fingerprint": vocab_fingerprint(target_folder),
                "draft_vocab_size": int(self.draft_vocab.numel()),
                "training": meta,
            },
        )
        tensors = {
            "fc.weight": self.fc,
            "model.norm.weight": self.norm,
            _LAYER + "input_layernorm.weight": self.input_norm,
            _LAYER + "post_attention_layernorm.weight": self.post_attention_norm,
            _LAYER + "self_attn.q_proj.weight": self.q_proj,
            _LAYER + "self_attn.k_proj.weight": self.k_proj,
            _LAYER + "self_attn.v_proj.weight": self.v_proj,
            _LAYER + "self_attn.o_proj.weight": self.o_proj,
            _LAYER + "mlp.gate_proj.weight": self.gate_proj,
            _LAYER + "mlp.up_proj.weight": self.up_proj,
            _LAYER + "mlp.down_proj.weight": self.down_proj,
        }
        out = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in tensors.items()}
        out["draft_vocab"] = self.draft_vocab.to(torch.int32).contiguous()
        tmp = folder / "model.safetensors.tmp"
        save_file(out, str(tmp))
        tmp.replace(folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


class EagleEngine:
    """Serves a saved head: `forward(spans, features)` appends draft positions and returns draft logits and features.

    The rows of `features` are aligned with the spans' tokens in order: the feature paired
    with each token (the target's, or a feature the head predicted).
    """

    def __init__(
        self,
        folder: Path,
        target_folder: Path,
        *,
        device: str,
        dtype: str,
        num_pages: int,
        max_len: int,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> None:
        self.meta = check_target(folder, target_folder)
        target = ModelConfig.from_folder(target_folder)
        if problem := unsupported_target(target):
            raise DraftMismatch(f"{target_folder} cannot be served by a draft head: {problem}")
        self.config = head_config(target)
        self.device = torch.device(device)
        self.dtype: torch.dtype = getattr(torch, dtype)
        self.num_pages, self.page_size, self.max_len = num_pages, page_size, max_len
        self._folder, self._target_folder = folder, target_folder
        self._model: DecoderModel | None = None
        self.ops = "not loaded"  # which ops the loaded model runs on, and why (for the owner's log)
        self._fc: torch.Tensor | None = None
        self._cache: KVCache | None = None
        self.draft_vocab: torch.Tensor | None = None

    def load(self) -> None:
        cfg = self.config
        weights = read_safetensors(self._folder)
        embed = read_safetensors(self._target_folder, ["model.embed_tokens.weight"])["model.embed_tokens.weight"]
        vocab = weights.pop("draft_vocab").long()
        if vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= cfg.vocab_size:
            raise WeightError(f"the draft vocabulary of {self._folder} has ids outside 0..{cfg.vocab_size - 1}")
        if vocab.unique().numel() != vocab.numel():
            raise WeightError(f"the draft vocabulary of {self._folder} repeats ids")
        fc = weights.pop("fc.weight")
        if tuple(fc.shape) != (cfg.hidden_size, 2 * cfg.hidden_size):
            raise WeightError(
                f"fc.weight has shape {tuple(fc.shape)}, expected {(cfg.hidden_size, 2 * cfg.hidden_size)}"
            )
        tied = replace(cfg, tie_word_embeddings=True)
        model = DecoderModel(tied, self.dtype, self.device, choose_ops(tied, self.dtype, self.device))
        weights["model.embed_tokens.weight"] = embed
        copy_hf_weights(model, weights)
        # The LM head: the target's (tied) rows for the draft vocabulary only.
        model.lm_head = torch.nn.Parameter(embed[vocab].to(device=self.device, dtype=self.dtype), requires_grad=False)
        self.ops = pack_weights(model)
        self._fc = packed_for(model, fc.to(device=self.device, dtype=self.dtype))
        model.set_rope_cache(self.max_len)
        model.eval()
        self._model, self.draft_vocab = model, vocab.to(self.device)

    def allocate(self) -> None:
        self._cache = KVCache(self.config, self.num_pages, self.page_size, self.dtype, self.device)

    def forward(self, spans: list[SeqSpan], features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits over the draft vocabulary `[M, N]`, predicted features `[M, H]`)
        of each span's last num_logits rows."""
        if self._model is None or self._cache is None or self._fc is None:
            raise RuntimeError("the engine is not built: load() and allocate() come first")
        model = self._model
        with torch.inference_mode():
            batch = model.plan(spans, self.page_size)
            tokens = model.embed(batch.token_ids)
            x = model.linear(torch.cat((tokens, features.to(self.dtype)), dim=-1), self._fc)
            hidden = model(batch, self._cache, inputs=x)[batch.logit_rows]
            return model.logits(hidden), hidden

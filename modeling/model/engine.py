"""A model replica with its KV cache, built in phases: what a target worker and a draft model both run.

`ModelEngine` loads the weights (packed for the native kernels on CPU), allocates the
paged cache, forwards packed ragged batches, and checks itself: prefilling a prompt at once
and token by token must give the same next-token logits. Which page holds what is the
owner's business: every span names its block table (modeling/model/kv_cache.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from modeling.kernels.blocks import weight_blocks
from modeling.kernels.invariance import linear_rows_problem
from modeling.kernels.packing import PackedLinear, block_probe, choose_ops, pack_weights, served_by_blocks
from modeling.model.batch import PageError, SeqSpan
from modeling.model.checkpoint import PROJECTION_PARTS
from modeling.model.config import ModelConfig
from modeling.model.decoder import DecoderModel
from modeling.model.graphs import GraphBackend, StepGraphs, graph_capacity_pages
from modeling.model.kv_cache import DEFAULT_PAGE_SIZE, KVCache, pages_for, slot_pages


def default_dtype(device: str) -> str:
    """bfloat16 where the hardware computes it natively (GPUs, CPUs with AVX512-BF16 or AMX), else float32."""
    if device.startswith("cuda"):
        return "bfloat16"
    return (
        "bfloat16"
        if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        else "float32"
    )


_SELF_CHECK_LEN = 12  # positions of the self-check's prompt


class SelfCheckFailed(RuntimeError):
    """The model gave inconsistent results on the process's own start-up check."""


class ModelEngine:
    def __init__(
        self,
        folder: Path,
        config: ModelConfig,
        *,
        device: str,
        dtype: str,
        num_pages: int,
        max_len: int,
        page_size: int = DEFAULT_PAGE_SIZE,
        quantization: str = "none",
    ) -> None:
        """A cache of `num_pages` pages of `page_size` positions; sequences up to `max_len` positions.

        `quantization` (modeling/kernels/blocks.py): "none", which GGUF blocks of the folder's file
        to serve as they are, or "int8" per channel; load() raises QuantizationError if the model
        cannot take it.
        """
        if page_size < 1 or num_pages * page_size < _SELF_CHECK_LEN:
            raise ValueError(
                f"{num_pages} KV pages of {page_size} positions are too few: the self-check needs {_SELF_CHECK_LEN}"
            )
        self.config = config
        self.device = torch.device(device)
        self.dtype: torch.dtype = getattr(torch, dtype)
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_len = max_len
        self._folder = folder
        self.quantization = quantization
        self._block_formats: set[str] = set()  # the GGUF block formats the loaded model's linears read
        self._model: DecoderModel | None = None
        self.ops = "not loaded"  # which ops the loaded model runs on, and why (for the owner's log)
        self._cache: KVCache | None = None
        self.graphs: StepGraphs | None = None  # decode and verify steps replayed from captured graphs

    @property
    def num_slots(self) -> int:
        """Whole sequences of max_len the cache holds at once as fixed slots (`slot_pages`), for tools."""
        return self.num_pages // pages_for(self.max_len, self.page_size)

    def slot_pages(self, slot: int) -> tuple[int, ...]:
        """The block table of fixed slot `slot` (for tools that hold a few whole sequences, not a server)."""
        if not 0 <= slot < self.num_slots:
            raise PageError(f"slot {slot} is outside 0..{self.num_slots - 1}")
        return slot_pages(slot, self.max_len, self.page_size)

    def load(self) -> None:
        blocks = weight_blocks(self._folder, self.quantization)
        model = DecoderModel(
            self.config, self.dtype, self.device, choose_ops(self.config, self.dtype, self.device, blocks)
        )
        native = model.native is not None
        skip = served_by_blocks(model, blocks) if blocks is not None and native else set()
        model.load_weights(self._folder, skip)
        self.ops = pack_weights(model, blocks)
        if blocks is not None and not native:  # torch ops read the folder's (dequantized) weights
            self.ops += f"; --quantization {self.quantization} not applied: the weights are read dense"
        if blocks is not None and isinstance(model.linear, PackedLinear):
            self._block_formats = model.linear.block_formats()
        model.set_rope_cache(self.max_len)
        model.eval()
        self._model = model

    @property
    def native(self) -> bool:
        """Whether the loaded model runs on the native CPU kernels (their thread team: modeling/kernels/threads.py)."""
        return self._model is not None and self._model.native is not None

    @property
    def model(self) -> DecoderModel:
        """The loaded model (load() comes first)."""
        if self._model is None:
            raise RuntimeError("the engine is not built: load() comes first")
        return self._model

    def linear_weight_bytes(self) -> int:
        """Bytes of the weights the model's matmuls read (projections and LM head), as they are held."""
        model = self.model
        weights = [model.lm_head] + [getattr(layer, name) for layer in model.layers for name in PROJECTION_PARTS]
        return sum(weight.numel() * weight.element_size() for weight in weights)

    def allocate(self, scratch_page: bool = False) -> None:
        """The cache of num_pages pages, and with `scratch_page` one more that only graphs' padding rows use."""
        self._cache = KVCache(self.config, self.num_pages + scratch_page, self.page_size, self.dtype, self.device)

    def capture_graphs(
        self,
        backend: GraphBackend,
        max_rows: int,
        max_query_tokens: int,
        before_each: Callable[[int], None] = lambda number: None,
    ) -> float:
        """Capture the decode and verify steps' graphs (modeling/model/graphs.py); from then on a step that fits one
        replays it. Needs the scratch page (allocate). Raises CaptureFailed, leaving no graph in use."""
        if self._model is None or self._cache is None or self._cache.num_pages != self.num_pages + 1:
            raise RuntimeError("graphs need the engine built with its scratch page: load() and allocate(True) first")
        graphs = StepGraphs(
            self._model,
            self._cache,
            max_rows=max_rows,
            max_query_tokens=max_query_tokens,
            capacity_pages=graph_capacity_pages(self.max_len, self.page_size),
        )
        seconds = graphs.capture_all(backend, before_each)
        self.graphs = graphs
        return seconds

    def forward(self, spans: list[SeqSpan]) -> torch.Tensor:
        """Write every span's tokens into its pages and return the logits it asks for: `[sum num_logits, V]`."""
        return self.forward_with_features(spans)[0]

    def forward_with_features(
        self, spans: list[SeqSpan], widen_logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like forward, and also the final hidden state of every new token, in span order: `[sum len(token_ids), H]`.

        These features are what an EAGLE-style draft head reads (modeling/model/eagle.py). Without `widen_logits` the
        logits come in the model's dtype (bfloat16 or float32), not widened to float32: enough for an argmax.
        """
        if self._model is None or self._cache is None:
            raise RuntimeError("the engine is not built: load() and allocate() come first")
        if self.graphs is not None and (replayed := self.graphs.run(spans)) is not None:
            logits, hidden = replayed
            return (logits.float() if widen_logits else logits), hidden
        with torch.inference_mode():
            batch = self._model.plan(spans, self.page_size)
            hidden = self._model(batch, self._cache)
            return self._model.logits(hidden[batch.logit_rows], widen_logits), hidden

    def greedy_tokens(self, logits: torch.Tensor) -> list[int]:
        """The argmax of each row of `forward`'s logits (DecoderModel.greedy)."""
        return self.model.greedy(logits).tolist()  # type: ignore[no-any-return]

    def move_positions(self, pages: tuple[int, ...], sources: list[int], first: int) -> None:
        """Copy a sequence's keys and values at positions `sources` (ascending) to first, first + 1, ...: a token
        tree's accepted branch, moved to where the sequence goes on (across pages as it may lie)."""
        if self._cache is None:
            raise RuntimeError("the engine is not built: load() and allocate() come first")
        size = self.page_size
        if any(p >= len(pages) * size for p in sources) or first + len(sources) > len(pages) * size:
            raise PageError(f"moving positions {sources} to {first} leaves the sequence's {len(pages)} pages")
        src_pages, src_offsets = self._ids([pages[p // size] for p in sources]), self._ids([p % size for p in sources])
        dst = range(first, first + len(sources))
        dst_pages, dst_offsets = self._ids([pages[p // size] for p in dst]), self._ids([p % size for p in dst])
        for store in (self._cache.keys, self._cache.values):  # [layers, pages, kv heads, page_size, head_dim]
            moved = store[:, src_pages, :, src_offsets]  # a copy: the sources are read before anything is written
            store[:, dst_pages, :, dst_offsets] = moved

    def _ids(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def self_check(self) -> str | None:
        """Checks the model on the cache's first pages (left dirty: their owner holds nothing in them yet).

        Raises SelfCheckFailed when the model is broken: non-finite logits, or a prompt
        prefilled at once and token by token giving logits further apart than rounding.
        Returns None when its steps are batch invariant (modeling/kernels/invariance.py): every
        linear layer over every row count a step can have, and the whole model, whose
        prefill rows must then be bit for bit its decode steps'; else why not.
        """
        model = self._model
        if model is None:
            raise RuntimeError("the engine is not built: load() comes first")
        prompt = [(7 * i + 3) % self.config.vocab_size for i in range(_SELF_CHECK_LEN)]
        pages = tuple(range(pages_for(len(prompt), self.page_size)))
        whole = self.forward([SeqSpan(pages, 0, prompt, len(prompt))])  # [12, V]
        stepped = torch.cat(
            [self.forward([SeqSpan(pages, position, [prompt[position]], 1)]) for position in range(len(prompt))]
        )
        if not torch.isfinite(whole).all():
            raise SelfCheckFailed("the model produced non-finite logits")
        # Different batch shapes may round differently; a broken cache is off by the logits' own scale.
        relative = 1e-4 if self.dtype == torch.float32 else 0.04
        tolerance = relative * float(whole.abs().max())
        gap = float((whole - stepped).abs().max())
        if gap > tolerance:
            raise SelfCheckFailed(f"prefill and step-by-step logits differ by {gap:.4g} (> {tolerance})")
        pack = model.linear.pack if isinstance(model.linear, PackedLinear) else _unchanged
        depths = {self.config.hidden_size, self.config.intermediate_size, self.config.num_heads * self.config.head_dim}
        problem = linear_rows_problem(model.linear, pack, depths, self.dtype, self.device)
        for format_name in sorted(self._block_formats):
            if problem is None and isinstance(model.linear, PackedLinear):
                problem = linear_rows_problem(
                    model.linear, block_probe(model.linear, format_name), depths, self.dtype, self.device
                )
        if problem is None and not torch.equal(whole, stepped):
            differ = int((whole != stepped).any(dim=-1).nonzero()[0])
            problem = f"a prompt prefilled at once and token by token gives different logits at position {differ}"
        return problem


def _unchanged(weight: torch.Tensor) -> torch.Tensor:
    return weight

"""The choices of --quantization, importable without torch (modeling/kernels/blocks.py serves them)."""

GGUF_QUANTIZATIONS = ("q4_1", "q8_0", "q4_k")  # a GGUF file's own blocks
QUANTIZATIONS = ("none", *GGUF_QUANTIZATIONS, "int8")
QUANTIZATION_HELP = (
    "none (default); q4_1, q8_0 or q4_k: serve a model converted from a GGUF file whose projections are Q4_1 (the "
    "embedded default's), Q8_0 or Q4_K from that file's own blocks, widened inside the CPU kernel, and its other "
    "tensors of those types too (the rest dense); int8: any model's projections and LM head quantized as it loads "
    "to int8 with one scale per output channel (weight-only: activations and sums stay in the serving dtype)"
)

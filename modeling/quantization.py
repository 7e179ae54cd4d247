"""The choices of --quantization, importable without torch (modeling/quantized.py serves them)."""

GGUF_QUANTIZATIONS = ("q4_1", "q8_0")  # a GGUF file's own blocks
QUANTIZATIONS = ("none", *GGUF_QUANTIZATIONS, "int8")
QUANTIZATION_HELP = (
    "none (default); q4_1 or q8_0: serve a model converted from a GGUF file whose projections are Q4_1 (the embedded "
    "default's) or Q8_0 from that file's own blocks, widened inside the CPU kernel, its other Q4_1 and Q8_0 tensors "
    "too; int8: any model's projections and LM head quantized as it loads to int8 with one scale per output channel "
    "(weight-only: activations and sums stay in the serving dtype)")

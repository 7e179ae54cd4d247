"""The choices of --quantization, importable without torch (modeling/quantized.py serves them)."""

QUANTIZATIONS = ("none", "q4_1", "q8_0")
QUANTIZATION_HELP = (
    "none (default), q4_1 or q8_0: serve a model converted from a GGUF file whose projections are Q4_1 (the embedded "
    "default's) or Q8_0 from that file's own blocks, widened inside the CPU kernel; its other Q4_1 and Q8_0 tensors "
    "are served as blocks too")

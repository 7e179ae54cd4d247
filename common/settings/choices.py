"""The names a setting may take, where the services that act on them and the table both need them (torch-free)."""

from __future__ import annotations

AUTO = "auto"  # --dtype, --quantization: decided by the process for its model and device
DTYPES = ("float32", "bfloat16", "float16")
SPECULATION_POLICIES = ("goodput", "fixed")
SCHEDULING_POLICIES = ("fcfs", "priority")
CACHE_SCOPES = ("global", "salt", "tenant")  # the gateway's --prefix-cache-scope (gateway/cache_scope.py)
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # gateway/reasoning.py
TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # gateway/tools.py
CUDA_GRAPHS = ("on", "off", "fallback")  # a worker's --cuda-graphs besides auto (modeling/model/graphs.py)
SUFFIX_SCOPES = ("tenant", "global", "request")  # the draft service's --suffix-scope (draft_service/traffic.py)

"""The device check: one run that serves the embedded model's shape on a GPU, with and without CUDA graphs, and
writes one JSON summary of what held (`bench/device_check.sh` is the entry point; `--dry-run` runs the same parts
on the CPU at small sizes, through the recording graph backend).

Each part is timed, catches its own failure, and is skipped, and said so, once the time budget cannot hold it:
environment, model, greedy (against Hugging Face's `generate`, graphs on and off), capture fault, throughput (no
draft, the default draft, graphs off) and kill (the target worker SIGKILLed mid-stream, then restarted).

- `report`: the sizes (device and dry run), the budget, the JSON summary, running one part.
- `model`: the environment, the model served (given, the store's, or random weights of its shape), Hugging Face's
  greedy references and the comparison with them.
- `stacks`: a served stack and its gRPC client, the sessions (one stack, its parts), waiting on a process's state.
- `parts`: the parts run on a stack: greedy, capture fault, throughput, kill.
- `main`: the command line and the order of the check.
"""

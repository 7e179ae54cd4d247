"""What every model process (target worker, draft service) is configured with:
who it is, where its scheduler is, where it runs, its deadlines."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common.arguments import not_positive_problem
from common.cpus import usable_cpus
from common.transport import Transport
from common.transport import from_arguments as transport_from_arguments


@dataclass(frozen=True)
class ProcessConfig:
    worker_id: str  # its id at the scheduler (and the SPECSERVE_FAULT entries meant for it)
    scheduler_address: str  # the scheduler's worker socket, e.g. tcp://127.0.0.1:5556
    device: str  # "cpu" or "cuda:N"
    dtype: str
    heartbeat_interval_s: float
    phase_timeout_s: float  # a start-up phase running longer ends the process (FAILED)
    step_timeout_s: float  # a step (proposal) running longer ends the process (FAILED)
    drain_timeout_s: float  # after SIGTERM, how long work in flight may take before the process stops anyway
    num_threads: int  # threads to compute on; 0: the cores it may use (CPU), torch's default (GPU)
    status_file: Path | None  # the current lifecycle state is written here (container health checks)
    transport: Transport = Transport(None)  # its keys (common/transport.py), or insecure loopback

    def compute_threads(self) -> int:
        """The threads to compute on: num_threads, or on a CPU the cores this process may use; 0 on a GPU: torch's
        default."""
        if self.num_threads > 0 or self.device != "cpu":
            return self.num_threads
        return usable_cpus()


def check_process_arguments(args: argparse.Namespace) -> None:
    """Raises ValueError naming the setting."""
    if problem := not_positive_problem(
        args, ("heartbeat_interval_s", "phase_timeout_s", "step_timeout_s", "drain_timeout_s")
    ):
        raise ValueError(problem)
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        raise ValueError(f"--device must be 'cpu' or 'cuda:N', got {args.device!r}")


def from_arguments(args: argparse.Namespace) -> ProcessConfig:
    """Raises ValueError naming the setting."""
    check_process_arguments(args)
    secured = transport_from_arguments(args, "worker", (("--scheduler-address", args.scheduler_address),))
    return ProcessConfig(
        worker_id=args.worker_id,
        scheduler_address=args.scheduler_address,
        device=args.device,
        dtype=args.dtype,
        heartbeat_interval_s=args.heartbeat_interval_s,
        phase_timeout_s=args.phase_timeout_s,
        step_timeout_s=args.step_timeout_s,
        drain_timeout_s=args.drain_timeout_s,
        num_threads=args.num_threads,
        status_file=args.status_file,
        transport=secured,
    )

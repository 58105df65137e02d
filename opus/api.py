"""The Python API: ``opus.run`` runs a pipeline as ``opus run`` does; ``opus.load`` loads what a run made.

::

    import opus

    summary = opus.run("pipelines/smoke.yaml", set={"workload.batch_size": 8}, run_dir="runs/night")
    lm = opus.load("runs/night")                 # its last export, else its final checkpoint
    print(lm.generate("def main():\\n", max_new_tokens=32))

The top of the rooms: it drives the command line's own run (``opus.cli.run.execute``), so a run
started here and one started by ``opus run`` are the same run. Imported by ``opus.run``/``opus.load``
only when called: ``import opus`` stays light.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opus.errors import InputError


def overrides(values: Mapping[str, Any] | Iterable[str] | str | None) -> list[str]:
    """``set=`` as ``--set`` strings: a mapping's values are Python values (written as JSON, which the
    override reads as YAML, so ``{"run.decisions_from": "runs/a"}`` stays a string); strings are
    ``key=value`` exactly as on the command line (the value is YAML)."""
    if values is None:
        return []
    if isinstance(values, str):
        return [values]
    if isinstance(values, Mapping):
        return [f"{key}={json.dumps(value, default=str)}" for key, value in values.items()]
    return [str(item) for item in values]


def run(pipeline: str | Path, set: Mapping[str, Any] | Iterable[str] | None = None,
        run_dir: str | Path | None = None, *, runs_dir: str | Path = "runs",
        decisions_from: str | Path | None = None, quiet: bool = False, commit: bool = False) -> dict[str, Any]:
    """Run ``pipeline`` (or continue the run in ``run_dir``) as ``opus run`` does; returns its summary.

    ``set``: overrides, as ``--set`` (``{"workload.batch_size": 8}`` or ``["workload.batch_size=8"]``).
    ``run_dir``: default ``runs_dir/<name>-<time>``. ``quiet``: no progress display (the outcome lines
    are printed still, as with ``opus run --quiet``). A pipeline that is invalid, or fails a check before
    anything runs, raises the OpusError the command line prints (``InputError``, ``ModelLoadError``...);
    a run that fails or is rolled back is a summary whose ``status`` says so (``finished``, ``degraded``,
    ``failed``, ``interrupted``), with its ``reasons``.
    """
    from opus.cli.run import decisions_override, default_run_dir, execute
    from opus.pipeline.spec import load_pipeline

    pipeline = Path(pipeline)
    replay = decisions_override(pipeline, Path(decisions_from) if decisions_from else None)
    loaded = load_pipeline(pipeline, [*overrides(set), *replay])
    target = Path(run_dir) if run_dir else default_run_dir(loaded, Path(runs_dir))
    return execute(loaded, target, quiet, commit)


@dataclass
class LoadedModel:
    """A model Opus made, ready to run: ``model`` (an ``nn.Module``), ``tokenizer`` (None when the model
    has none), the ``state`` it was rebuilt from (source + recipe) and the directory it came from."""

    model: Any
    tokenizer: Any
    state: dict[str, Any]
    path: Path
    eager: bool = False
    _factory: Any = field(default=None, repr=False)

    @property
    def kv_cache(self) -> dict[str, Any] | None:
        """The KV cache the run chose (its ``kv_cache`` recipe step), or None: the growing cache; with
        ``eager``, the same cache with its decode steps run eagerly (no compile)."""
        from opus.kv.choice import cache_config_from_recipe

        config = cache_config_from_recipe(self.state.get("recipe"))
        if self.eager and config and config.get("compile"):
            config = {**config, "compile": False}
            config.pop("compile_prefill", None)  # nothing compiled, nothing padded
        return config

    def generate(self, prompt: str | list[str], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_at_eos: bool = True) -> str | list[str]:
        """The continuation of ``prompt`` (a string, or a list: a list back), without the prompt.

        Generated as the run measured the model: Opus's engine (``opus.runtime.engine.generate``), one
        prefill then one decode step per token through the KV cache the run chose. ``temperature`` 0 is
        greedy; above it, sampling with ``top_k``/``top_p`` from ``seed``. Prompts of the same token
        length run as one batch. ``stop_at_eos``: the text ends before the first end-of-sequence token.
        """
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        rows = self.generate_ids([self.encode(t) for t in texts], max_new_tokens, temperature, top_k, top_p, seed)
        eos = self.eos_ids() if stop_at_eos else set()
        out = []
        for ids in rows:
            end = next((i for i, t in enumerate(ids) if t in eos), len(ids))
            out.append(self.tokenizer.decode(ids[:end], skip_special_tokens=True))
        return out[0] if isinstance(prompt, str) else out

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InputError("the model has no tokenizer: pass token ids to generate_ids", file=str(self.path))
        ids = list(self.tokenizer(text)["input_ids"])
        if not ids:
            raise InputError(f"the prompt {text!r} encodes to no token", file=str(self.path))
        return ids

    def eos_ids(self) -> set[int]:
        from opus.runtime.engine import eos_ids

        return set(eos_ids(self.tokenizer, self.model))

    def generate_ids(self, prompts: list[list[int]], max_new_tokens: int = 64, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> list[list[int]]:
        """``max_new_tokens`` new token ids per prompt (lists of ids), in the prompts' order."""
        import torch

        from opus.kv.cache import cache_factory
        from opus.runtime.engine import Sampling, generate

        if self._factory is None:
            self._factory = cache_factory(self.model, self.kv_cache)
        sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed) if temperature > 0 else None
        out: list[list[int]] = [[] for _ in prompts]
        by_length: dict[int, list[int]] = {}
        for index, ids in enumerate(prompts):
            by_length.setdefault(len(ids), []).append(index)
        for indices in by_length.values():
            batch = torch.tensor([prompts[i] for i in indices], dtype=torch.long)
            result = generate(self.model, batch, max_new_tokens, self._factory, sampling)
            for row, index in enumerate(indices):
                out[index] = result.tokens[row].tolist()
        return out


def load(path: str | Path, device: str | None = None, eager: bool = False, trust_code: bool = False) -> LoadedModel:
    """The model of an export directory, or of a run directory: its last export stage's export, else its
    final checkpoint (the last kept stage's model state). ``device``: default the one it was made for.
    ``eager``: decode steps run eagerly whatever the run chose (as ``opus serve --eager``): no compile
    for each new batch or length, slower steps.

    ``trust_code``: a run or an export may come from anyone; code named in its files (a model factory, a
    module that is not Opus's own) runs only when you pass True, as transformers' ``trust_remote_code``,
    and then only from installed packages, never from the directory itself (opus.trust).

    Not a directory of either kind, a run with nothing kept yet, or code it names without ``trust_code``:
    ``InputError``.
    """
    from opus.made import load_made

    loaded, origin = load_made(Path(path), device, trust_code)
    return LoadedModel(loaded.model, loaded.tokenizer, loaded.state, origin, eager)

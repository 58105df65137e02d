"""A tiny bench project: a Llama saved by transformers with a byte-level BPE tokenizer, text, a pipeline."""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = ["def", "main", "import", "os", "sys", "print", "return", "value", "self", "class", "if", "else",
         "for", "in", "range", "list", "dict", "None", "True", "False"]
PIPELINE = """
name: tinybench
model: {hf: model}
data:
  evaluation: {files: ["data/*.txt"], samples: 2, seq_len: 16}
workload: {batch_size: 2, input_len: 8, output_len: 3, warmup: 0, repeats: 1}
run: {threads: 1}
stages:
  - id: baseline
    uses: baseline
    with: {fidelity_prompts: 2, fidelity_prompt_len: 8, fidelity_tokens: 4}
  - id: check
    uses: eval
    needs: baseline
    gate:
      perplexity: {max_increase: 0.05}
"""


def make_project(root: Path) -> Path:
    """``root/pipeline.yaml`` with ``model/`` (HF Llama + tokenizer.json) and ``data/*.txt``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    g = torch.Generator().manual_seed(0)
    docs = [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (120,), generator=g).tolist()) for _ in range(2)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(root / "model")
    torch.manual_seed(0)
    # Shapes the int4 kernel takes with group size 32 (in % 32, out % 16) and llama.cpp's Q8_0 (% 32).
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(root / "model")
    (root / "data").mkdir(exist_ok=True)
    for index, doc in enumerate(docs):
        (root / "data" / f"part{index}.txt").write_text(doc)
    (root / "pipeline.yaml").write_text(PIPELINE)
    return root / "pipeline.yaml"


def kv_only_run(pipeline: Path, run: Path) -> Path:
    """``run``: a finished run of ``pipeline`` whose one kept stage, ``kv``, chose the growing cache, its
    checkpoint written by the runner's own writer (state, result, manifest)."""
    from opus.atomic import write_json
    from opus.kv.choice import kv_cache_step
    from opus.pipeline.checkpoint import write_checkpoint
    from opus.pipeline.contracts import ResultRecord

    stage = run / "stages" / "01-kv"
    stage.mkdir(parents=True)
    write_json(run / "run.json", {"run_id": run.name, "base_dir": str(pipeline.parent), "name": "tinybench",
                                  "starts": [1.0], "pipeline": str(pipeline)})
    (run / "pipeline.yaml").write_text(pipeline.read_text())
    state = {"source": {"hf": "model"}, "recipe": [kv_cache_step({"kind": "growing"}).as_json()], "tensors": None,
             "aliases": {}}
    write_checkpoint(stage, key="kv", stage_id="kv", uses="kv_config", state=state, result=ResultRecord())
    write_json(run / "summary.json", {"status": "finished", "stages": [
        {"id": "kv", "status": "done", "dir": str(stage), "metrics": {}}]})
    return run

"""llama.cpp's tensor names for the decoder's: one table, read by the GGUF reader and the GGUF writer.

``opus.models.gguf_file`` maps a file's names to the decoder's; ``opus.export.gguf_mix`` maps the
decoder's back, through the same rows, so a file Opus writes loads back in Opus by construction.
Names are llama.cpp's (``gguf.constants.TENSOR_NAMES``), per block ``blk.N.<name>.weight|bias``.
"""

from __future__ import annotations

from opus.models.layout import DECODER as _D

BLOCK = {  # llama.cpp's per-block tensor names -> the decoder's paths inside a layer
    "attn_norm": _D.input_norm, "ffn_norm": _D.post_attention_norm,
    "attn_q": f"{_D.attention}.{_D.q_proj}", "attn_k": f"{_D.attention}.{_D.k_proj}",
    "attn_v": f"{_D.attention}.{_D.v_proj}", "attn_output": f"{_D.attention}.{_D.o_proj}",
    "attn_q_norm": f"{_D.attention}.{_D.q_norm}", "attn_k_norm": f"{_D.attention}.{_D.k_norm}",
    "ffn_gate": f"{_D.mlp}.{_D.gate_proj}", "ffn_up": f"{_D.mlp}.{_D.up_proj}", "ffn_down": f"{_D.mlp}.{_D.down_proj}",
    "ffn_gate_inp": f"{_D.mlp}.{_D.router}",
    "ffn_gate_shexp": f"{_D.mlp}.{_D.shared_expert}.{_D.gate_proj}",
    "ffn_up_shexp": f"{_D.mlp}.{_D.shared_expert}.{_D.up_proj}",
    "ffn_down_shexp": f"{_D.mlp}.{_D.shared_expert}.{_D.down_proj}",
    "ffn_gate_inp_shexp": f"{_D.mlp}.{_D.shared_expert_gate}",
}
# The experts of one layer stacked into one [experts, out, in] tensor per projection.
EXPERT_STACKS = {"ffn_gate_exps": _D.gate_proj, "ffn_up_exps": _D.up_proj, "ffn_down_exps": _D.down_proj}
PER_EXPERT = {"ffn_gate": _D.gate_proj, "ffn_up": _D.up_proj, "ffn_down": _D.down_proj}  # legacy Mixtral files
TOP = {"token_embd.weight": f"{_D.embedding}.weight", "output_norm.weight": f"{_D.final_norm}.weight",
       "output.weight": f"{_D.lm_head}.weight"}
# Q/K rows permuted for llama.cpp's interleaved RoPE (families with ``gguf_permuted_qk``).
PERMUTED = {"attn_q": "num_heads", "attn_k": "num_kv_heads"}  # block name -> the ModelConfig head count
VECTOR = {"ffn_gate_inp_shexp"}  # stored as a vector [in], the decoder's linear is [1, in]

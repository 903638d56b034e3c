"""Write a tiny Llama and its byte-level BPE tokenizer as a GGUF file, the way llama.cpp's
converter lays it out, so the GGUF import can be tested without downloading a model.

Follows the GGUF conventions transformers reads back: tensor names ``blk.N.attn_q`` etc., the
q and k rows permuted for llama.cpp's rotary layout (transformers undoes this on load), the
tokenizer as ``gpt2``-style tokens + merges, and the chat template as metadata. Large matrices
can be stored quantised (Q8_0), which transformers dequantises on load.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: within each head, rows (i, i + D/2) become neighbours."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def gguf_tensors(model: PreTrainedModel) -> dict[str, np.ndarray]:
    """GGUF name → float32 array for a Llama model."""
    config, state = model.config, {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tensors = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"],
    }
    if not config.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    for layer in range(config.num_hidden_layers):
        for hf_name, gguf_name in LAYER_NAMES.items():
            weight = state[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weight = llama_cpp_permute(weight, config.num_attention_heads)
            elif gguf_name == "attn_k":
                weight = llama_cpp_permute(weight, config.num_key_value_heads)
            tensors[f"blk.{layer}.{gguf_name}.weight"] = weight
    return tensors


def write_tiny_gguf(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path: str | Path, *, quantize: bool = True
) -> Path:
    """Write ``model`` (a LlamaForCausalLM) and ``tokenizer`` (byte-level BPE) to ``path``."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("posttrain tiny llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)

    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = backend["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {t.content for t in tokenizer.added_tokens_decoder.values()}
    merges = [" ".join(m) if isinstance(m, list) else m for m in backend["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)

    for name, array in gguf_tensors(model).items():
        if quantize and array.ndim == 2 and array.shape[1] % 32 == 0:
            data = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def same_weights(a: PreTrainedModel, b: PreTrainedModel) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)

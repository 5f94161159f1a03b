"""Write a tiny llama-architecture GGUF with random weights, for real llama-server tests.

A 2-layer, 64-wide model with a byte-level SentencePiece vocabulary (one
token per byte plus <unk>, <s>, </s>): about 350 KB, loads and generates in
well under a second on a CPU. `architecture="kev"` writes the same file under
an architecture llama.cpp does not know, which makes llama-server exit 1 with
"unknown model architecture: 'kev'" (the start failure the planner parks).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

HEADS = 4
CONTEXT = 8192


def _vocab() -> tuple[list[bytes], list[float], list[int]]:
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{b:02X}>".encode() for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    return tokens, [0.0] * len(tokens), [int(t) for t in types]


def write_tiny_gguf(
    path: Path,
    architecture: str = "llama",
    seed: int = 0,
    width: int = 64,
    layers: int = 2,
    split_max_tensors: int = 0,
) -> Path:
    """Write the model to `path` and return it. Larger `width`/`layers` make a
    slower model (512 x 8 is ~40 MB and streams for seconds on two cores).
    `split_max_tensors` > 0 writes a split model instead, as llama.cpp's gguf-split
    does (the gguf package's writer: `<stem>-00001-of-0000N.gguf`..., the metadata
    in the first, `split.*` keys in each), and returns its first shard (21 tensors:
    8 per shard makes 3)."""
    EMBED, LAYERS, FFN = width, layers, 2 * width
    rng = np.random.default_rng(seed)
    tokens, scores, types = _vocab()
    writer = gguf.GGUFWriter(str(path), architecture, split_max_tensors=split_max_tensors)
    writer.add_name("llmgw-tiny-test")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(EMBED)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(EMBED // HEADS)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    vocab = len(tokens)
    tensor("token_embd.weight", vocab, EMBED)
    writer.add_tensor("output_norm.weight", np.ones(EMBED, dtype=np.float32))
    tensor("output.weight", vocab, EMBED)
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(EMBED, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(EMBED, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensor(f"blk.{i}.{name}.weight", EMBED, EMBED)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, EMBED)
        tensor(f"blk.{i}.ffn_up.weight", FFN, EMBED)
        tensor(f"blk.{i}.ffn_down.weight", EMBED, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(path)[0]

"""Write a GGUF file whose header describes a large model and whose weights are a hole.

The header is real (written by the `gguf` package: a llama architecture with the
shape of a 70B model by default); the tensor data is a sparse extent of zeros, so
a "140 GB" file costs no disk. It serves the tests that must show `planner apply`
judges a model from its header alone: any read past `header_size` would be a
read of the weights. It cannot be loaded (the weights are zeros, and too large).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

VOCAB = 32000


def write_sparse_gguf(
    path: Path,
    layers: int = 80,
    width: int = 8192,
    heads: int = 64,
    kv_heads: int = 8,
    ffn: int = 28672,
    context: int = 8192,
) -> int:
    """Write the file; returns its header's size (bytes before the tensor data)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(context)
    writer.add_embedding_length(width)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}".encode() for i in range(VOCAB)])
    head = width // heads

    def tensor(name: str, *shape: int) -> None:
        count = int(np.prod(shape))
        writer.add_tensor_info(
            name, shape, np.dtype(np.float16), count * 2, raw_dtype=gguf.GGMLQuantizationType.F16
        )

    tensor("token_embd.weight", VOCAB, width)
    tensor("output.weight", VOCAB, width)
    for i in range(layers):
        tensor(f"blk.{i}.attn_q.weight", width, width)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head, width)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head, width)
        tensor(f"blk.{i}.attn_output.weight", width, width)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, width)
        tensor(f"blk.{i}.ffn_up.weight", ffn, width)
        tensor(f"blk.{i}.ffn_down.weight", width, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    header = gguf.GGUFWriter.ggml_pad(path.stat().st_size, writer.data_alignment)
    data = sum(
        gguf.GGUFWriter.ggml_pad(info.nbytes, writer.data_alignment)
        for shard in writer.tensors
        for info in shard.values()
    )
    with path.open("r+b") as f:
        f.truncate(header + data)  # sparse: the weights take no disk
    return header

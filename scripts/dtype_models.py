"""Build the two 5-node text models of the input-dtype test and the numpy reference.

Gather(table[30522,4], input_ids) * Unsqueeze(Cast(attention_mask, float)) -> MatMul with a
4x4 identity named /proj/MatMul, once with INT32 inputs and once with INT64. Writes
model_int32.onnx, model_int64.onnx, inputs.npz (two batches of the texts' ids and mask along axis
0), no_mask.npz (the ids only), float_ids.npz (ids + 0.5) and ref.json (the lhs non-zeros numpy finds for the texts,
tokenized with Hugging Face tokenizers and padded to --seq) into --out.

    python3 dtype_models.py --tokenizer tokenizer.json --seq 8 --out DIR TEXT...
"""
import argparse
import json
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer


def model(elem):
    rng = np.random.default_rng(0)
    table = rng.standard_normal((30522, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["emb"], name="/emb/Gather"),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT, name="/mask/Cast"),
        helper.make_node("Unsqueeze", ["maskf", "axes"], ["mask3"], name="/mask/Unsqueeze"),
        helper.make_node("Mul", ["emb", "mask3"], ["x"], name="/mask/Mul"),
        helper.make_node("MatMul", ["x", "proj"], ["y"], name="/proj/MatMul"),
    ]
    inits = [
        numpy_helper.from_array(table, "table"),
        numpy_helper.from_array(np.eye(4, dtype=np.float32), "proj"),
        numpy_helper.from_array(np.array([-1], dtype=np.int64), "axes"),
    ]
    inputs = [
        helper.make_tensor_value_info("input_ids", elem, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", elem, ["batch_size", "sequence_length"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", "sequence_length", 4])]
    graph = helper.make_graph(nodes, "dtype_test", inputs, outputs, inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(m)
    return m, table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("texts", nargs="+")
    a = ap.parse_args()
    for name, elem in [("model_int32.onnx", TensorProto.INT32), ("model_int64.onnx", TensorProto.INT64)]:
        m, table = model(elem)
        onnx.save(m, os.path.join(a.out, name))
    tok = Tokenizer.from_file(a.tokenizer)
    tok.enable_truncation(a.seq)
    tok.enable_padding(length=a.seq, pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
    enc = tok.encode_batch(a.texts)
    ids = np.array([e.ids for e in enc])
    mask = np.array([e.attention_mask for e in enc])
    lhs = table[ids] * mask[..., None].astype(np.float32)
    # The same batch twice along axis 0, int32 as the int32 model declares; and one lacking the mask.
    np.savez(os.path.join(a.out, "inputs.npz"), input_ids=np.stack([ids, ids]).astype(np.int32), attention_mask=np.stack([mask, mask]).astype(np.int32))
    np.savez(os.path.join(a.out, "no_mask.npz"), input_ids=np.stack([ids, ids]).astype(np.int32))
    # Ids that are not integers: an int input cannot hold them.
    np.savez(os.path.join(a.out, "float_ids.npz"), input_ids=np.stack([ids, ids]).astype(np.float64) + 0.5, attention_mask=np.stack([mask, mask]).astype(np.int32))
    json.dump({"lhs_nnz": int(np.count_nonzero(lhs)), "tokens": int(mask.sum())}, open(os.path.join(a.out, "ref.json"), "w"))


if __name__ == "__main__":
    main()

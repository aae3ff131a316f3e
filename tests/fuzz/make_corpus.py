#!/usr/bin/env python3
"""Writes the checked-in seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/).

score_request: ScoreRequest messages (text format encoded with `protoc --encode`), one per request
mode and edge shape, valid and invalid, using the heads the fuzzer fakes (policy V=1000 H=16,
teacher V=1000 H=8, tiny V=17 H=4 version 7). safetensors: a valid file of several dtypes, edge
files (empty, scalar, zero-size tensor, metadata) and truncated / corrupted variants.

Run from anywhere: python3 tests/fuzz/make_corpus.py (needs protoc on PATH).
"""
import json
import os
import struct
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.join(HERE, "..", "..", "proto")
CORPUS = os.path.join(HERE, "corpus")


def esc(b: bytes) -> str:
    return "".join("\\%03o" % x for x in b)


def tensor(dtype, shape, data: bytes) -> str:
    dims = " ".join("shape: %d" % d for d in shape)
    return '{ dtype: %s %s data: "%s" }' % (dtype, dims, esc(data))


def f32(vals):
    return struct.pack("<%df" % len(vals), *vals)


def bf16(vals):
    return b"".join(struct.pack("<f", v)[2:] for v in vals)


def i32(vals):
    return struct.pack("<%di" % len(vals), *vals)


def i64(vals):
    return struct.pack("<%dq" % len(vals), *vals)


def seq(n, scale=0.1):
    return [((i * 37) % 23 - 11) * scale for i in range(n)]


REQUESTS = {
    "hidden_bf16_logprobs_entropy": 'head: "policy" hidden: %s target_ids: %s entropy: true'
    % (tensor("BFLOAT16", [4, 16], bf16(seq(64))), tensor("INT32", [4], i32([1, 999, 0, 500]))),
    "hidden_fp32_reference_kl_jsd_topk_sums": (
        'request_id: "r1" head: "policy" hidden: %s reference_head: "teacher" reference_hidden: %s '
        "target_ids: %s ignore_index: -100 top_k: 5 forward_kl: true reverse_kl: true "
        "reference_entropy: true jsd_beta: 0.5 temperature: 0.7 reference_temperature: 1.3 "
        "sequence_lengths: 1 sequence_lengths: 1"
        % (tensor("FLOAT32", [2, 16], f32(seq(32))), tensor("BFLOAT16", [2, 8], bf16(seq(16))),
           tensor("INT64", [2, 3], i64([5, -100, 7, 0, 999, -100])))),
    "logits_fp32_topk_all": 'logits: %s target_ids: %s top_k: 17 temperature: 0.5 entropy: true'
    % (tensor("FLOAT32", [3, 17], f32(seq(51))), tensor("INT32", [3], i32([0, 16, -100]))),
    "logits_fp16_reference_bf16_reverse_kl": 'logits: %s reference_logits: %s reverse_kl: true'
    % (tensor("FLOAT16", [2, 5], b"\x00\x3c" * 10), tensor("BFLOAT16", [2, 5], bf16(seq(10)))),
    "logits_masked_neg_inf": 'logits: %s entropy: true'
    % tensor("FLOAT32", [1, 4], f32([float("-inf"), 0.0, 1.0, float("-inf")])),
    "zero_rows": 'head: "policy" hidden: %s target_ids: %s entropy: true sequence_lengths: 0'
    % (tensor("BFLOAT16", [0, 16], b""), tensor("INT32", [0], b"")),
    "version_pin_ok": 'head: "tiny" head_version: 7 hidden: %s top_k: 3'
    % tensor("FLOAT32", [1, 4], f32([1, 2, 3, 4])),
    "version_pin_mismatch": 'head: "tiny" head_version: 8 hidden: %s top_k: 3'
    % tensor("FLOAT32", [1, 4], f32([1, 2, 3, 4])),
    "unknown_head": 'head: "nosuch" hidden: %s entropy: true'
    % tensor("FLOAT32", [1, 4], f32([1, 2, 3, 4])),
    "hidden_rank3": 'head: "tiny" hidden: %s entropy: true'
    % tensor("FLOAT32", [1, 1, 4], f32([1, 2, 3, 4])),
    "hidden_bytes_mismatch": 'head: "tiny" hidden: %s entropy: true'
    % tensor("FLOAT32", [2, 4], f32([1, 2, 3, 4])),
    "hidden_width_mismatch": 'head: "policy" hidden: %s entropy: true'
    % tensor("FLOAT32", [1, 4], f32([1, 2, 3, 4])),
    "target_id_out_of_range": 'head: "tiny" hidden: %s target_ids: %s'
    % (tensor("FLOAT32", [1, 4], f32([1, 2, 3, 4])), tensor("INT64", [1], i64([17]))),
    "hidden_nan": 'head: "tiny" hidden: %s entropy: true'
    % tensor("BFLOAT16", [2, 4], bf16([0, 1, 2, 3, 4, 5, 6, 7])[:10] + b"\xc0\x7f" + b"\0" * 4),
    "huge_dims_overflow": 'head: "policy" hidden: %s entropy: true'
    % tensor("BFLOAT16", [4611686018427387904, 4], b""),
    "negative_dim": 'logits: %s entropy: true' % tensor("FLOAT32", [-1, 4], b""),
    "top_k_over_limit": 'logits: %s top_k: 65' % tensor("FLOAT32", [1, 4], f32([1, 2, 3, 4])),
    "kl_without_reference": 'logits: %s forward_kl: true' % tensor("FLOAT32", [1, 4], f32([1, 2, 3, 4])),
    "bad_temperature": 'logits: %s entropy: true temperature: -1' % tensor("FLOAT32", [1, 4], f32([1, 2, 3, 4])),
    "sequence_lengths_bad_sum": 'logits: %s entropy: true sequence_lengths: 3'
    % tensor("FLOAT32", [2, 2], f32([1, 2, 3, 4])),
}


def safetensors(tensors, metadata=None, align=True):
    header, data = {}, b""
    for name, (dtype, shape, payload) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    if metadata is not None:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    if align:
        h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + data


def main():
    out = os.path.join(CORPUS, "score_request")
    os.makedirs(out, exist_ok=True)
    for name, text in REQUESTS.items():
        binary = subprocess.run(
            ["protoc", "--proto_path=" + PROTO_ROOT, "--encode=logitserve.v1.ScoreRequest",
             "logitserve/v1/logitserve.proto"], input=text.encode(), check=True,
            capture_output=True).stdout
        with open(os.path.join(out, name + ".pb"), "wb") as f:
            f.write(binary)

    out = os.path.join(CORPUS, "safetensors")
    os.makedirs(out, exist_ok=True)
    valid = safetensors({
        "lm_head.weight": ("BF16", [4, 3], bf16(seq(12))),
        "bias": ("F32", [4], f32([0.5, -1, 2, 0])),
        "ids": ("I64", [2], i64([1, 2])),
        "flag": ("BOOL", [3], b"\x01\x00\x01"),
    }, metadata={"format": "pt"})
    seeds = {
        "valid_mixed": valid,
        "valid_scalar_and_empty": safetensors({"s": ("F64", [], struct.pack("<d", 3.5)),
                                               "e": ("F16", [0, 7], b"")}),
        "valid_no_tensors": safetensors({}, metadata={"k": "v"}),
        "valid_unaligned_header": safetensors({"x": ("U8", [5], b"abcde")}, align=False),
        "truncated_length": valid[:5],
        "truncated_header": valid[:30],
        "truncated_data": valid[:-3],
        "trailing_bytes": valid + b"\0\0",
        "overlapping": struct.pack("<Q", 112) + (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
                                                  b'"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}').ljust(112) + b"xyz",
        "huge_header_length": struct.pack("<Q", 2 ** 62) + b"{}",
        "sub_byte_dtype": safetensors({"f4": ("F4", [2], b"\x12")}),
    }
    for name, data in seeds.items():
        with open(os.path.join(out, name + ".safetensors"), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Writes the checkpoint fuzzer's seed corpus (tests/fuzz/checkpoint_corpus/):
whole safetensors files, good and hostile (truncations, huge lengths, deep
nesting, offsets that overlap, wrap or exceed, wrong dtypes, rank 9, a BOM,
trailing garbage, invalid UTF-8, lone surrogates, duplicate names, 50k
tensors). Run from anywhere: python3 tests/fuzz/make_checkpoint_corpus.py.
Deterministic."""
import json
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_corpus")


def file_of(header, data=b"", pad=True):
    if not isinstance(header, bytes):
        header = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def t(dtype="F32", shape=(1,), offsets=(0, 4)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


GOOD = {"a": t(), "b": t("U8", (2, 3), (4, 10)), "__metadata__": {"k": "v"}}
DEVBRIDGE = {"__metadata__": {"format": "devbridge-checkpoint", "format_version": "1", "generation": "3",
                              "checksum": "crc32:" + "0" * 8, "dtypes": json.dumps({"w": "float32"})},
             "w": t("F32", (2, 2), (0, 16))}
ONE = json.dumps({"a": t()}, separators=(",", ":")).encode()

seeds = {
    "good": file_of(GOOD, bytes(10)),
    "good_devbridge": file_of(DEVBRIDGE, bytes(16)),
    "good_sha256": file_of({**DEVBRIDGE, "__metadata__": {**DEVBRIDGE["__metadata__"], "checksum": "sha256:" + "a" * 64}},
                           bytes(16)),
    "good_every_dtype": file_of({f"x{i}": t(d, (1,), (8 * i, 8 * i + s)) if s == 8 else t(d, (8 // s,), (8 * i, 8 * i + 8))
                                 for i, (d, s) in enumerate([("BF16", 2), ("BOOL", 1), ("F16", 2), ("F32", 4), ("F64", 8),
                                                             ("F8_E4M3", 1), ("F8_E5M2", 1), ("I16", 2), ("I32", 4),
                                                             ("I64", 8), ("I8", 1), ("U16", 2), ("U32", 4), ("U64", 8),
                                                             ("U8", 1)])}, bytes(120)),
    "good_scalar": file_of({"s": t("I64", (), (0, 8))}, bytes(8)),
    "good_empty": file_of({}, b""),
    "good_escapes": file_of(b'{"\\u00e9\\ud83d\\ude00\\n\\"":' + json.dumps(t()).encode() + b'}', bytes(4)),
    "metadata_null": file_of(b'{"__metadata__":null,' + ONE[1:], bytes(4)),
    "empty_file": b"",
    "short_file": b"\x05\x00\x00",
    "truncated_header": file_of(GOOD, bytes(10))[:30],
    "truncated_data": file_of(GOOD, bytes(10))[:-3],
    "trailing_data": file_of(GOOD, bytes(13)),
    "huge_length": struct.pack("<Q", 2**63) + b"{}",
    "length_past_limit": struct.pack("<Q", 100_000_001) + b"{}",
    "length_past_file": struct.pack("<Q", 5000) + b"{}" * 4,
    "deep_nesting": file_of(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":' + b"[" * 200 + b"]" * 200 + b"}}",
                            bytes(4)),
    "deep_nesting_63": file_of(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":' + b"[" * 61 + b"]" * 61 + b"}}",
                               bytes(4)),
    "offsets_overlap": file_of({"a": t("U8", (4,), (0, 4)), "b": t("U8", (4,), (2, 6))}, bytes(6)),
    "offsets_gap": file_of({"a": t("U8", (4,), (0, 4)), "b": t("U8", (4,), (6, 10))}, bytes(10)),
    "offsets_wrap": file_of({"a": t("F32", (4,), (2**64 - 8, 2**64 + 8))}, bytes(16)),
    "offsets_reversed": file_of({"a": t("F32", (4,), (16, 0))}, bytes(16)),
    "offsets_exceed": file_of({"a": t("F32", (4,), (2**64 - 17, 2**64 - 1))}, bytes(16)),
    "offsets_one": file_of({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, bytes(4)),
    "shape_overflow": file_of({"a": t("F32", (2**32, 2**32, 4), (0, 16))}, bytes(16)),
    "shape_zero_overflow": file_of({"a": t("F32", (0, 2**63, 4), (0, 0))}),
    "shape_negative": file_of(b'{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}', bytes(4)),
    "shape_float": file_of(b'{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}', bytes(4)),
    "shape_exponent": file_of(b'{"a":{"dtype":"F32","shape":[1e0],"data_offsets":[0,4]}}', bytes(4)),
    "shape_string": file_of(b'{"a":{"dtype":"F32","shape":"4","data_offsets":[0,4]}}', bytes(4)),
    "rank_9": file_of({"a": t("F32", (1,) * 9, (0, 4))}, bytes(4)),
    "rank_8": file_of({"a": t("F32", (1,) * 8, (0, 4))}, bytes(4)),
    "dtype_unknown": file_of({"a": t("C64")}, bytes(4)),
    "dtype_number": file_of(b'{"a":{"dtype":5,"shape":[1],"data_offsets":[0,4]}}', bytes(4)),
    "dtype_list": file_of(b'{"a":{"dtype":["F32"],"shape":[1],"data_offsets":[0,4]}}', bytes(4)),
    "dtype_object": file_of(b'{"a":{"dtype":{"F32":1},"shape":[1],"data_offsets":[0,4]}}', bytes(4)),
    "dtype_missing": file_of(b'{"a":{"shape":[1],"data_offsets":[0,4]}}', bytes(4)),
    "dtypes_disagree": file_of({**DEVBRIDGE, "__metadata__": {**DEVBRIDGE["__metadata__"],
                                                              "dtypes": json.dumps({"w": "int32"})}}, bytes(16)),
    "dtypes_not_json": file_of({**DEVBRIDGE, "__metadata__": {**DEVBRIDGE["__metadata__"], "dtypes": "{"}}, bytes(16)),
    "checksum_malformed": file_of({**DEVBRIDGE, "__metadata__": {**DEVBRIDGE["__metadata__"], "checksum": "md5:1"}},
                                  bytes(16)),
    "metadata_list": file_of(b'{"__metadata__":[],' + ONE[1:], bytes(4)),
    "metadata_false": file_of(b'{"__metadata__":false,' + ONE[1:], bytes(4)),
    "metadata_number_value": file_of(b'{"__metadata__":{"k":1},' + ONE[1:], bytes(4)),
    "metadata_twice": file_of(b'{"__metadata__":{},"__metadata__":{},' + ONE[1:], bytes(4)),
    "metadata_duplicate_key": file_of(b'{"__metadata__":{"k":"1","k":"2"},' + ONE[1:], bytes(4)),
    "bom": file_of(b"\xef\xbb\xbf" + ONE, bytes(4), pad=False),
    "trailing_nul_garbage": file_of(ONE + b"\0garbage", bytes(4), pad=False),
    "trailing_second_value": file_of(ONE + b"{}", bytes(4), pad=False),
    "leading_and_trailing_space": file_of(b" \n" + ONE + b" \t\r\n", bytes(4), pad=False),
    "invalid_utf8_name": file_of(ONE.replace(b'"a"', b'"a\xff"'), bytes(4)),
    "overlong_utf8": file_of(ONE.replace(b'"a"', b'"\xc0\xaf"'), bytes(4)),
    "encoded_surrogate": file_of(ONE.replace(b'"a"', b'"\xed\xa0\x80"'), bytes(4)),
    "lone_surrogate_escape": file_of(ONE.replace(b'"a"', b'"\\ud800"'), bytes(4)),
    "lone_low_surrogate_escape": file_of(ONE.replace(b'"a"', b'"\\udc00x"'), bytes(4)),
    "control_char_in_name": file_of(ONE.replace(b'"a"', b'"a\nb"'), bytes(4)),
    "duplicate_name": file_of(b'{"a":' + json.dumps(t()).encode() + b',"a":' + json.dumps(t()).encode() + b"}", bytes(4)),
    "duplicate_field": file_of(b'{"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}', bytes(4)),
    "entry_not_object": file_of(b'{"a":[1,2]}'),
    "header_a_list": file_of(b"[1,2,3]"),
    "header_not_json": file_of(b"\xff" * 16),
    "nan": file_of(b'{"a":{"dtype":"F32","shape":[NaN],"data_offsets":[0,4]}}', bytes(4)),
    "leading_zero": file_of(b'{"a":{"dtype":"F32","shape":[01],"data_offsets":[0,4]}}', bytes(4)),
    "many_tensors_50k": file_of({f"t{i}": t("U8", (1,), (i, i + 1)) for i in range(50_000)}, bytes(50_000)),
}

os.makedirs(OUT, exist_ok=True)
for name, data in seeds.items():
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)
print(f"{len(seeds)} seeds in {OUT}")

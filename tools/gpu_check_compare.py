#!/usr/bin/env python3
"""Compares the float initializers of two ONNX files, for tools/gpu-check.sh.

Usage: gpu_check_compare.py A.onnx B.onnx RTOL ATOL

Reads the protobuf wire format directly (no onnx or numpy needed). Prints one
line: the tensor count, the largest absolute difference and where, and how
many values differ by more than ATOL + RTOL * |b|. Exit status 1 when any
does, or when the files hold different (or no) float weights.
"""
import struct, sys

def varint(b, i):
    r = s = 0
    while True:
        c = b[i]; i += 1; r |= (c & 0x7F) << s; s += 7
        if c < 0x80:
            return r, i

def fields(b):
    i = 0
    while i < len(b):
        key, i = varint(b, i)
        f, wt = key >> 3, key & 7
        if wt == 0:
            v, i = varint(b, i)
        elif wt == 1:
            v = b[i:i + 8]; i += 8
        elif wt == 2:
            n, i = varint(b, i); v = b[i:i + n]; i += n
        elif wt == 5:
            v = b[i:i + 4]; i += 4
        else:
            raise ValueError("wire type %d" % wt)
        yield f, wt, v

def weights(path):
    out = {}
    for f, wt, graph in fields(open(path, "rb").read()):
        if f != 7 or wt != 2:  # ModelProto.graph
            continue
        for g, gwt, t in fields(graph):
            if g != 5 or gwt != 2:  # GraphProto.initializer
                continue
            name, dtype, raw, floats = None, 1, None, []
            for k, kwt, v in fields(t):
                if k == 8: name = v.decode()
                elif k == 2: dtype = v
                elif k == 9: raw = v
                elif k == 4 and kwt == 2: floats += struct.unpack("<%df" % (len(v) // 4), v)
                elif k == 4: floats.append(struct.unpack("<f", v)[0])
                elif k == 14 and v == 1: raise ValueError("%s: external data" % name)
            if dtype == 1:
                out[name] = struct.unpack("<%df" % (len(raw) // 4), raw) if raw is not None else floats
    return out

a, b = weights(sys.argv[1]), weights(sys.argv[2])
rtol, atol = float(sys.argv[3]), float(sys.argv[4])
if set(a) != set(b) or not a:
    print("different weights: %d vs %d" % (len(a), len(b))); sys.exit(1)
worst, where, bad = 0.0, "", 0
for name in sorted(a):
    for x, y in zip(a[name], b[name]):
        d = abs(x - y)
        if d > worst: worst, where = d, name
        if d > atol + rtol * abs(y): bad += 1
print("%d tensors, max |diff| %.3g (%s), %d beyond rtol %g atol %g" % (len(a), worst, where, bad, rtol, atol))
sys.exit(1 if bad else 0)

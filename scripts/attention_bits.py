"""The attention kernels' outputs over 2,704 cases, saved so two builds can be compared bit for bit: cached_attention
(fp32 / bf16, head sizes 16 / 64 / 96 / 256, 1-5 query rows of 1-3 tokens, windows and sinks, keys in and out of
order, inf / NaN values and a -0 query), batched decode rows, and sparse layers (bf16 and d4 cold tiers) over a
prompt, chunks and decode steps.

LIB=<old build .so> PYTHONPATH=src python scripts/attention_bits.py dump old.pt
PYTHONPATH=src python scripts/attention_bits.py dump new.pt   (THREADS=1 for one thread)
python scripts/attention_bits.py compare old.pt new.pt
"""

import itertools
import os
import sys
from pathlib import Path

import torch

from kakeya_runtime.kv.compress import make_codec
from kakeya_runtime.kv.sparse import SparseLayerKV
from kakeya_runtime.kv.spec import DEFAULT_Q
from kakeya_runtime.models import native


def compare(a_path: str, b_path: str) -> None:
    a, b = torch.load(a_path), torch.load(b_path)
    assert a.keys() == b.keys(), "different case lists"

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)

    bad = [k for k in a if not torch.equal(bits(a[k]), bits(b[k]))]
    print(f"{len(a)} cases, {len(bad)} differ", bad[:10])
    sys.exit(1 if bad else 0)


def dump(path: str) -> None:
    if os.environ.get("LIB"):
        native.library_path = lambda: Path(os.environ["LIB"])
    print(native.load())
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    out: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(1)

    def rnd(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 2).to(dtype)

    heads = ((3, 3), (1, 4), (2, 1), (1, 2), (1, 5))  # (K/V heads, query rows per K/V head and token)
    grid = itertools.product((torch.bfloat16, torch.float32), (64, 256, 96, 16), heads, (1, 2, 3),
                             (1, 33, 100, 600, 1100), ((0, 0), (50, 4), (300, 0)), ("in", "perm"))
    for dtype, d, (hk, grp), t, s, (window, sink), order in grid:
        if d in (96, 16) and (s > 100 or hk == 3):
            continue
        q = rnd(1, hk, grp * t, d, dtype=dtype)
        k, v = rnd(1, hk, s, d, dtype=dtype), rnd(1, hk, s, d, dtype=dtype)
        k_pos = torch.arange(s) if order == "in" else torch.randperm(s, generator=g)
        q_pos = torch.arange(s - t + 1, s + 1) if t <= s else torch.arange(t)
        if s == 600 and order == "perm":  # odd values: inf / NaN in a key and a value, -0 in a query and a value
            k[0, 0, 5], v[0, 0, 7], q[0, 0, 0, 0], v[0, -1, 9] = float("inf"), float("nan"), -0.0, -0.0
        o = native.cached_attention(q, k, v, q_pos, k_pos, d**-0.5, window=window or None, sink=sink)
        out[f"ca/{dtype}/{d}/{hk}x{grp}/{t}/{s}/{window},{sink}/{order}"] = o.clone()
    for dtype, (d, hk, grp) in itertools.product((torch.bfloat16, torch.float32), ((64, 3, 3), (256, 1, 4))):
        lens = [5, 40, 700, 1300]  # batched decode rows over caches of these lengths
        ks = [rnd(1, hk, n, d, dtype=dtype) for n in lens]
        vs = [rnd(1, hk, n, d, dtype=dtype) for n in lens]
        q, k_pos = rnd(len(lens), hk, grp, d, dtype=dtype), [torch.arange(n) for n in lens]
        o = native.cached_attention_rows(q, ks, vs, k_pos, torch.tensor(lens), d**-0.5, window=[0, 0, 256, 0],
                                         sink=[0, 0, 4, 0])
        out[f"rows/{dtype}/{d}"] = o.clone()
    for codec, (hk, grp, d) in itertools.product(("identity", "d4"), ((3, 3, 64), (1, 4, 256))):
        torch.manual_seed(3)  # sparse layers: a prompt in chunks, then decode steps and a chunk, every output
        layer = SparseLayerKV(1, hk, d, sink=4, window=256, block=32, topk=8, budget=0.125, max_positions=3000,
                              codec=make_codec(codec, DEFAULT_Q, d, "cpu"), dtype=torch.bfloat16)
        n = 0
        with torch.inference_mode():
            for step, size in enumerate([512, 512, 700, 1, 1, 1, 37, 1, 1]):
                new = [rnd(1, h, size, d, dtype=torch.bfloat16) for h in (hk * grp, hk, hk)]
                out[f"sparse/{codec}/{d}/{step}"] = layer.attend(*new, torch.arange(n, n + size), scale=d**-0.5).clone()
                n += size
    print("cases", len(out))
    torch.save(out, path)


if __name__ == "__main__":
    if sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        dump(sys.argv[2])

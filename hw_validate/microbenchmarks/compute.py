"""Compute items: GEMMs at the scenarios' shapes (cold weights, as in the job), attention's core
forward and backward, the job's memory-bound ops over activation sizes, and the per-op cost of a
tiny op recorded by autograd (``kernel_launch_us``); what :mod:`hw_validate.fits.compute` reads."""

from __future__ import annotations

import torch

from hw_validate.microbenchmarks.harness import DTYPES, Bench


def bench_gemm(b: Bench, dtype: str, progress) -> list[dict]:
    """``(m x k) @ (k x n)`` for every ``gemm: [[m, n, k], ...]`` of the spec, in ``dtype``."""
    rows = []
    dt = DTYPES[dtype]
    for m, n, k in b.spec.get("gemm", ()):
        # the weight requires grad, as in the training job: every call pays autograd's recording,
        # which is what ``kernel_launch_us`` (measured the same way) stands for in the cost model
        a = torch.randn(int(m), int(k), device=b.device).to(dt)
        w = torch.randn(int(k), int(n), device=b.device).to(dt).requires_grad_()

        def fn(a=a, w=w):
            torch.matmul(a, w)

        # cold weight, warm activation (the previous op's output)
        t, q = b.time_local(fn, warm=lambda a=a: a.sum())
        rows.append({"dtype": dtype, "m": int(m), "n": int(n), "k": int(k), "time_s": t, "p25_s": q})
        progress.update()
    return rows


def bench_attention(b: Bench, dtype: str, progress) -> list[dict]:
    """Causal ``scaled_dot_product_attention`` forward and backward for every ``attention: [[batch,
    heads, seq, head_dim], ...]`` of the spec, in ``dtype``."""
    import torch.nn.functional as F

    rows = []
    dt = DTYPES[dtype]
    for bs, h, t, hd in b.spec.get("attention", ()):
        q, k, v = (torch.randn(bs, h, t, hd, device=b.device).to(dt).requires_grad_() for _ in range(3))

        def fwd(q=q, k=k, v=v):
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd(q=q, k=k, v=v):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        # q, k, v are the projections' outputs just written: warm, like the memory-bound ops
        (tf, qf), (tb, qb) = b.time_local(fwd, cold=False), b.time_local(fwd_bwd, cold=False)
        rows.append({"dtype": dtype, "batch": bs, "heads": h, "seq": t, "head_dim": hd, "fwd_s": tf, "fwd_p25_s": qf,
                     "bwd_s": max(tb - tf, 0.0), "bwd_p25_s": max(qb - qf, 0.0)})  # fmt: skip
        progress.update()
    return rows


#: memory-bound ops of the training job (elementwise, activation, norm, softmax) and the bytes each
#: moves per element in fp32: an add reads 2 and writes 1; the others read 1 and write 1
MEMORY_OPS = {"add": 12, "gelu": 8, "layer_norm": 8, "softmax": 8}


def bench_memory(b: Bench, progress) -> list[dict]:
    """The job's memory-bound ops over activation sizes, recorded by autograd as in the job (rows of
    width 128 where the size allows, as a hidden dimension)."""
    import torch.nn.functional as F

    rows = []
    for op in b.spec.get("memory_ops", list(MEMORY_OPS)):
        for n in b.spec.get("memory_elements", ()):
            n = int(n)
            shape = (n // 128, 128) if n % 128 == 0 else (1, n)
            x = torch.ones(shape, dtype=torch.float32, device=b.device, requires_grad=True)
            y = torch.ones_like(x)
            fn = {
                "add": lambda x=x, y=y: torch.add(x, y),
                "gelu": lambda x=x: F.gelu(x),
                "layer_norm": lambda x=x: F.layer_norm(x, x.shape[-1:]),
                "softmax": lambda x=x: torch.softmax(x, dim=-1),
            }[op]
            # the input is the previous op's output: warm (cold weights are the GEMMs')
            t, q = b.time_local(fn, cold=False)
            rows.append({"op": op, "elements": n, "bytes": MEMORY_OPS[op] * n, "time_s": t, "p25_s": q})
            progress.update()
    return rows


def bench_launch(b: Bench, progress) -> dict:
    """Per-op cost of a tiny op recorded by autograd (eager dispatch + graph node): forward and backward."""
    ops = int(b.spec.get("launch_ops", 2000))
    x = torch.ones(8, device=b.device, requires_grad=True)

    def chain():
        y = x
        for _ in range(ops):
            y = y * 1.0001
        return y

    def fwd():
        chain()

    def fwd_bwd():
        chain().sum().backward()

    # warm: a chain of one tiny op measures the eager dispatch + autograd cost, not the caches
    (tf, qf), (tb, qb) = b.time_local(fwd, cold=False), b.time_local(fwd_bwd, cold=False)
    progress.update()
    return {"ops": ops, "fwd_op_s": tf / ops, "fwd_op_p25_s": qf / ops,
            "bwd_op_s": max(tb - tf, 0.0) / ops, "bwd_op_p25_s": max(qb - qf, 0.0) / ops}  # fmt: skip

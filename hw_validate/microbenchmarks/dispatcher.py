"""DeepSpeed's token dispatcher at the scenarios' shapes: the real ``TopKGate``, sparse encode and
decode, forward and backward, with cold caches as in the job; what
:mod:`hw_validate.fits.dispatcher` reads."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hw_validate.microbenchmarks.harness import DTYPES, Bench


def bench_dispatcher(b: Bench, progress) -> list[dict]:
    """DeepSpeed's token dispatcher at the scenarios' shapes (``dispatcher: [[tokens, d, experts, k,
    capacity_factor, min_capacity, drop_tokens], ...]``): the real ``TopKGate`` (its router GEMM
    included), ``_route_slots`` + ``_sparse_encode`` and ``_sparse_decode``, forward and backward
    (fwd+bwd less fwd), every rank at once with cold caches, as in the job. The simulator prices
    them by eager-op counts and bytes (``sim.frameworks.dispatcher.dispatcher_work``); a tight loop of a
    tiny op (``kernel_launch_us``) underrates them: measured on this VM (1 rank, 512 tokens, d 128,
    8 experts, top-1), sparse encode forward 0.13 ms hot, 0.57 ms cold; 0.78 ms inside the job.
    The drop-free gate's capacity all-reduce runs on a one-rank group, so no collective is timed."""
    shapes = b.spec.get("dispatcher") or ()
    if not shapes:
        return []
    if b.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.moe.sharded_moe import TopKGate, _route_slots, _sparse_decode, _sparse_encode

    deepspeed.init_distributed(dist_backend=b.spec.get("backend", "gloo"))  # the gate's capacity all-reduce
    rank, world = dist.get_rank(), dist.get_world_size()
    solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    dt = DTYPES[(b.spec.get("dtypes") or ["fp32"])[0]]
    rows = []
    for tokens, d, experts, k, cf, min_cap, drop in shapes:
        tokens, d, experts, k = int(tokens), int(d), int(experts), int(k)
        torch.manual_seed(1234 + rank)
        gate = TopKGate(d, experts, k, float(cf or 1.0), float(cf or 1.0), int(min_cap), None, bool(drop),
                        ep_group=solo).to(b.device)  # fmt: skip
        x = torch.randn(tokens, d, device=b.device, dtype=torch.float32, requires_grad=True)
        with torch.no_grad():
            _, cap, _, ind, loc, gts, _ = gate(x, None, True)
        cap = int(cap)
        xe = torch.randn(tokens, d, device=b.device, dtype=dt, requires_grad=True)
        eo = torch.randn(experts * cap, d, device=b.device, dtype=dt, requires_grad=True)
        g = gts.detach().clone().requires_grad_()
        slots = _route_slots(ind, loc, experts, cap)

        def gate_f(gate=gate, x=x):  # with autograd recording, as in the job
            gate(x, None, True)

        def gate_fb(gate=gate, x=x):
            l_aux, _, _, _, _, gates, _ = gate(x, None, True)
            (l_aux + gates.sum()).backward()

        def enc_f(xe=xe, ind=ind, loc=loc, experts=experts, cap=cap):
            _sparse_encode(xe, _route_slots(ind, loc, experts, cap), experts, cap)

        def enc_fb(xe=xe, ind=ind, loc=loc, experts=experts, cap=cap):
            _sparse_encode(xe, _route_slots(ind, loc, experts, cap), experts, cap).sum().backward()

        def dec_f(eo=eo, slots=slots, g=g, tokens=tokens):
            _sparse_decode(eo, slots, g, tokens)

        def dec_fb(eo=eo, slots=slots, g=g, tokens=tokens):
            _sparse_decode(eo, slots, g, tokens).sum().backward()

        for _ in range(3):  # first calls of a shape (and of the first shape: lazy initialisation)
            gate_fb(), enc_fb(), dec_fb()
        row = {"tokens": tokens, "d": d, "experts": experts, "k": k, "capacity": cap, "slots": experts * cap,
               "drop_tokens": bool(drop), "bytes_per_element": torch.finfo(dt).bits // 8}  # fmt: skip
        for piece, fwd, both in (("gate", gate_f, gate_fb), ("encode", enc_f, enc_fb), ("decode", dec_f, dec_fb)):
            (tf, qf), (tb, qb) = b.time_local(fwd, warm=lambda x=x: x.sum()), b.time_local(both, warm=lambda x=x: x.sum())
            row.update({f"{piece}_fwd_s": tf, f"{piece}_fwd_p25_s": qf,
                        f"{piece}_bwd_s": max(tb - tf, 0.0), f"{piece}_bwd_p25_s": max(qb - qf, 0.0)})  # fmt: skip
        rows.append(row)
        progress.update()
    return rows

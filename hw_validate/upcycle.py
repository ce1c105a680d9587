"""Sparse upcycling (Komatsuzaki et al. 2022): start an MoE model from a trained dense one.

The dense model is the scenario's model with a dense MLP (of the expert width) in every MoE slot
(:func:`hw_validate.model.build_model` with ``dense=True``). Upcycling copies every non-FFN weight
1:1, makes **every expert an exact copy of that layer's dense MLP**, draws the router weights from
N(0, 0.02) and zero-initialises the output projection of shared experts (they then add 0). Since
each token's kept routing weights sum to 1 (DeepSpeed renormalises top-k; top-1 is renormalised
by the model when ``norm_topk_prob``), the upcycled model computes exactly the dense function as
long as no token loses all its routes to the capacity limit -- a dropless gate guarantees that.

Checkpoint file (``torch.save``; loaded with ``weights_only=True``)::

    {"format": "moesim.dense_checkpoint", "version": 1, "scenario": NAME,
     "steps": N, "losses": [...], "state_dict": {name: tensor}}

CLI (train a dense parent on the synthetic task, single process, fp32)::

    python -m hw_validate.upcycle --scenario S [--set k=v] --steps 30 --out dense.pt
"""

from __future__ import annotations

import argparse
import io
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hw_validate.data import NextTokenTask, split
from hw_validate.model import MoEFFN, MoETransformer, build_model
from sim.api import load_scenario
from sim.errors import InputError
from sim.inputs.scenario import Scenario
from sim.ioutil import atomic_write_bytes

FORMAT = "moesim.dense_checkpoint"
VERSION = 1
ROUTER_STD = 0.02


def save_dense(path: str | Path, model: MoETransformer, scenario: str, steps: int, losses: list[float]) -> None:
    buf = io.BytesIO()
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    blob = {"format": FORMAT, "version": VERSION, "scenario": scenario, "steps": steps, "losses": losses, "state_dict": state}
    torch.save(blob, buf)
    atomic_write_bytes(path, buf.getvalue())


def load_dense(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise InputError("dense checkpoint not found", file=str(p), field="--dense-checkpoint")
    try:
        blob = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several kinds for a bad file
        raise InputError(f"not a readable torch checkpoint ({type(exc).__name__})", file=str(p)) from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT or blob.get("version") != VERSION:
        raise InputError(f"not a {FORMAT} v{VERSION} file", file=str(p), field="format")
    return blob


def upcycle_(moe_model: MoETransformer, dense_state: dict[str, torch.Tensor], *, seed: int = 0, router_std: float = ROUTER_STD) -> dict[str, int]:
    """Load ``dense_state`` into ``moe_model`` in place; returns counts of what was copied."""
    target = moe_model.state_dict()
    done: set[str] = set()
    experts_copied = 0
    with torch.no_grad():
        for i, block in enumerate(moe_model.blocks):
            ffn = block.ffn
            if not isinstance(ffn, MoEFFN):
                continue
            prefix = f"blocks.{i}.ffn."
            dense_ffn = {k[len(prefix):]: v for k, v in dense_state.items() if k.startswith(prefix)}
            for j, expert in enumerate(ffn.experts):
                sd = expert.state_dict()
                if set(sd) != set(dense_ffn):
                    raise InputError(
                        f"layer {i}: dense MLP has {sorted(dense_ffn)}, expert has {sorted(sd)}",
                        field="--dense-checkpoint",
                    )
                for name, t in expert.named_parameters():
                    t.copy_(_shaped(dense_ffn[name], t, f"{prefix}{name}"))
                    done.add(f"{prefix}moe.deepspeed_moe.experts.deepspeed_experts.{j}.{name}")
                experts_copied += 1
            g = torch.Generator().manual_seed(seed * 7919 + i)
            wg = ffn.gate.wg.weight
            wg.copy_(torch.randn(wg.shape, generator=g, dtype=torch.float32).mul_(router_std).to(wg.dtype))
            done.add(f"{prefix}moe.deepspeed_moe.gate.wg.weight")
            for s, shared in enumerate(ffn.shared):
                last = [m for m in shared.modules() if isinstance(m, torch.nn.Linear)][-1]
                last.weight.zero_()
                if last.bias is not None:
                    last.bias.zero_()
                done.update(f"{prefix}shared.{s}.{n}" for n, _ in shared.named_parameters())
            if ffn.shared_gate is not None:
                done.add(f"{prefix}shared_gate.weight")
        copied = 0
        params = dict(moe_model.named_parameters())
        for name in target:
            if name in done or name not in params:
                continue
            if name not in dense_state:
                raise InputError(f"dense checkpoint lacks '{name}'", field="--dense-checkpoint")
            params[name].copy_(_shaped(dense_state[name], params[name], name))
            copied += 1
    return {"experts_copied": experts_copied, "tensors_copied": copied}


def _shaped(src: torch.Tensor, dst: torch.Tensor, name: str) -> torch.Tensor:
    if tuple(src.shape) != tuple(dst.shape):
        raise InputError(f"'{name}' has shape {tuple(src.shape)} in the checkpoint, {tuple(dst.shape)} in the model", field="--dense-checkpoint")
    return src.to(dst.dtype)


def train_dense(scenario: Scenario, steps: int, *, seed: int = 0, lr: float | None = None) -> tuple[MoETransformer, list[float]]:
    """Train the dense parent on the synthetic task (one process, fp32, Adam); returns model and losses."""
    model = build_model(scenario, None, dense=True, seed=seed)
    t = scenario.training
    task = NextTokenTask(scenario.model.vocab_size, t.seq_len, t.micro_batch_size, seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr or t.lr)
    losses = []
    for step in range(steps):
        x, y = split(task.batch(step, 0, 0))
        logits, _ = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model, losses


@torch.no_grad()
def compare_outputs(moe_logits: torch.Tensor, dense_logits: torch.Tensor) -> dict[str, float]:
    """Max |difference| and max |dense logit| of two logit tensors (fp32)."""
    diff = (moe_logits.float() - dense_logits.float()).abs()
    return {"max_abs_diff": float(diff.max()), "max_abs_logit": float(dense_logits.float().abs().max())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hw_validate.upcycle", description="train a dense parent for upcycling")
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=None, help="default: routing.seed")
    ap.add_argument("--out", required=True, help="checkpoint path to write")
    args = ap.parse_args(argv)
    try:
        scen = load_scenario(args.scenario, args.overrides)
        if args.steps < 1:
            raise InputError("must be >= 1", field="--steps")
        seed = scen.routing.seed if args.seed is None else args.seed
        model, losses = train_dense(scen, args.steps, seed=seed)
    except InputError as exc:
        print(f"upcycle: error: {exc}", file=sys.stderr)
        return 2
    save_dense(args.out, model, scen.name, args.steps, losses)
    first, last = losses[0], losses[-1]
    print(f"dense parent: {args.steps} steps, loss {first:.4f} -> {last:.4f} (ln V = {math.log(scen.model.vocab_size):.4f}); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the probe measures: the cases read from the published rows, and every row with moesim's
prediction (no torch here; :mod:`hw_validate.gpu_kernels` has the whole story)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from sim.api import scenario_from_dict
from sim.frameworks.kernels import ATTENTION_BWD_FACTOR
from sim.frameworks.pricing import Pricer
from sim.hardware.costs import CostModel
from sim.model.flops import Gemm, attention_core_flops_layer, ffn_gemms

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "validation" / "published"
ATTENTION_ROWS = ("D6", "D7")
ROLES = ("fwd", "dgrad", "wgrad")
#: torch.cuda.get_device_name substrings -> GPU description (first match wins: H200 before H100)
GPU_NAMES = (
    ("gb200", "gb200"),
    ("b200", "b200-sxm"),
    ("h200", "h200-sxm"),
    ("h800", "h800-sxm"),
    ("h100", "h100-sxm"),
)


def gpu_description(device_name: str) -> tuple[str, bool]:
    """(GPU description name, matched) for a ``torch.cuda.get_device_name``; H100's where none matches."""
    low = device_name.lower()
    for key, name in GPU_NAMES:
        if key in low:
            return name, True
    return "h100-sxm", False


# ---- the shapes, from the published rows -------------------------------------------------------
@dataclass
class ExpertCase:
    """One distinct expert shape of the layer rows: ``experts`` local experts of ``tokens`` rows each."""

    name: str
    rows: list[str]
    dtypes: list[str]
    hidden: int
    width: int
    ffn_type: str
    experts: int
    tokens: int
    scenarios: dict[str, Any] = field(default_factory=dict, repr=False)  # dtype -> Scenario (for the Pricer)

    @property
    def gemms(self) -> list[Gemm]:
        return ffn_gemms(self.hidden, self.width, self.ffn_type, "expert.")

    def roles(self) -> list[tuple[Gemm, str, int, int, int]]:
        """(gemm, role, M, N, K) of the layer's six GEMMs, in the order a layer runs them."""
        m, out = self.tokens, []
        for g in self.gemms:
            out.append((g, "fwd", m, g.n, g.k))
        for g in reversed(self.gemms):
            out += [(g, "dgrad", m, g.k, g.n), (g, "wgrad", g.k, g.n, m)]
        return out

    def to_json(self) -> dict:
        return {"name": self.name, "rows": self.rows, "dtypes": self.dtypes, "hidden": self.hidden,
                "width": self.width, "ffn_type": self.ffn_type, "local_experts": self.experts,
                "rows_per_expert": self.tokens,
                "gemms": [{"name": g.name, "n": g.n, "k": g.k} for g in self.gemms]}  # fmt: skip


@dataclass
class AttnCase:
    row: str
    name: str
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    seq: int
    core_flops: float  # forward FLOPs of the batch (moesim's count: causal pairs)
    note: str = ""

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("row", "name", "batch", "heads", "kv_heads", "head_dim", "seq",
                                               "core_flops", "note")}  # fmt: skip


def _scenario(path: Path):
    doc = yaml.safe_load(path.read_text())
    return doc, scenario_from_dict(dict(doc["scenario"]), source=str(path), base_dir=path.parent)


def expert_cases(folder: Path = PUBLISHED) -> list[ExpertCase]:
    """One :class:`ExpertCase` per distinct expert shape of the ``L-*.yaml`` rows (balanced routing)."""
    cases: dict[tuple, ExpertCase] = {}
    for path in sorted(folder.glob("L-*.yaml")):
        doc, s = _scenario(path)
        m = s.model
        copies = s.routed_tokens_per_rank * s.ep * m.top_k  # token copies the EP group's experts receive
        tokens = copies // m.num_experts
        width = (m.moe_ffn_hidden_size or m.hidden_size) // s.parallelism.etp
        key = (m.hidden_size, width, m.ffn_type, s.experts_per_rank, tokens)
        case = cases.get(key)
        if case is None:
            case = cases[key] = ExpertCase(
                m.name, [], [], m.hidden_size, width, m.ffn_type, s.experts_per_rank, tokens
            )
        case.rows.append(doc["id"])
        dt = s.training.dtype
        if dt not in case.dtypes:
            case.dtypes.append(dt)
        case.scenarios.setdefault(dt, s)
    return list(cases.values())


def attention_cases(folder: Path = PUBLISHED, rows: tuple[str, ...] = ATTENTION_ROWS) -> list[AttnCase]:
    """The attention core of each row's model at its micro-batch and sequence (a full-attention layer)."""
    out = []
    for row in rows:
        doc, s = _scenario(folder / f"{row}.yaml")
        m = s.model
        if m.attention != "mha":
            continue
        layer = next((i for i in range(m.num_layers) if m.attention_window(i) is None), 0)
        seq, batch = s.training.seq_len, s.training.micro_batch_size
        core = attention_core_flops_layer(m, seq, layer) * batch
        notes = []
        if m.kv_heads != m.num_attention_heads:
            notes.append(
                f"GQA {m.num_attention_heads}/{m.kv_heads}: k, v expanded to every head (same FLOPs)"
            )
        if m.sliding_window is not None:
            notes.append(f"full causal layer {layer} (windowed layers not measured)")
        if m.attention_sinks:
            notes.append("sinks not in SDPA (moesim counts their few FLOPs)")
        out.append(AttnCase(row, m.name, batch, m.num_attention_heads, m.kv_heads, m.head_size, seq, float(core),
                            "; ".join(notes)))  # fmt: skip
    return out


def shrink(cases: list[ExpertCase], attn: list[AttnCase], f: int) -> tuple[list[ExpertCase], list[AttnCase]]:
    """The cases with every GEMM dimension and the sequence divided by ``f`` (the CPU smoke run)."""
    ec = [ExpertCase(c.name, c.rows, c.dtypes, c.hidden // f, c.width // f, c.ffn_type, c.experts,
                     c.tokens // f, c.scenarios) for c in cases]  # fmt: skip
    ac = []
    for a in attn:
        seq = max(16, a.seq // f)
        ac.append(AttnCase(a.row, a.name, 1, a.heads, a.kv_heads, a.head_dim, seq,
                           a.core_flops / a.batch * (seq * (seq + 1)) / (a.seq * (a.seq + 1)), a.note))  # fmt: skip
    return ec, ac


# ---- the plan: every row with moesim's prediction ------------------------------------------------
def _row(part, kernel, impl, case, role, shape, dtype, mode, data, flops, pred_s, **extra) -> dict:
    r = {"part": part, "kernel": kernel, "impl": impl, "case": case.name if hasattr(case, "name") else case,
         "published_rows": list(getattr(case, "rows", [getattr(case, "row", "")])), "role": role, "shape": shape,
         "dtype": dtype, "mode": mode, "data": data, "flops": float(flops),
         "predicted_ms": pred_s * 1e3 if pred_s is not None else None,
         "predicted_TFLOPs": flops / pred_s / 1e12 if pred_s and flops else None,
         "predicted_burst_ms": None, "predicted_burst_TFLOPs": None,
         "ms": None, "TFLOPs": None, "ratio": None, "ratio_burst": None, "samples": None, "error": None}  # fmt: skip
    r.update(extra)
    return r


def _gemm_shape(M, N, K, G=1) -> dict:
    return {"M": int(M), "N": int(N), "K": int(K), "groups": int(G)}


def pricer_gemm(case: ExpertCase, cost: CostModel, dtype: str, g: Gemm) -> tuple[float, float, float]:
    """moesim's (fwd, dgrad, wgrad) seconds of ``g`` over the case's local experts in ``dtype``, as the
    Pricer prices the experts block (FP8: the input and weight casts included)."""
    s = case.scenarios.get(dtype) or next(iter(case.scenarios.values()))
    p = Pricer(s, None, cost, np.ones(1))
    p.dt, p.fp8 = dtype, dtype in ("fp8", "mxfp8")
    f, d, w, _ = p._gemm(g, np.full(case.experts, float(case.tokens)))
    return float(np.sum(f)), float(np.sum(d)), float(np.sum(w))


def cost_models(gpu) -> tuple[CostModel, CostModel | None]:
    """moesim's cost model of ``gpu`` as a training step prices kernels (no calibration), and the same
    under microbenchmark conditions (``burst``: the GEMM points' own curve, without the GPU's
    sustained-compute fraction) where this CostModel has that switch; None where it has not."""
    try:
        burst = CostModel(gpu, burst=True)  # type: ignore[call-arg]
    except TypeError:
        burst = None
    return CostModel(gpu), burst


def plan(
    cases: list[ExpertCase], attn: list[AttnCase], cost: CostModel, burst: CostModel | None = None
) -> list[dict]:
    """Every row the probe measures, in order, with moesim's prediction (nothing measured yet):
    ``predicted_ms`` by ``cost`` and, with ``burst``, ``predicted_burst_ms`` by that one."""
    rows = _plan(cases, attn, cost)
    if burst is not None:
        for r, b in zip(rows, _plan(cases, attn, burst), strict=True):
            r["predicted_burst_ms"], r["predicted_burst_TFLOPs"] = b["predicted_ms"], b["predicted_TFLOPs"]
    for i, r in enumerate(rows):
        r["id"] = i
    return rows


def _plan(cases: list[ExpertCase], attn: list[AttnCase], cost: CostModel) -> list[dict]:
    rows: list[dict] = []
    cast_per = (2 + 1) / cost.hbm_Bps  # moesim's cast: read bf16, write 1 byte (sim.frameworks.pricing)
    for c in cases:
        G = c.experts
        roles = c.roles()
        for data in ("randn", "zeros"):
            for g, role, M, N, K in roles:
                t = cost.gemm_time(M, N, K, "bf16")
                rows.append(_row("a", "torch.matmul", "dense", c, f"{g.name}.{role}", _gemm_shape(M, N, K), "bf16",
                                 "burst", data, 2.0 * M * N * K, t))  # fmt: skip
        for impl, kernel, datas in (("grouped", "torch._grouped_mm", ("randn", "zeros")),
                                    ("loop", f"loop of {G} torch.matmul (not a grouped kernel)", ("randn",))):  # fmt: skip
            for data in datas:
                for g, role, M, N, K in roles:
                    t = G * cost.gemm_time(M, N, K, "bf16")
                    rows.append(_row("b", kernel, impl, c, f"{g.name}.{role}", _gemm_shape(M, N, K, G), "bf16",
                                     "burst", data, 2.0 * M * N * K * G, t))  # fmt: skip
        for impl, kernel, part, groups in (
            ("dense", "torch.matmul", "a", 1),
            ("grouped", "torch._grouped_mm", "b", G),
        ):
            for data in ("randn", "zeros"):
                for g, role, M, N, K in roles:
                    t = groups * cost.gemm_time(M, N, K, "bf16")
                    rows.append(_row(part, kernel, impl, c, f"{g.name}.{role}", _gemm_shape(M, N, K, groups), "bf16",
                                     "sustained", data, 2.0 * M * N * K * groups, t, group=f"{c.name}/{impl}/{data}"))  # fmt: skip
        for impl, kernel in (("fp8_tensor", "torch._scaled_mm per-tensor"),
                             ("fp8_block", "torch._scaled_mm 1x128/128x128 blocks (TE Float8BlockScaling's GEMM)")):  # fmt: skip
            for g, role, M, N, K in roles:
                t = cost.gemm_time(M, N, K, "fp8")
                rows.append(_row("c", kernel, impl, c, f"{g.name}.{role}", _gemm_shape(M, N, K), "fp8", "burst",
                                 "randn", 2.0 * M * N * K, t))  # fmt: skip
        for g, role, M, N, K in roles:
            if role == "wgrad":
                continue
            t = G * cost.gemm_time(M, N, K, "fp8")
            rows.append(_row("c", "torch._scaled_grouped_mm row-wise", "fp8_grouped", c, f"{g.name}.{role}",
                             _gemm_shape(M, N, K, G), "fp8", "burst", "randn", 2.0 * M * N * K * G, t))  # fmt: skip
        for g in c.gemms:
            for what, r_, cols in (("x", c.tokens, g.k), ("dy", c.tokens, g.n), ("w", g.n, g.k)):
                t = G * (r_ * cols * cast_per + cost.launch_s)
                for impl, kernel in (("cast_plain", "cast .to(float8)"), ("cast_tensor", "cast per-tensor amax+scale"),
                                     ("cast_block", "cast 1x128 blocks, eager emulation (upper bound)")):  # fmt: skip
                    rows.append(_row("c", kernel, impl, c, f"{g.name}.{what}", {"rows": G * r_, "cols": cols}, "bf16->fp8",
                                     "burst", "randn", 0.0, t, bytes=G * r_ * cols * 3.0))  # fmt: skip
        for g in c.gemms:
            for dt in c.dtypes:
                if dt not in ("bf16", "fp8"):
                    continue
                f, d, w = pricer_gemm(c, cost, dt, g)
                flops = 2.0 * c.tokens * g.n * g.k * G
                shape = {"in": g.k, "out": g.n, "groups": G, "rows_per_group": c.tokens}
                kern = "te.pytorch.GroupedLinear" + (" (Float8BlockScaling)" if dt == "fp8" else "")
                rows.append(
                    _row("f", kern, f"te_{dt}", c, f"{g.name}.fwd", shape, dt, "burst", "randn", flops, f)
                )
                rows.append(_row("f", kern, f"te_{dt}", c, f"{g.name}.fwd+bwd", shape, dt, "burst", "randn", 3 * flops,
                                 f + d + w))  # fmt: skip
    bpe = 2
    for a in attn:
        io = 4 * a.batch * a.seq * a.heads * a.head_dim * bpe  # as the Pricer: q, k, v, o
        tf = cost.attention_time(a.core_flops, io, "bf16")
        tb = cost.attention_time(ATTENTION_BWD_FACTOR * a.core_flops, 2 * io, "bf16")
        shape = {"batch": a.batch, "heads": a.heads, "seq": a.seq, "head_dim": a.head_dim}
        for backend in ("flash", "cudnn"):
            kern = f"sdpa {backend} causal"
            rows.append(_row("d", kern, f"sdpa_{backend}", a, "attention.fwd", shape, "bf16", "burst", "randn",
                             a.core_flops, tf, note=a.note))  # fmt: skip
            rows.append(_row("d", kern, f"sdpa_{backend}", a, "attention.fwd+bwd", shape, "bf16", "burst", "randn",
                             (1 + ATTENTION_BWD_FACTOR) * a.core_flops, tf + tb, note=a.note))  # fmt: skip
    return rows

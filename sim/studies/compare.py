"""``moesim compare``: routing policies side by side on the same seed and the same gate scores.

Cases are the product of ``--policy`` values and ``--vary`` combinations. Every case routes with the
scenario's ``routing.seed``, so the gate-score generator draws the same scores for every policy and
only the selection differs (:func:`sim.routing.plan.route_scenario`). ``--vary routing.max_groups=1,2,4``
fills in M: with ``--policy node_limited`` (no M) it gives node_limited:M=1, :M=2, ...; with the
scenario's own group-limited policy it varies its M; ``topk`` ignores it (one topk row). With
``healthy=True`` every case of a scenario with ``faults`` is also run with the faults removed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sim.api import load_scenario
from sim.errors import InputError
from sim.inputs.scenario import Scenario, parse_policy
from sim.reports.progress import part

MG = "routing.max_groups"


@dataclass(frozen=True)
class Case:
    policy: str | None  # None: the scenario's routing.policy
    overrides: tuple[str, ...]  # 'k=v' from --vary (max_groups folded into policy where it can be)
    values: tuple[tuple[str, Any], ...]
    healthy: bool = False


def build_cases(scenario: Scenario, policies: list[str], varies) -> list[Case]:
    """The product of ``policies`` (or the scenario's) and the ``--vary`` combinations, deduplicated."""
    from sim.studies.sweep import product

    points = product(varies) if varies else [None]
    cases: list[Case] = []
    for pol in policies or [None]:
        for pt in points:
            texts = list(pt.texts) if pt else []
            values = dict(pt.values) if pt else {}
            policy = pol
            if MG in values:
                mg = values.pop(MG)
                texts = [t for t in texts if not t.startswith(MG + "=")]
                name, m = parse_policy(pol) if pol else (scenario.routing.policy, None)
                if name == "topk":
                    if pol is None:
                        raise InputError(
                            f"{MG} has no effect under the scenario's policy topk; add --policy node_limited "
                            "(or device_limited) to vary its M", field="--vary",
                        )  # fmt: skip
                elif m is not None:
                    raise InputError(f"--policy {pol} fixes M already; drop :M= or the --vary of {MG}",
                                     field="--vary")  # fmt: skip
                else:
                    policy = f"{name}:M={mg}"
            case = Case(policy, tuple(texts), tuple(values.items()))
            if case not in cases:
                cases.append(case)
    return cases


def effective_policy(s: Scenario, text: str | None) -> tuple[str | None, str | None]:
    """(policy to simulate, note) for ``--policy text``: a group-limited M at or above the number of
    groups one EP group spans limits nothing, so it runs as M = that number (the same selection as
    topk) with a note saying so -- a comparison over M = 1, 2, 4 stays one command on a scenario whose
    EP group spans 2 nodes. Everything else is checked as usual by RoutingPolicy.resolve."""
    from sim.routing.policy import group_shape

    if text is None or not s.model.num_moe_layers:
        return text, None
    try:
        name, m = parse_policy(text)
    except ValueError:
        return text, None  # resolve() reports it
    if name == "topk" or m is None:
        return text, None
    _, groups = group_shape(s, name, "--policy")
    if m <= groups:
        return text, None
    word = "nodes" if name == "node_limited" else "devices"
    if groups == 1:
        word = word[:-1]
    return f"{name}:M={groups}", f"M={m} >= the {groups} {word} one EP group spans: no limit, run as M={groups} (= topk)"


def case_label(case: Case, result: dict[str, Any]) -> str:
    label = result["policy"] or "dense"
    if case.overrides:
        label += " | " + ", ".join(case.overrides)
    if case.healthy:
        label += " (healthy)"
    return label


def row(case: Case, result: dict[str, Any]) -> dict[str, Any]:
    b, tr = result["breakdown_s"], result["traffic"]
    return {
        "policy": case_label(case, result),
        "routing_policy": result["policy"],
        "overrides": dict(case.values),
        "healthy": case.healthy,
        "step_time_s": result["step_time_s"],
        "tokens_per_s": result["tokens_per_s"],
        "tokens_per_s_per_gpu": result["tokens_per_s_per_gpu"],
        "mfu": result["mfu"],
        "compute_s": b["compute"],
        "a2a_s": b["a2a"],
        "imbalance_wait_s": b["imbalance_wait"],
        "other_s": b["exposed_comm"] + b["optimizer"],
        "grad_sync_s": b["grad_sync"],
        "a2a_bytes": tr["a2a_bytes"],
        "inter_node_bytes": tr["inter_node_bytes"],
        "inter_node_fraction": tr["inter_node_fraction"],
        "max_over_mean_load": tr["max_over_mean_load"],
        "dropped_fraction": tr["dropped_fraction"],
        "retained_gate_mass": tr["retained_gate_mass"],
        "mean_nodes_per_token": tr["mean_nodes_per_token"],
        "memory_fits": result["memory"]["fits"],
        "breakdown_s": b,
    }


def run_compare(
    scenario_path: str, base: list[str], policies: list[str], varies, *, engine: str = "des",
    comm_model: str = "auto", healthy: bool = False, force: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Simulate every case (validated up front); rows in case order, speed-up against the first.
    Each case is one part of the progress a command shows (:mod:`sim.reports.progress`)."""
    from sim.engine.simulate import has_faults, simulate
    from sim.hardware.faults import without_faults
    from sim.routing.policy import RoutingPolicy
    from sim.studies.guard import check_resources

    base_s = load_scenario(scenario_path, base)
    cases = build_cases(base_s, policies, varies)
    if not cases or (len(cases) == 1 and not healthy):
        raise InputError("nothing to compare: give two or more --policy, or a --vary with several values",
                         field="--policy")  # fmt: skip
    loaded: list[tuple[Case, Scenario, str | None, str | None]] = []
    for c in cases:
        try:
            s = load_scenario(scenario_path, [*base, *c.overrides]) if c.overrides else base_s
            policy, note = effective_policy(s, c.policy)
            if s.model.num_moe_layers:
                RoutingPolicy.resolve(s, policy, field="--policy" if c.policy else "routing.policy")
            check_resources(s, engine=engine, comm_model=comm_model, force=force)
        except InputError as exc:
            if c.overrides:
                exc.message += f" (with {', '.join(c.overrides)})"
            raise
        if healthy and not has_faults(s):
            raise InputError("the scenario has no faults to remove (no faults section)", field="--healthy")
        loaded.append((c, s, policy, note))
        if healthy:
            loaded.append((Case(c.policy, c.overrides, c.values, healthy=True), without_faults(s), policy, note))
    rows = []
    for i, (c, s, policy, note) in enumerate(loaded):
        with part(i, len(loaded), f"case {i + 1}/{len(loaded)} {case_label(c, {'policy': c.policy or s.routing.policy})}"):
            r = row(c, simulate(s, engine=engine, comm_model=comm_model, policy=policy, healthy=False))
        if note:
            r["policy"] = case_label(c, {"policy": c.policy})  # the M asked for, not the one run
            r["note"] = note
        rows.append(r)
    first = rows[0]["step_time_s"]
    for r in rows:
        r["speedup"] = first / r["step_time_s"] if r["step_time_s"] > 0 else None
    return {
        "scenario": base_s.name,
        "scenario_file": str(scenario_path),
        "set": list(base),
        "num_gpus": base_s.world_size,
        "layout": {"nodes": base_s.cluster.nodes, "gpus_per_node": base_s.gpus_per_node, "ep": base_s.ep,
                   "topology": base_s.topology.name, "all_to_all": base_s.collectives.all_to_all,
                   "dispatch": base_s.routing.dispatch},  # fmt: skip
        "seed": base_s.routing.seed,
        "engine": engine,
        "comm_model": comm_model,
        "baseline": rows[0]["policy"],
        "policies": rows,
    }


def _f(v: Any, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def format_table(doc: dict[str, Any]) -> str:
    head = ["policy", "step s", "speed-up", "a2a s", "wait s", "inter-node GB/GPU", "max/mean load", "dropped",
            "gate mass", "nodes/token"]  # fmt: skip
    rows = [[r["policy"], f"{r['step_time_s']:.4f}", _f(r["speedup"], ".3f") + "x", f"{r['a2a_s']:.4f}",
             f"{r['imbalance_wait_s']:.4f}", f"{r['inter_node_bytes'] / 1e9:.3f}", f"{r['max_over_mean_load']:.3f}",
             f"{100 * r['dropped_fraction']:.2f}%", _f(r["retained_gate_mass"], ".4f"),
             _f(r["mean_nodes_per_token"], ".3f")] for r in doc["policies"]]  # fmt: skip
    w = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)]
    lay = doc["layout"]
    lines = [
        f"{doc['scenario']}: {doc['num_gpus']} GPUs ({lay['nodes']} x {lay['gpus_per_node']} {lay['topology']}), "
        f"EP {lay['ep']}, {lay['all_to_all']} all-to-all, {lay['dispatch']}, seed {doc['seed']}, "
        f"engine {doc['engine']}; same gate scores for every row",
        "  ".join(h.ljust(w[0]) if i == 0 else h.rjust(w[i]) for i, h in enumerate(head)),
    ]
    lines += ["  ".join(c.ljust(w[0]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(x)) for x in rows]
    lines += [f"note: {r['policy']}: {r['note']}" for r in doc["policies"] if r.get("note")]
    lines.append(
        "a2a s / wait s: mean per rank per step in all-to-alls / waiting at their barriers; inter-node GB: "
        "all-to-all bytes a GPU sends across nodes per step; speed-up: first row's step time / this row's"
    )
    return "\n".join(lines)


def plot_compare(path, doc: dict[str, Any]):
    """Grouped bars: step time (compute / all-to-all / imbalance wait / other), inter-node GB per GPU,
    max/mean load and retained gate mass, one bar per case."""
    from sim.reports.plots import CAT_COLOR, pyplot, save_png

    plt = pyplot()
    rows = doc["policies"]
    names = [r["policy"].replace(" | ", "\n") for r in rows]
    x = list(range(len(rows)))
    fig, axes = plt.subplots(1, 4, figsize=(max(15, 1.9 * len(rows) * 2), 5.6),
                             gridspec_kw={"width_ratios": [1.6, 1, 1, 1]})  # fmt: skip
    ax = axes[0]
    bottom = [0.0] * len(rows)
    for key, cat, label in (("compute_s", "compute", "compute"), ("a2a_s", "a2a", "all-to-all"),
                            ("imbalance_wait_s", "imbalance_wait", "imbalance wait"),
                            ("other_s", "exposed_comm", "other (exposed comm + optimizer)")):  # fmt: skip
        vals = [r[key] for r in rows]
        ax.bar(x, vals, bottom=bottom, color=CAT_COLOR[cat], label=label, edgecolor="white", lw=0.4)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, r in enumerate(rows):
        ax.text(i, bottom[i], f"{r['step_time_s']:.3g} s\n{_f(r['speedup'], '.2f')}x", ha="center",
                va="bottom", fontsize=8)  # fmt: skip
    ax.set_ylim(0, max(bottom) * 1.5)
    ax.set_ylabel("seconds per step (mean over ranks)")
    ax.set_title("step time (label: speed-up vs first)", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", ncol=2, framealpha=0.9)
    panels = (
        ("inter_node_bytes", 1e-9, "GB per GPU per step", "inter-node all-to-all bytes", "tab:red", ".3g"),
        ("max_over_mean_load", 1.0, "max / mean tokens per rank", "load imbalance", "tab:orange", ".3f"),
        ("retained_gate_mass", 1.0, "fraction of top-k gate score kept", "retained gate mass", "tab:green", ".4f"),
    )
    for ax, (key, scale, ylabel, title, color, fmt) in zip(axes[1:], panels, strict=True):
        vals = [(r[key] or 0.0) * scale for r in rows]
        ax.bar(x, vals, color=color, alpha=0.85)
        for i, v in enumerate(vals):
            ax.text(i, v, format(v, fmt), ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, (max(vals) or 1.0) * 1.15)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
    for ax in axes:
        ax.set_xticks(x, names, fontsize=7, rotation=30 if len(rows) > 3 else 0, ha="right" if len(rows) > 3 else "center")
        ax.grid(axis="y", alpha=0.3)
    lay = doc["layout"]
    fig.suptitle(f"{doc['scenario']}: routing policies on the same gate scores (seed {doc['seed']}) - "
                 f"{doc['num_gpus']} GPUs ({lay['nodes']} x {lay['gpus_per_node']} {lay['topology']}), EP {lay['ep']}, "
                 f"{lay['all_to_all']} all-to-all, engine {doc['engine']}", fontsize=11)  # fmt: skip
    fig.tight_layout()
    return save_png(fig, path)


__all__ = ["Case", "build_cases", "case_label", "format_table", "plot_compare", "row", "run_compare"]

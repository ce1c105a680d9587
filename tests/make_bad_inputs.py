"""Regenerates the bad-input corpus tests/bad_inputs/ and its expected.yaml (the committed files are
the corpus; run ``python tests/make_bad_inputs.py`` after adding a case here)."""

import copy
import json
import os
import shutil
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from sim.inputs.router_trace import FORMAT as TFORMAT  # noqa: E402
from sim.inputs.router_trace import VERSION as TVERSION  # noqa: E402

OUT = Path(os.environ.get("BAD_INPUTS_OUT", ROOT / "tests" / "bad_inputs"))
shutil.rmtree(OUT, ignore_errors=True)
for d in ("scenarios", "topologies", "hf", "files"):
    (OUT / d).mkdir(parents=True)

BASE = {
    "name": "bad-input",
    "cluster": {"topology": "dgx-h100", "nodes": 2},
    "model": {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "vocab_size": 1000,
        "moe_ffn_hidden_size": 32,
        "num_experts": 16,
        "top_k": 2,
    },
    "parallelism": {"ep": 16},
    "training": {"micro_batch_size": 1, "seq_len": 32},
}
EXPECTED = {}
DEL = object()


def dump(d):
    return yaml.safe_dump(d, sort_keys=False, default_flow_style=False, width=200)


def put(rel, comment, content, field, contains, **extra):
    p = OUT / rel
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        text = content if isinstance(content, str) else dump(content)
        if comment and rel.endswith(".yaml"):
            text = f"# {comment}\n" + text
        p.write_text(text)
    entry = {
        "what": comment,
        "field": field,
        "contains": contains if isinstance(contains, list) else [contains],
    }
    entry.update(extra)
    EXPECTED[rel] = entry


def scen(**changes):
    d = copy.deepcopy(BASE)
    for k, v in changes.items():
        parts = k.split("__")
        node = d
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        if v is DEL:
            node.pop(parts[-1], None)
        else:
            node[parts[-1]] = v
    return d


S = "scenarios/"
# ---- file-level damage --------------------------------------------------------------------------
put(S + "empty.yaml", None, "", None, "is empty")
put(S + "only_comments.yaml", "a file with nothing but comments", "# cluster: {nodes: 2}\n", None, "is empty")
put(
    S + "syntax_unclosed_flow.yaml",
    "a flow mapping that is never closed",
    "cluster: {topology: dgx-h100, nodes: 2\nmodel:\n  num_layers: 2\n",
    None,
    ["YAML syntax error", "line"],
)
put(
    S + "syntax_tab_indent.yaml",
    "a tab used for indentation",
    "cluster:\n\ttopology: dgx-h100\n\tnodes: 2\n",
    None,
    ["YAML syntax error", "line 3"],
)
put(
    S + "syntax_bad_indent.yaml",
    "a key indented deeper than its siblings",
    "cluster:\n  topology: dgx-h100\n    nodes: 2\n",
    None,
    ["YAML syntax error", "line 4"],
)
put(S + "binary_junk.yaml", None, bytes(range(256)) * 4, None, "binary")
put(S + "png_header.yaml", None, b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + b"\x00" * 32, None, "binary")
put(
    S + "latin1.yaml", None, dump(scen()).replace("bad-input", "caf\xe9").encode("latin-1"), None, "not UTF-8"
)
put(
    S + "control_character.yaml",
    None,
    "name: bad\x01input\n" + dump(scen())[len("name: bad-input\n") :],
    None,
    "unacceptable character",
)
put(
    S + "top_level_list.yaml",
    "a list where a mapping belongs",
    "- cluster\n- model\n",
    None,
    "expected a mapping",
)
put(S + "top_level_scalar.yaml", "a bare value", "just some words\n", None, "expected a mapping")
put(
    S + "top_level_non_string_key.yaml",
    "an integer key at the top level",
    "1: cluster\n" + dump(scen()),
    None,
    "keys must be strings",
)
put(
    S + "duplicate_key.yaml",
    "seq_len given twice",
    dump(scen()).replace("seq_len: 32", "seq_len: 32\n  seq_len: 64"),
    "seq_len",
    "duplicate key 'seq_len'",
)
put(
    S + "alias_bomb.yaml",
    "a billion-laughs alias bomb",
    "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    + "".join(f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdef", "bcdefg", strict=True)),
    None,
    "through YAML aliases",
)
put(
    S + "recursive_alias.yaml",
    "an alias inside its own anchor",
    "cluster: &c {topology: dgx-h100, nodes: 2, me: [*c]}\n",
    None,
    "recursive YAML alias",
)
put(
    S + "deep_nesting.yaml",
    "two thousand nested lists",
    "description: " + "[" * 2000 + "]" * 2000 + "\n",
    None,
    "nested too deeply",
)
put(
    S + "python_tag.yaml",
    "a python object tag (never constructed)",
    "name: !!python/object/apply:os.system ['echo pwned']\n",
    None,
    "could not determine a constructor",
)
# ---- keys ----------------------------------------------------------------------------------------
d = scen()
d["modle"] = d.pop("model")
put(S + "misspelt_section.yaml", "'modle' for 'model'", d, "modle", ["did you mean 'model'", "allowed keys"])
d = scen()
d["parallelizm"] = d.pop("parallelism")
put(
    S + "misspelt_section_2.yaml",
    "'parallelizm' for 'parallelism'",
    d,
    "parallelizm",
    "did you mean 'parallelism'",
)
d = scen()
d["training"]["micro_batch_sise"] = d["training"].pop("micro_batch_size")
put(
    S + "misspelt_nested_key.yaml",
    "'micro_batch_sise' for 'micro_batch_size'",
    d,
    "training.micro_batch_sise",
    "did you mean 'micro_batch_size'",
)
put(
    S + "unknown_key.yaml",
    "a key no section has",
    scen(routing__temperature=0.7),
    "routing.temperature",
    ["unknown key", "allowed keys"],
)
put(S + "missing_model.yaml", "no model section", scen(model=DEL), "model", "required field is missing")
put(
    S + "missing_training.yaml",
    "no training section",
    scen(training=DEL),
    "training",
    "required field is missing",
)
put(
    S + "missing_cluster.yaml",
    "no cluster section",
    scen(cluster=DEL),
    "cluster",
    "required field is missing",
)
put(
    S + "missing_topology.yaml",
    "cluster without topology",
    scen(cluster__topology=DEL),
    "cluster.topology",
    "required field is missing",
)
put(
    S + "missing_seq_len.yaml",
    "training without seq_len",
    scen(training__seq_len=DEL),
    "training.seq_len",
    "required field is missing",
)
# ---- types ---------------------------------------------------------------------------------------
put(S + "nodes_string.yaml", "nodes: two", scen(cluster__nodes="two"), "cluster.nodes", "valid integer")
put(S + "nodes_bool.yaml", "nodes: true", scen(cluster__nodes=True), "cluster.nodes", "not true")
put(S + "nodes_float.yaml", "nodes: 2.5", scen(cluster__nodes=2.5), "cluster.nodes", "fractional part")
put(S + "nodes_list.yaml", "nodes: [2]", scen(cluster__nodes=[2]), "cluster.nodes", "valid integer")
put(S + "section_is_scalar.yaml", "model: tiny", scen(model="tiny"), "model", "valid dictionary")
put(S + "section_is_list.yaml", "training as a list", scen(training=[1, 32]), "training", "valid dictionary")
put(
    S + "policy_list.yaml",
    "routing.policy as a list",
    scen(routing__policy=["topk"]),
    "routing.policy",
    "valid string",
)
put(S + "name_empty.yaml", "a blank name", scen(name="  "), "name", "must not be empty")
put(
    S + "dtype_unknown.yaml",
    "dtype: fp64",
    scen(training__dtype="fp64"),
    "training.dtype",
    "'bf16', 'fp16', 'fp32'",
)
put(
    S + "zero_stage_5.yaml",
    "zero_stage: 5",
    scen(parallelism__zero_stage=5),
    "parallelism.zero_stage",
    "0, 1, 2 or 3",
)
put(
    S + "zero_stage_bool.yaml",
    "zero_stage: true",
    scen(parallelism__zero_stage=True),
    "parallelism.zero_stage",
    "not true",
)
put(
    S + "attention_unknown.yaml",
    "attention: flash",
    scen(model__attention="flash"),
    "model.attention",
    "'mha', 'mla' or 'none'",
)
# ---- sizes ---------------------------------------------------------------------------------------
put(S + "zero_nodes.yaml", "nodes: 0", scen(cluster__nodes=0), "cluster.nodes", "greater than or equal to 1")
put(
    S + "negative_nodes.yaml",
    "nodes: -4",
    scen(cluster__nodes=-4),
    "cluster.nodes",
    "greater than or equal to 1",
)
put(
    S + "zero_gpus_per_node.yaml",
    "gpus_per_node: 0",
    scen(cluster__gpus_per_node=0),
    "cluster.gpus_per_node",
    "greater than or equal to 1",
)
put(
    S + "zero_micro_batch.yaml",
    "micro_batch_size: 0",
    scen(training__micro_batch_size=0),
    "training.micro_batch_size",
    "greater than or equal to 1",
)
put(
    S + "negative_seq_len.yaml",
    "seq_len: -32",
    scen(training__seq_len=-32),
    "training.seq_len",
    "greater than or equal to 1",
)
put(
    S + "zero_hidden_size.yaml",
    "hidden_size: 0",
    scen(model__hidden_size=0),
    "model.hidden_size",
    "greater than or equal to 1",
)
put(
    S + "negative_experts.yaml",
    "num_experts: -16",
    scen(model__num_experts=-16),
    "model.num_experts",
    "greater than or equal to 1",
)
put(
    S + "zero_capacity_factor.yaml",
    "capacity_factor: 0",
    scen(routing__capacity_factor=0),
    "routing.capacity_factor",
    "greater than 0",
)
put(S + "negative_lr.yaml", "lr: -0.001", scen(training__lr=-0.001), "training.lr", "greater than 0")
put(
    S + "absurd_nodes.yaml",
    "a billion nodes",
    scen(cluster__nodes=10**9),
    "cluster.nodes",
    "less than or equal to 1000000",
)
put(
    S + "absurd_hidden_size.yaml",
    "hidden_size: 1e40",
    scen(model__hidden_size=10**40),
    "model.hidden_size",
    "less than or equal to",
)
put(
    S + "absurd_vocab.yaml",
    "vocab_size: 1e30",
    scen(model__vocab_size=10**30),
    "model.vocab_size",
    "less than or equal to",
)
put(
    S + "absurd_gpus_per_node.yaml",
    "a million GPUs in a node",
    scen(cluster__gpus_per_node=10**6),
    "cluster.gpus_per_node",
    "less than or equal to 1024",
)
put(S + "absurd_seed.yaml", "seed: 2^70", scen(routing__seed=2**70), "routing.seed", "less than or equal to")
put(S + "infinite_lr.yaml", "lr: .inf", "lr_placeholder", "training.lr", "finite number")
(OUT / (S + "infinite_lr.yaml")).write_text(
    "# lr: .inf\n" + dump(scen()).replace("seq_len: 32", "seq_len: 32\n  lr: .inf")
)
put(
    S + "nan_capacity_factor.yaml", "capacity_factor: .nan", "x", "routing.capacity_factor", "capacity_factor"
)
(OUT / (S + "nan_capacity_factor.yaml")).write_text(
    "# capacity_factor: .nan\n" + dump(scen()) + "routing:\n  capacity_factor: .nan\n"
)
# ---- impossible layouts --------------------------------------------------------------------------
put(
    S + "ep_not_dividing_experts.yaml",
    "ep 3 with 16 experts",
    scen(parallelism__ep=3, model__num_experts=16, cluster__nodes=3, cluster__gpus_per_node=1),
    "parallelism.ep",
    "must divide model.num_experts",
)
put(
    S + "mxfp8_on_hopper.yaml",
    "MXFP8 on H100 (no MX tensor cores)",
    scen(training__dtype="mxfp8"),
    "training.dtype",
    "mxfp8 needs tensor cores for it",
)
put(
    S + "dualpipe_without_pp.yaml",
    "DualPipe on a single stage",
    scen(parallelism__pp_schedule="dualpipe"),
    "parallelism.pp_schedule",
    "dualpipe needs an even pp >= 2",
)
put(
    S + "dualpipe_with_vpp.yaml",
    "DualPipe with interleaving chunks",
    scen(parallelism__pp_schedule="dualpipe", parallelism__pp=2, parallelism__vpp=2, parallelism__ep=8,
         model__num_layers=4, training__grad_accum_steps=8),
    "parallelism.pp_schedule",
    "vpp must be 1",
)
put(
    S + "ep_not_dividing_world.yaml",
    "ep 32 on 16 GPUs",
    scen(parallelism__ep=32, model__num_experts=32),
    "parallelism.ep",
    "must divide the world size (16)",
)
put(
    S + "dp_not_world.yaml",
    "dp 8 on 16 GPUs",
    scen(parallelism__dp=8),
    "parallelism.dp",
    "must equal the world size",
)
put(
    S + "top_k_above_experts.yaml",
    "top_k 32 of 16 experts",
    scen(model__top_k=32),
    "model.top_k",
    "must be <= num_experts",
)
put(
    S + "M_too_small.yaml",
    "device-limited M=1 cannot hold top-2",
    scen(routing__policy="device_limited:M=1"),
    "routing.max_groups",
    "fewer than top_k",
)
put(
    S + "M_too_large.yaml",
    "node-limited M=3 on 2 nodes",
    scen(routing__policy="node_limited:M=3"),
    "routing.max_groups",
    "exceeds",
)
put(
    S + "policy_unknown.yaml",
    "policy: expert_choice",
    scen(routing__policy="expert_choice"),
    "routing.policy",
    "not understood",
)
put(
    S + "policy_without_M.yaml",
    "node_limited without M",
    scen(routing__policy="node_limited"),
    "routing.max_groups",
    "needs max_groups",
)
put(
    S + "policy_M_conflict.yaml",
    "M in the policy and max_groups disagree",
    scen(routing__policy="node_limited:M=1", routing__max_groups=2),
    "routing.max_groups",
    "policy says M=1",
)
put(
    S + "global_batch_mismatch.yaml",
    "global_batch_size != micro x accum x dp",
    scen(training__global_batch_size=100),
    "training.global_batch_size",
    "must equal micro_batch_size",
)
put(
    S + "mla_incomplete.yaml",
    "attention: mla without its ranks",
    scen(model__attention="mla"),
    "model.attention",
    "mla needs kv_lora_rank",
)
put(
    S + "heads_not_dividing_hidden.yaml",
    "64 not divisible by 6 heads",
    scen(model__num_attention_heads=6),
    "model.head_dim",
    "not divisible",
)
put(
    S + "kv_heads_not_dividing.yaml",
    "4 heads, 3 kv heads",
    scen(model__num_kv_heads=3),
    "model.num_kv_heads",
    "must be a multiple",
)
put(
    S + "moe_without_expert_width.yaml",
    "experts without moe_ffn_hidden_size",
    scen(model__moe_ffn_hidden_size=DEL),
    "model.moe_ffn_hidden_size",
    "required when num_experts > 1",
)
put(
    S + "all_layers_dense.yaml",
    "first_dense_layers == num_layers",
    scen(model__first_dense_layers=2, model__ffn_hidden_size=64),
    "model.first_dense_layers",
    "every layer is dense",
)
put(
    S + "dense_too_many.yaml",
    "first_dense_layers > num_layers",
    scen(model__first_dense_layers=3, model__ffn_hidden_size=64),
    "model.first_dense_layers",
    "exceeds num_layers",
)
put(
    S + "qk_norm_with_mla.yaml",
    "qk_norm on MLA attention",
    scen(
        model__attention="mla",
        model__kv_lora_rank=16,
        model__qk_nope_head_dim=8,
        model__qk_rope_head_dim=8,
        model__v_head_dim=8,
        model__qk_norm="head",
    ),
    "model.qk_norm",
    "mha only",
)
put(
    S + "one_node_topology_two_nodes.yaml",
    "cpu-host holds one node",
    scen(cluster__topology="cpu-host", parallelism__ep=4),
    "cluster.nodes",
    "no scale-out fabric",
)
# ---- references to files ----------------------------------------------------------------------------
put(
    S + "missing_topology_file.yaml",
    "topology path that does not exist",
    scen(cluster__topology="../topologies/does-not-exist.yaml"),
    "cluster.topology",
    "not found",
)
put(
    S + "unknown_topology_name.yaml",
    "'dgx-h10' for 'dgx-h100'",
    scen(cluster__topology="dgx-h10"),
    "cluster.topology",
    ["did you mean 'dgx-h100'", "shipped:"],
)
put(
    S + "missing_hf_config.yaml",
    "hf_config that does not exist",
    scen(model={"hf_config": "../hf/no-such-config.json"}),
    None,
    "HF config not found",
    names="no-such-config.json",
)
put(
    S + "hf_config_not_a_path.yaml",
    "hf_config: 5",
    scen(model={"hf_config": 5}),
    "model.hf_config",
    "must be the path",
)
put(
    S + "missing_calibration.yaml",
    "calibration file that does not exist",
    scen(calibration="../files/no-such-calibration.json"),
    "calibration",
    "not found",
)
put(
    S + "calibration_is_directory.yaml",
    "calibration: a folder",
    scen(calibration="../files"),
    "calibration",
    "is a directory",
)
put(
    S + "missing_trace.yaml",
    "router trace that does not exist",
    scen(routing__generator="trace", routing__trace="../files/no-such-trace.json"),
    "routing.trace",
    "not found",
)
put(
    S + "trace_generator_without_file.yaml",
    "generator: trace with no trace",
    scen(routing__generator="trace"),
    "routing.trace",
    "needs routing.trace",
)
# ---- faults ----------------------------------------------------------------------------------------
put(
    S + "faults_nic_missing.yaml",
    "a NIC rail the node does not have",
    scen(faults={"links": [{"nic": {"node": 0, "rail": 9}, "bw_factor": 0.5}]}),
    "faults.links.0.nic.rail",
    "rails 0-7",
)
put(
    S + "faults_node_missing.yaml",
    "a node the cluster does not have",
    scen(faults={"links": [{"nic": {"node": 5, "rail": 0}, "failed": True}]}),
    "faults.links.0.nic.node",
    "nodes 0-1",
)
put(
    S + "faults_rank_missing.yaml",
    "a rank past the world",
    scen(faults={"stragglers": [{"rank": 16, "compute_factor": 2}]}),
    "faults.stragglers.0.rank",
    "ranks 0-15",
)
put(
    S + "faults_bw_factor_above_1.yaml",
    "bw_factor 2 (faults only slow links down)",
    scen(faults={"links": [{"nvlink": {"rank": 0}, "bw_factor": 2}]}),
    "faults.links.0.bw_factor",
    "less than or equal to 1",
)
put(
    S + "faults_bw_factor_zero.yaml",
    "bw_factor 0 (use failed: true)",
    scen(faults={"links": [{"nvlink": {"rank": 0}, "bw_factor": 0}]}),
    "faults.links.0.bw_factor",
    "greater than 0",
)
put(
    S + "faults_no_target.yaml",
    "a link fault without a target",
    scen(faults={"links": [{"bw_factor": 0.5}]}),
    "faults.links.0.target",
    "exactly one of",
)
put(
    S + "faults_link_name.yaml",
    "a link name that is not in the cluster",
    scen(faults={"links": [{"link": "n0/nic0 -> leaf/r0/1", "bw_factor": 0.5}]}),
    "faults.links.0.link",
    "did you mean 'leaf/r0/0'",
)
put(
    S + "faults_straggler_faster.yaml",
    "compute_factor below 1",
    scen(faults={"stragglers": [{"rank": 1, "compute_factor": 0.5}]}),
    "faults.stragglers.0.compute_factor",
    "greater than or equal to 1",
)
put(
    S + "faults_misspelt.yaml",
    "'straglers' for 'stragglers'",
    scen(faults={"straglers": [{"rank": 1, "compute_factor": 2}]}),
    "faults.straglers",
    "did you mean 'stragglers'",
)
put(
    S + "faults_partition.yaml",
    "the only link of rank 1 failed (cpu-host: no fabric to go around)",
    scen(
        cluster={"topology": "cpu-host", "nodes": 1},
        parallelism__ep=2,
        faults={"links": [{"nvlink": {"rank": 1}, "failed": True}]},
    ),
    "faults.links",
    ["partition", "rank(s) 1 cannot reach"],
)
put(
    S + "flow_mapping_no_space.yaml",
    "'{rank:3}' (YAML reads one key 'rank:3')",
    "x",
    "faults.stragglers.0.rank:3",
    ["YAML needs a space after ':'", "write 'rank: 3'"],
)
(OUT / (S + "flow_mapping_no_space.yaml")).write_text(
    "# '{rank:3}' is one key in YAML\n"
    + dump(scen())
    + "faults:\n  stragglers: [{rank:3, compute_factor: 2}]\n"
)
put(
    S + "faults_jitter_negative.yaml",
    "kernel_cv -0.1",
    scen(faults={"jitter": {"kernel_cv": -0.1}}),
    "faults.jitter.kernel_cv",
    "greater than or equal to 0",
)

# ---- GPT-OSS model fields (sliding windows, sinks, biases, the clamped SwiGLU) --------------------------
for rel, what, changes, field, contains in [
    ("attention_out_bias_with_mla.yaml", "attention_out_bias on MLA attention",
     dict(model__attention="mla", model__kv_lora_rank=16, model__qk_nope_head_dim=8, model__qk_rope_head_dim=8,
          model__v_head_dim=8, model__attention_out_bias=True), "model.attention_out_bias", "mha only"),
    ("attention_sinks_string.yaml", "attention_sinks: maybe", dict(model__attention_sinks="maybe"),
     "model.attention_sinks", "valid boolean"),
    ("attention_sinks_without_attention.yaml", "attention_sinks on a model without attention",
     dict(model__attention="none", model__attention_sinks=True), "model.attention_sinks", "attention is none"),
    ("router_logit_bias_dense.yaml", "router_logit_bias on a dense model (no router)",
     dict(model__num_experts=DEL, model__top_k=DEL, model__moe_ffn_hidden_size=DEL, model__ffn_hidden_size=32,
          model__router_logit_bias=True, parallelism__ep=1), "model.router_logit_bias", "num_experts > 1"),
    ("sliding_window_pattern_one.yaml", "sliding_window_pattern: 1",
     dict(model__sliding_window=8, model__sliding_window_pattern=1), "model.sliding_window_pattern",
     "greater than or equal to 2"),
    ("sliding_window_pattern_without_window.yaml", "sliding_window_pattern without sliding_window",
     dict(model__sliding_window_pattern=2), "model.sliding_window_pattern", "needs sliding_window"),
    ("sliding_window_without_attention.yaml", "sliding_window on a model without attention",
     dict(model__attention="none", model__sliding_window=8), "model.sliding_window", "attention is none"),
    ("sliding_window_zero.yaml", "sliding_window: 0", dict(model__sliding_window=0), "model.sliding_window",
     "greater than or equal to 1"),
    ("swiglu_limit_negative.yaml", "swiglu_limit: -7", dict(model__swiglu_limit=-7.0), "model.swiglu_limit",
     "greater than 0"),
    ("swiglu_limit_plain_ffn.yaml", "swiglu_limit on a plain (non-gated) FFN",
     dict(model__ffn_type="plain", model__swiglu_limit=7.0), "model.swiglu_limit", "gated"),
]:  # fmt: skip
    put(S + rel, what, scen(**changes), field, contains)

# ---- topologies (each run through a scenario that names it) ------------------------------------------
T = yaml.safe_load((ROOT / "topologies" / "dgx-h100.yaml").read_text())
#: the GPU inline, as a topology may still write it (the shipped files name one of topologies/gpus/),
#: so the corpus damages a GPU's own fields; frozen as the corpus was made
T["gpu"] = {"kind": "H100-SXM", "peak_TFLOPs": {"fp8": 1979, "bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67},
            "hbm_bw_GBps": 3350, "hbm_GiB": 79.6, "kernel_launch_us": 4.0}


def topo(**changes):
    t = copy.deepcopy(T)
    for k, v in changes.items():
        parts = k.split("__")
        node = t
        for p in parts[:-1]:
            node = node[p]
        if v is DEL:
            node.pop(parts[-1])
        else:
            node[parts[-1]] = v
    return t


TP = "topologies/"
W = {"wrap": "topology"}
put(
    TP + "negative_nvlink_bw.yaml",
    "NVLink line rate -450",
    topo(node__intra__line_bw_GBps=-450),
    "node.intra.line_bw_GBps",
    "greater than 0",
    **W,
)
put(
    TP + "zero_nic_rate.yaml",
    "NIC 0 Gb/s",
    topo(scaleout__nic_line_Gbps=0),
    "scaleout.nic_line_Gbps",
    "greater than 0",
    **W,
)
put(
    TP + "efficiency_above_1.yaml",
    "efficiency 1.5",
    topo(scaleout__efficiency=1.5),
    "scaleout.efficiency",
    "less than or equal to 1",
    **W,
)
put(
    TP + "negative_peak.yaml",
    "bf16 peak -1",
    topo(gpu__peak_TFLOPs__bf16=-1),
    "gpu.peak_TFLOPs.bf16",
    "must be > 0",
    **W,
)
put(
    TP + "no_peaks.yaml",
    "peak_TFLOPs empty",
    topo(gpu__peak_TFLOPs={}),
    "gpu.peak_TFLOPs",
    "at least one dtype",
    **W,
)
put(
    TP + "peak_bad_dtype.yaml",
    "'bf61' dtype",
    topo(gpu__peak_TFLOPs={"bf61": 989}),
    "gpu.peak_TFLOPs.bf61",
    "'fp8', 'bf16'",
    **W,
)
put(TP + "missing_gpu.yaml", "no gpu section", topo(gpu=DEL), "gpu", "required field is missing", **W)
put(
    TP + "misspelt_key.yaml",
    "'latency_ms' for 'latency_us'",
    topo(node__intra__latency_ms=2.5, node__intra__latency_us=DEL),
    "node.intra.latency_ms",
    "did you mean 'latency_us'",
    **W,
)
put(
    TP + "nics_not_gpus.yaml",
    "rail fat tree with 4 NICs for 8 GPUs",
    topo(scaleout__nics_per_node=4),
    "scaleout.nics_per_node",
    "must equal node.gpus_per_node",
    **W,
)
put(
    TP + "unknown_fabric.yaml",
    "scaleout.kind: torus",
    topo(scaleout__kind="torus"),
    "scaleout.kind",
    "'rail_fat_tree'",
    **W,
)
put(TP + "infinite_hbm.yaml", "hbm_bw_GBps: .inf", "x", "gpu.hbm_bw_GBps", "finite number", **W)
(OUT / (TP + "infinite_hbm.yaml")).write_text(
    "# hbm_bw_GBps: .inf\n"
    + dump(topo(gpu__hbm_bw_GBps=3350)).replace("hbm_bw_GBps: 3350", "hbm_bw_GBps: .inf")
)
put(
    TP + "absurd_bandwidth.yaml",
    "NVLink at 1e300 GB/s",
    topo(node__intra__line_bw_GBps=1e300),
    "node.intra.line_bw_GBps",
    "less than or equal to",
    **W,
)
put(
    TP + "undersubscribed.yaml",
    "oversubscription 0.5",
    topo(scaleout__oversubscription=0.5),
    "scaleout.oversubscription",
    "greater than or equal to 1",
    **W,
)
put(
    TP + "gpus_per_node_string.yaml",
    "gpus_per_node: eight",
    topo(node__gpus_per_node="eight"),
    "node.gpus_per_node",
    "valid integer",
    **W,
)
put(TP + "empty.yaml", None, "", None, "topology file is empty", **W)
put(
    TP + "syntax_error.yaml",
    "unclosed list",
    "name: broken\ngpu: [kind: H100\n",
    None,
    ["YAML syntax error", "line"],
    **W,
)
put(TP + "binary.yaml", None, b"\x7fELF\x02\x01\x01\x00" + b"\x00" * 56, None, "binary", **W)

# ---- HF configs (params on the file; and a scenario whose model.hf_config names it) ------------------
Q = json.loads((ROOT / "tests" / "data" / "hf" / "Qwen3-30B-A3B" / "config.json").read_text())


def hfc(**changes):
    q = dict(Q)
    for k, v in changes.items():
        if v is DEL:
            q.pop(k)
        else:
            q[k] = v
    return json.dumps(q, indent=1)


H = "hf/"
W = {"wrap": "hf"}
put(H + "not_an_object.json", None, "[1, 2, 3]", None, "expected a JSON object", **W)
put(H + "a_string.json", None, '"config"', None, "expected a JSON object", **W)
put(H + "empty.json", None, "", None, "HF config is empty", **W)
put(H + "trailing_comma.json", None, '{"model_type": "qwen3_moe",}', None, "not valid JSON at line 1", **W)
put(H + "binary.json", None, b"PK\x03\x04" + b"\x00" * 40, None, "binary", **W)
put(H + "deep_nesting.json", None, "[" * 2000 + "]" * 2000, None, "nested too deeply", **W)
put(
    H + "unsupported_model_type.json",
    None,
    hfc(model_type="gpt2"),
    "model_type",
    ["unsupported", "qwen3_moe"],
    **W,
)
put(H + "missing_model_type.json", None, hfc(model_type=DEL), "model_type", "required key", **W)
put(H + "missing_hidden_size.json", None, hfc(hidden_size=DEL), "hidden_size", "missing", **W)
put(
    H + "layers_float.json", None, hfc(num_hidden_layers=48.5), "num_hidden_layers", "must be an integer", **W
)
put(H + "experts_zero.json", None, hfc(num_experts=0), "num_experts", "must be >= 1", **W)
put(
    H + "top_k_above_experts.json",
    None,
    hfc(num_experts_per_tok=512),
    "num_experts_per_tok",
    "exceeds num_experts",
    **W,
)
put(
    H + "kv_heads_not_dividing.json",
    None,
    hfc(num_key_value_heads=5),
    "num_kv_heads",
    "must be a multiple",
    **W,
)
put(H + "absurd_hidden_size.json", None, hfc(hidden_size=10**40), "hidden_size", "less than or equal to", **W)
put(
    H + "bool_not_bool.json",
    None,
    hfc(tie_word_embeddings="yes"),
    "tie_word_embeddings",
    "true or false",
    **W,
)
put(
    H + "mlp_only_layers_string.json",
    None,
    hfc(mlp_only_layers="0,1"),
    "mlp_only_layers",
    "list of layer indices",
    **W,
)

# ---- calibration and router trace files (named by a scenario) -----------------------------------------
F = "files/"
C = {"format": "moesim.calibration", "version": 1}
W = {"wrap": "calibration"}
put(F + "calibration_not_one.json", None, json.dumps({"links": {}}), "format", "not a calibration file", **W)
put(
    F + "calibration_version_9.json",
    None,
    json.dumps({**C, "version": 9}),
    "version",
    "unsupported version 9",
    **W,
)
put(
    F + "calibration_negative_bw.json",
    None,
    json.dumps({**C, "links": {"inter": {"alpha_us": 5, "bw_GBps": -46}}}),
    "links.inter.bw_GBps",
    "greater than 0",
    **W,
)
put(
    F + "calibration_links_not_mapping.json",
    None,
    json.dumps({**C, "links": 5}),
    "links",
    "valid dictionary",
    **W,
)
put(
    F + "calibration_unknown_link.json",
    None,
    json.dumps({**C, "links": {"nvlink": {"alpha_us": 1, "bw_GBps": 1}}}),
    "links",
    "unknown link class",
    **W,
)
put(
    F + "calibration_syntax.json",
    None,
    '{"format": "moesim.calibration", "version": 1',
    None,
    "not valid JSON",
    **W,
)
TR = {"format": TFORMAT, "version": TVERSION}
HDR = {
    "num_experts": 16,
    "top_k": 2,
    "ep": 16,
    "world_size": 16,
    "moe_layers": 2,
    "tokens_per_micro_batch": 32,
}
W = {"wrap": "trace"}
put(F + "trace_not_a_trace.json", None, json.dumps({"records": []}), "format", "not a router trace", **W)
put(
    F + "trace_records_not_list.json",
    None,
    json.dumps({**TR, **HDR, "records": {"0": 1}}),
    "records",
    "must be a list",
    **W,
)
put(
    F + "trace_no_header.json",
    None,
    json.dumps({**TR, "records": [{"step": 0}]}),
    "num_experts",
    "positive integer",
    **W,
)
RECS = [
    {"step": 0, "micro_batch": 0, "layer": layer, "rank": r, "assigned": [4] * 16}
    for layer in range(2)
    for r in range(16)
]
RECS[0] = {**RECS[0], "assigned": ["a"] * 16}
put(
    F + "trace_counts_wrong.json",
    None,
    json.dumps({**TR, **HDR, "records": RECS}),
    "records[0]",
    "non-negative integer counts",
    **W,
)
put(
    F + "trace_huge_step.json",
    None,
    json.dumps(
        {
            **TR,
            **HDR,
            "records": [{"step": 10**12, "micro_batch": 0, "layer": 0, "rank": 0, "assigned": [4] * 16}],
        }
    ),
    "records",
    "need exactly",
    **W,
)

# GPT-OSS configs: the real GPT-OSS-20B config.json with one field damaged
G = json.loads((ROOT / "validation" / "published" / "models" / "GPT-OSS-20B" / "config.json").read_text())
PAIRS = ["sliding_attention", "full_attention"]
for rel, changes, field, contains in [
    ("gpt_oss_layer_types_irregular.json", {"layer_types": ["sliding_attention"] * 3 + ["full_attention"] * 21},
     "layer_types", "repeating run"),
    ("gpt_oss_layer_types_short.json", {"layer_types": PAIRS * 10}, "layer_types", "20 entries"),
    ("gpt_oss_layer_types_unknown.json", {"layer_types": ["chunked_attention"] * 24}, "layer_types",
     "sliding_attention / full_attention"),
    ("gpt_oss_swiglu_limit_string.json", {"swiglu_limit": "seven"}, "swiglu_limit", "positive number"),
]:  # fmt: skip
    put(H + rel, None, json.dumps({**G, **changes}, indent=1) + "\n", field, contains, wrap="hf")

header = """# The bad-input corpus: every file here must make `moesim check`, `moesim params` and `moesim route`
# exit 2 with a one-line message that names the file and the field (tests/test_bad_inputs.py).
#
#   FILE: {what: the damage, field: what the message must name (null: the whole file is unusable),
#          contains: [fragments of the message], names: the file the message names (default FILE),
#          wrap: how FILE is fed in (default: FILE is the scenario; topology / hf / calibration / trace:
#                a small valid scenario names it in cluster.topology / model.hf_config / calibration /
#                routing.trace; hf files are also given to `moesim params` directly)}
"""
(OUT / "expected.yaml").write_text(
    header + yaml.safe_dump(EXPECTED, sort_keys=True, width=200, allow_unicode=True)
)
print(len(EXPECTED))

"""Training-framework semantics (``training.framework: deepspeed | megatron | fsdp2``) against closed forms.

One small MoE (3 MoE layers, d 512, 8 experts top-2, untied 4096-token vocabulary) on 2 x DGX-H100
(16 GPUs, ep 4, dp 16, edp 4), 3 micro-batches per step. Every gradient reduction and parameter gather a
framework issues is a span on rank 0's comm stream (``grad_sync`` / ``param_gather``, with its ``bytes``
and collective ``kind``); their counts and bytes per step are derived by hand from the documented model
(docs/scenarios.md "frameworks", sim/frameworks/policies.py):

- megatron: gradients reduce-scattered once per step (last micro-batch), in buckets of
  max(40M, 1M x dp) elements; parameters all-gathered once per step, layer by layer;
- fsdp2: per block, an all-gather before its forward and (``reshard_after_forward``) again before its
  backward, a reduce-scatter after its backward, in every micro-batch;
- deepspeed: ZeRO-0 one all-reduce after the last backward, ZeRO-1 all-reduce in the last micro-batch +
  post-step all-gather, ZeRO-2 all-reduce in every micro-batch + post-step all-gather, ZeRO-3 like FSDP2.

Memory per GPU (weights, gradients, optimizer states) against ZeRO's formulas per framework.
"""

from __future__ import annotations

from collections import Counter

import pytest

from sim.api import scenario_from_dict, simulate
from sim.model.memory import GiB
from sim.model.params import count_params

# the model, by hand
D, HEADS, KV, VOCAB, E, TOPK, FFN, LAYERS = 512, 8, 4, 4096, 8, 2, 256, 3
HD = D // HEADS
EP, NODES, MICRO = 4, 2, 3
WORLD = 8 * NODES
DP, EDP = WORLD, WORLD // EP
ATTN = D * HEADS * HD * 2 + 2 * D * KV * HD  # q, o + k, v (no biases)
NORMS = 2 * D  # two RMSNorms per layer
ROUTER = E * D
EXPERT = 3 * D * FFN  # gated: gate, up, down
LAYER_NE = ATTN + NORMS + ROUTER  # non-expert params of one layer (tp 1)
LAYER_EX = EXPERT * E // EP  # one rank's experts of one layer
EMB = VOCAB * D
HEAD = VOCAB * D + D  # LM head and the final norm
NE = LAYERS * LAYER_NE + EMB + HEAD  # non-expert params per rank
EX = LAYERS * LAYER_EX  # expert params per rank
BF16 = 2


def _doc(framework: str, *, zero: int = 1, nodes: int = NODES, vocab: int = VOCAB, **training) -> dict:
    return {
        "name": f"fw-{framework}",
        "cluster": {"topology": "dgx-h100", "nodes": nodes},
        "model": {"name": "tiny-moe", "num_layers": LAYERS, "hidden_size": D, "num_attention_heads": HEADS,
                  "num_kv_heads": KV, "vocab_size": vocab, "ffn_type": "gated", "moe_ffn_hidden_size": FFN,
                  "num_experts": E, "top_k": TOPK},
        "parallelism": {"ep": EP, "zero_stage": zero},
        "training": {"micro_batch_size": 1, "seq_len": 512, "grad_accum_steps": MICRO, "dtype": "bf16",
                     "framework": framework, **training},
        "routing": {"generator": "balanced", "dispatch": "dropless", "capacity_factor": None},
    }  # fmt: skip


def _scenario(framework: str, **kw):
    return scenario_from_dict(_doc(framework, **kw))


def _comm(r) -> list:
    """Rank 0's data-parallel collectives of the step (comm-stream spans), in time order."""
    return sorted((sp for sp in r.spans if sp.rank == 0 and sp.stream == "comm"), key=lambda sp: sp.start)


def _tally(spans) -> tuple[Counter, Counter]:
    count, nbytes = Counter(), Counter()
    for sp in spans:
        key = (sp.name, sp.args["kind"])
        count[key] += 1
        nbytes[key] += sp.args["bytes"]
    return count, nbytes


def test_the_small_model_has_the_hand_counted_parameters():
    c = count_params(_scenario("megatron").model)
    assert c.attention == LAYERS * ATTN
    assert c.router == LAYERS * ROUTER
    assert c.expert == LAYERS * E * EXPERT
    assert c.embedding == 2 * VOCAB * D
    assert c.norms == LAYERS * NORMS + D
    assert c.total == NE + LAYERS * E * EXPERT
    s = _scenario("megatron")
    assert (s.dp, s.edp, s.experts_per_rank) == (DP, EDP, E // EP)


ALL = (NE + EX) * BF16  # every parameter of a rank once, in bf16
REGATHER = (NE - EMB + EX) * BF16  # the backward's re-gather: everything but the embedding table
#: FSDP2 keeps the root module gathered from forward to backward (torch _fsdp_state._lazy_init): its
#: re-gather leaves out the LM head and the final norm as well
REGATHER_FSDP2 = (NE - EMB - HEAD + EX) * BF16

#: (framework, training fields, zero stage) -> {(span, kind): (count per step, bytes per step)}
CASES = {
    "megatron": ("megatron", {}, 1, {
        ("grad_sync", "reduce_scatter"): (2, ALL),  # one bucket over dp, one over edp, last micro-batch only
        ("param_gather", "all_gather"): (2 * LAYERS, ALL),  # once per step, layer by layer, dp and edp
    }),
    "fsdp2-reshard": ("fsdp2", {}, 1, {
        # per micro-batch: head, 3 layers, embedding over dp; 3 layers over edp
        ("grad_sync", "reduce_scatter"): (MICRO * (LAYERS + 2 + LAYERS), MICRO * ALL),
        # per micro-batch and block: before its forward and before its backward, dp and edp
        ("param_gather", "all_gather"): (MICRO * 4 * LAYERS, MICRO * (ALL + REGATHER_FSDP2)),
    }),
    "fsdp2-keep": ("fsdp2", {"reshard_after_forward": False}, 1, {
        ("grad_sync", "reduce_scatter"): (MICRO * (LAYERS + 2 + LAYERS), MICRO * ALL),
        ("param_gather", "all_gather"): (MICRO * 2 * LAYERS, MICRO * ALL),  # forward only
    }),
    "zero0": ("deepspeed", {}, 0, {
        ("grad_sync", "all_reduce"): (2, ALL),  # everything after the last backward
    }),
    "zero1": ("deepspeed", {}, 1, {
        ("grad_sync", "all_reduce"): (2, ALL),  # last micro-batch
        ("param_gather", "all_gather"): (2, ALL),  # after the optimizer
        ("grad_norm", "all_reduce"): (3, 12.0),  # dp, then the experts' dp and edp, one fp32 each
    }),
    "zero2": ("deepspeed", {}, 2, {
        ("grad_sync", "all_reduce"): (2 * MICRO, MICRO * ALL),  # every micro-batch
        ("param_gather", "all_gather"): (2, ALL),
        ("grad_norm", "all_reduce"): (3, 12.0),
    }),
    "zero3": ("deepspeed", {}, 3, {
        ("grad_sync", "reduce_scatter"): (2 * MICRO, MICRO * ALL),  # one 500M-element bucket per micro-batch
        ("param_gather", "all_gather"): (MICRO * 4 * LAYERS, MICRO * (ALL + REGATHER)),
        ("grad_norm", "all_reduce"): (3, 12.0),
    }),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_collectives_per_step_match_the_closed_form(case):
    framework, training, zero, expected = CASES[case]
    r = simulate(_scenario(framework, zero=zero, **training), trace_ranks={0})
    count, nbytes = _tally(_comm(r))
    assert set(count) == set(expected), case
    for key, (n, b) in expected.items():
        assert count[key] == n, (case, key)
        assert nbytes[key] == pytest.approx(b, rel=1e-12), (case, key)
    assert r.layout["framework"] == framework


def test_fsdp2_collectives_are_per_block():
    """The byte sizes of FSDP2's reduce-scatters and gathers are those of single blocks."""
    r = simulate(_scenario("fsdp2"), trace_ranks={0})
    spans = _comm(r)
    rs = Counter(sp.args["bytes"] for sp in spans if sp.name == "grad_sync")
    ne, ex = LAYER_NE * BF16, LAYER_EX * BF16
    assert rs == {HEAD * BF16: MICRO, ne: LAYERS * MICRO, ex: LAYERS * MICRO, EMB * BF16: MICRO}
    ag = Counter(sp.args["bytes"] for sp in spans if sp.name == "param_gather")
    # the first forward gather brings the embedding and head with layer 0; they stay gathered through the
    # backward (FSDP2 does not reshard the root module), so every backward gather is one layer's
    assert ag == {ne + (EMB + HEAD) * BF16: MICRO, ne: (2 * LAYERS - 1) * MICRO, ex: 2 * LAYERS * MICRO}


def _kernel_spans(r):
    return [sp for sp in r.spans if sp.rank == 0 and sp.stream == "compute" and "phase" in sp.args]


def test_megatron_reduces_in_the_last_micro_batch_and_gathers_in_the_first():
    r = simulate(_scenario("megatron"), trace_ranks={0})
    kernels, comm = _kernel_spans(r), _comm(r)
    last_bwd = min(sp.start for sp in kernels if sp.args["micro"] == MICRO - 1 and sp.args["phase"] == "bwd")
    first_bwd = min(sp.start for sp in kernels if sp.args["micro"] == 0 and sp.args["phase"] == "bwd")
    grads = [sp for sp in comm if sp.name == "grad_sync"]
    gathers = [sp for sp in comm if sp.name == "param_gather"]
    assert grads and all(sp.start >= last_bwd for sp in grads)
    assert gathers and all(sp.start < first_bwd for sp in gathers)
    assert min(sp.start for sp in gathers) == 0.0  # align_param_gather: the first bucket starts the step


def test_fsdp2_reduces_during_every_micro_batch():
    r = simulate(_scenario("fsdp2"), trace_ranks={0})
    kernels, comm = _kernel_spans(r), _comm(r)
    grads = [sp for sp in comm if sp.name == "grad_sync"]
    for micro in range(1, MICRO):
        bwd = min(sp.start for sp in kernels if sp.args["micro"] == micro and sp.args["phase"] == "bwd")
        early = [sp for sp in grads if sp.start < bwd]
        # the reduce-scatters of the micro-batches before, each issued during its own backward
        assert len(early) == micro * (2 * LAYERS + 2), micro


@pytest.mark.parametrize("nodes", [2, 8])
def test_megatron_bucket_is_max_40m_or_1m_per_dp_rank(nodes):
    """A 20 x 4096 = 81920-token vocabulary: the LM head alone (41.9M params) fills a 40M-element bucket at
    dp 16 (two dense reduce-scatters: the head, then the rest); at dp 64 the bucket is 64M elements and the
    dense gradients go in one."""
    vocab = 20 * VOCAB
    head, emb = vocab * D + D, vocab * D
    r = simulate(_scenario("megatron", nodes=nodes, vocab=vocab), trace_ranks={0})
    grads = [sp.args["bytes"] for sp in _comm(r) if sp.name == "grad_sync"]
    dense = [b for b in grads if b != LAYER_EX * LAYERS * BF16]
    assert len(grads) == len(dense) + 1
    total = (LAYERS * LAYER_NE + emb + head) * BF16
    assert sum(dense) == total
    if nodes == 8:  # dp 64: max(40M, 64M) = 64M elements > the 41.9M of the head alone
        assert dense == [total]
    else:  # dp 16: 40M elements, filled by the head (the first gradients of the backward)
        assert dense == [head * BF16, (LAYERS * LAYER_NE + emb) * BF16]


@pytest.mark.parametrize("framework", ["megatron", "fsdp2"])
def test_zero_stage_is_ignored_outside_deepspeed(framework):
    runs = [simulate(_scenario(framework, zero=z), trace_ranks={0}) for z in (0, 3)]
    a, b = ([(sp.name, sp.args["kind"], sp.args["bytes"]) for sp in _comm(r)] for r in runs)
    assert a == b
    assert runs[0].memory == runs[1].memory
    assert runs[0].step_time_s == runs[1].step_time_s


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


#: weights, gradients, optimizer bytes per GPU (Adam, mixed precision: K = 12 B)
MEMORY = {
    # Megatron-Core's grad buffer in the params' dtype unless gradients are reduced in fp32 (below)
    ("megatron", 1): ((NE + EX) * BF16, (NE + EX) * BF16, (_ceil(NE, DP) + _ceil(EX, EDP)) * 12),
    # plus the unsharded copies its all-gathers hold: the root (embedding, final norm, head) and the block
    # computing with the one prefetched (experts too: they are sharded over edp > 1)
    ("fsdp2", 1): ((_ceil(NE, DP) + _ceil(EX, EDP) + EMB + HEAD + 2 * (LAYER_NE + LAYER_EX * (EDP > 1))) * BF16,
                   (_ceil(NE, DP) + _ceil(EX, EDP)) * BF16, (_ceil(NE, DP) + _ceil(EX, EDP)) * 12),
    ("deepspeed", 0): ((NE + EX) * BF16, (NE + EX) * BF16, (NE + EX) * 12),
    ("deepspeed", 1): ((NE + EX) * BF16, (NE + EX) * BF16, (_ceil(NE, DP) + _ceil(EX, EDP)) * 12),
    ("deepspeed", 2): ((NE + EX) * BF16, (_ceil(NE, DP) + _ceil(EX, EDP)) * BF16,
                       (_ceil(NE, DP) + _ceil(EX, EDP)) * 12),
    ("deepspeed", 3): ((_ceil(NE, DP) + _ceil(EX, EDP)) * BF16, (_ceil(NE, DP) + _ceil(EX, EDP)) * BF16,
                       (_ceil(NE, DP) + _ceil(EX, EDP)) * 12),
}  # fmt: skip


@pytest.mark.parametrize("framework,zero", list(MEMORY))
def test_model_state_memory_per_framework(framework, zero):
    w, g, o = MEMORY[(framework, zero)]
    mem = simulate(_scenario(framework, zero=zero)).memory
    assert mem["weights_GiB"] * GiB == pytest.approx(w, rel=1e-12)
    assert mem["gradients_GiB"] * GiB == pytest.approx(g, rel=1e-12)
    assert mem["optimizer_GiB"] * GiB == pytest.approx(o, rel=1e-12)


@pytest.mark.parametrize("framework", ["megatron", "fsdp2"])
def test_sgd_keeps_four_bytes_of_state_per_sharded_param(framework):
    mem = simulate(_scenario(framework, optimizer="sgd")).memory
    assert mem["optimizer_GiB"] * GiB == pytest.approx((_ceil(NE, DP) + _ceil(EX, EDP)) * 4, rel=1e-12)


@pytest.mark.parametrize("framework", ["megatron", "fsdp2"])
def test_fp32_gradient_reduction_doubles_only_the_gradient_bytes(framework):
    """``grad_reduce_dtype: fp32``: 4 B per parameter in every reduce-scatter, parameters still gathered in bf16."""
    bf16, fp32 = (_tally(_comm(simulate(_scenario(framework, **kw), trace_ranks={0})))
                  for kw in ({}, {"grad_reduce_dtype": "fp32"}))  # fmt: skip
    rs, ag = ("grad_sync", "reduce_scatter"), ("param_gather", "all_gather")
    assert fp32[0] == bf16[0]  # the same collectives
    assert fp32[1][rs] == 2 * bf16[1][rs]
    assert fp32[1][ag] == bf16[1][ag]
    if framework == "megatron":  # its grad buffer follows the reduction's dtype (Megatron-Core main_grad)
        mem = [simulate(_scenario(framework, **kw)).memory["gradients_GiB"] * GiB
               for kw in ({}, {"grad_reduce_dtype": "fp32"})]  # fmt: skip
        assert mem == [pytest.approx((NE + EX) * BF16, rel=1e-12), pytest.approx((NE + EX) * 4, rel=1e-12)]

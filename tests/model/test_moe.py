"""The MoE block's routing and its auxiliary losses (engine/model/moe.py, engine/metrics/moe.py).

- ties in the router logits go to the lower expert index (a stable order: every layout routes alike);
- a capacity factor keeps the first copies of each expert in token order and counts the rest as dropped;
- one layer's recorded aux loss is transformers' load_balancing_loss_func of its router logits (the one-batch
  reference);
- a training step's gradient and reported loss are those of the mean over micro-batches of cross-entropy +
  coef * (mean over MoE layers of HF's aux loss) + coef * z-loss, computed by hand from the same batch: a step
  that weighs the aux loss without dividing by the micro-batch count fails it.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from engine.config import ModelConfig, load
from engine.model import moe
from engine.model import transformer as model_lib
from engine.parallel.layout.context import ParallelContext
from tests.cli import launch
from tests.dist import run_ranks

SMALL = [
    "--config",
    "configs/tiny-moe.yaml",
    "--model.hidden_size",
    "64",
    "--model.intermediate_size",
    "96",
    "--model.num_layers",
    "2",
    "--model.num_experts",
    "4",
    "--train.seq_len",
    "32",
    "--train.global_batch_size",
    "4",
    "--train.micro_batch_size",
    "2",
    "--train.lr",
    "0",
    "--train.moe_aux_loss_coef",
    "0.5",
    "--train.moe_z_loss_coef",
    "0.1",
    "--log.progress",
    "false",
]


def test_tied_logits_route_to_the_lower_expert():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0], [2.0, 2.0, 0.0, 2.0]])
    for gating in ("topk_softmax", "softmax_topk"):
        weights, idx = moe.route(logits, 2, gating, True)
        assert idx.tolist() == [[1, 2], [0, 1]]
        assert torch.allclose(weights, torch.full_like(weights, 0.5))


def test_capacity_drops_the_later_copies_and_counts_them():
    m = ModelConfig(
        family="mixtral",
        hidden_size=16,
        intermediate_size=8,
        num_heads=2,
        num_kv_heads=2,
        num_experts=2,
        experts_per_token=1,
        moe_capacity_factor=1.0,
    )
    block = moe.MoE(m).train()
    torch.nn.init.normal_(block.experts.gate_up_proj)
    torch.nn.init.normal_(block.experts.down_proj)
    with torch.no_grad():
        block.gate.weight.copy_(torch.tensor([[1.0] + [0.0] * 15, [0.0] * 16]))  # x[0] > 0 -> expert 0
    x = torch.randn(1, 8, 16)
    x[0, :, 0] = torch.tensor([1.0, 1, 1, 1, 1, 1, -1, -1])  # 6 tokens want expert 0, capacity 8 * 1 / 2 = 4
    out = block(x)
    assert block.records[-1]["dropped"] == 2 and block.records[-1]["counts"].tolist() == [6, 2]
    assert out[0, 4:6].abs().max() == 0 and out[0, :4].abs().min() > 0  # tokens 4, 5 (the later ones) dropped
    block.capacity_factor = 0.0
    assert block(x)[0, 4:6].abs().min() > 0


def test_recorded_aux_loss_is_transformers_load_balancing_loss():
    m = ModelConfig(
        family="qwen2_moe",
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=64,
        num_experts=8,
        experts_per_token=2,
        moe_norm_topk_prob=False,
    )
    model = model_lib.build(m, device="cpu").train()
    torch.nn.init.normal_(model.model.layers["0"].mlp.gate.weight, std=0.5)
    logits = []
    model.model.layers["0"].mlp.gate.register_forward_hook(lambda mod, i, out: logits.append(out))
    model(torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(0)))
    record = model.model.layers["0"].mlp.records[0]
    want = load_balancing_loss_func((logits[0],), 8, 2)
    assert abs(record["aux"].item() - want.item()) <= 1e-6 * want.item()
    assert abs(record["z"].item() - torch.logsumexp(logits[0], -1).pow(2).mean().item()) <= 1e-5


def _step_and_reference(argv: list[str]) -> dict:
    """Rank function (1 rank): one trainer step's gradients and loss, and the same by hand from HF's aux loss."""
    from engine.trainer import Trainer, build_model

    cfg = load(argv)
    ctx = ParallelContext.from_config(cfg)
    trainer = Trainer(cfg, ctx)
    grads = {}
    trainer.observers.append(
        lambda event: (
            event == "update"
            and grads.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()})
        )
    )
    batch = trainer.next_local_batch()
    record = trainer.train_step(batch)

    ref = build_model(cfg, ctx)  # the same initial weights (layout-independent initialisation)
    t, e, k = cfg.train, cfg.model.num_experts, cfg.model.experts_per_token
    gates = []
    for block in moe.moe_blocks(ref):
        block.gate.register_forward_hook(lambda mod, i, out: gates.append(out))
    micro = batch.split(t.micro_batch_size)
    total = 0.0
    for mb in micro:
        gates.clear()
        ce = F.cross_entropy(ref(mb[:, :-1]).flatten(0, 1).float(), mb[:, 1:].flatten())
        aux = torch.stack([load_balancing_loss_func((g,), e, k) for g in gates]).mean()
        z = torch.stack([torch.logsumexp(g.float(), -1).pow(2).mean() for g in gates]).mean()
        total = total + (ce + t.moe_aux_loss_coef * aux + t.moe_z_loss_coef * z) / len(micro)
    total.backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    return {"loss": record["loss"], "want_loss": total.item(), "grads": grads, "want": want}


def test_step_gradient_is_the_micro_batch_mean_of_ce_plus_aux_and_z(tmp_path):
    got = run_ranks(_step_and_reference, 1, [*SMALL, "--train.out_dir", str(tmp_path / "out")])[0]
    assert abs(got["loss"] - got["want_loss"]) <= 1e-5 * got["want_loss"]
    assert got["grads"].keys() == got["want"].keys()
    router = [n for n in got["want"] if n.endswith("mlp.gate.weight")]
    assert router
    for name, want in got["want"].items():
        err = ((got["grads"][name] - want).abs().max() / want.abs().max()).item()
        assert err <= 1e-5, f"{name}: gradient differs by rel {err:.2e}"


def test_grouped_gemm_path_computes_the_loop():
    """Experts._grouped (CUDA's path, bf16) on the CPU's grouped_mm kernel: the loop's output and weight gradients
    within bf16 rounding (measured 8e-3 relative on this shape), an expert with no tokens included."""
    torch.manual_seed(0)
    experts = moe.Experts(4, 64, 32, "mixtral")
    torch.nn.init.normal_(experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(experts.down_proj, std=0.1)
    x, counts = torch.randn(40, 64), torch.tensor([10, 0, 25, 5])
    got, want = [], []
    for run, out in ((experts._grouped, got), (experts, want)):
        experts.zero_grad()
        y = run(x, counts)
        y.pow(2).sum().backward()
        out += [y.detach(), experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()]
    for g, w in zip(got, want):
        assert ((g - w).abs().max() / w.abs().max()).item() <= 2e-2


def test_moe_metrics_reach_tensorboard_tags():
    from engine.metrics.tensorboard import scalars

    tags = scalars(
        {
            "loss": 2.0,
            "lm_loss": 1.9,
            "moe_aux_loss": 1.1,
            "moe_z_loss": 3.0,
            "moe_dropped_tokens": 0,
            "moe_tokens_per_expert_min": 5,
            "moe_tokens_per_expert_max": 9,
            "moe_tokens_per_expert_cv": 0.2,
        }
    )
    assert tags["loss/lm"] == 1.9 and tags["moe/aux_loss"] == 1.1 and tags["moe/tokens_per_expert_cv"] == 0.2
    assert tags["moe/dropped_tokens"] == 0 and tags["moe/tokens_per_expert_max"] == 9


def test_mfu_counts_the_active_parameters():
    """6N of MFU takes N = the matmul weights one token passes through: the meta model's linears with each MoE
    layer's stacked experts counted k/E (Mixtral 8x7B: 12.7B of its 46.7B; 12.9B with the embedding)."""
    from engine.model.flops import matmul_params

    for name in ("mixtral-8x7b", "qwen1.5-moe-a2.7b", "olmoe-1b-7b", "tiny-moe"):
        m = load(["--config", f"configs/{name}.yaml"]).model
        active = 0.0
        for pname, p in model_lib.build(m).named_parameters():
            if "embed_tokens" in pname or "norm" in pname or pname.endswith("bias"):
                continue
            active += p.numel() * (m.experts_per_token / m.num_experts if ".experts." in pname else 1)
        assert matmul_params(m) == round(active), name


def test_stacked_experts_are_the_published_per_expert_tensors():
    """part_blocks of the stacked weights: Mixtral's w1/w3/w2 of each expert under block_sparse_moe (the router its
    gate), Qwen2-MoE/OLMoE's gate/up/down_proj under mlp; a slice of dim 0 (expert parallelism) keeps global names."""
    from engine.model.fused import part_blocks

    mixtral = moe.MoE(
        ModelConfig(family="mixtral", hidden_size=8, intermediate_size=4, num_heads=2, num_kv_heads=2, num_experts=3)
    )
    prefix = "model.layers.5.mlp"
    blocks = part_blocks(mixtral.experts, f"{prefix}.experts.gate_up_proj", torch.Size([3, 8, 8]))
    assert [(n, at, tuple(s)) for n, at, s in blocks[:3]] == [
        ("model.layers.5.block_sparse_moe.experts.0.w1.weight", 0, (4, 8)),
        ("model.layers.5.block_sparse_moe.experts.0.w3.weight", 32, (4, 8)),
        ("model.layers.5.block_sparse_moe.experts.1.w1.weight", 64, (4, 8)),
    ]
    assert (
        part_blocks(mixtral.gate, f"{prefix}.gate.weight", torch.Size([3, 8]))[0][0]
        == "model.layers.5.block_sparse_moe.gate.weight"
    )
    qwen = moe.MoE(
        ModelConfig(family="qwen2_moe", hidden_size=8, intermediate_size=4, num_heads=2, num_kv_heads=2, num_experts=4)
    )
    qwen.experts.first_expert = 2
    down = part_blocks(qwen.experts, f"{prefix}.experts.down_proj", torch.Size([2, 8, 4]))
    assert [(n, at) for n, at, _ in down] == [
        ("model.layers.5.mlp.experts.2.down_proj.weight", 0),
        ("model.layers.5.mlp.experts.3.down_proj.weight", 32),
    ]


def test_plot_adds_the_moe_panels(tmp_path):
    import sys
    from pathlib import Path

    import pytest

    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launch"))
    import plot

    records = [
        {
            "step": s,
            "loss": 8 - s / 10,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "tokens_per_s": 10.0,
            "moe_aux_loss": 2.0 + s / 100,
            "moe_z_loss": 4.0,
            "moe_tokens_per_expert_cv": 0.3,
        }
        for s in (1, 2)
    ]
    fig = plot.plot({"moe": records}, tmp_path / "moe.png")
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles[-3:] == ["MoE load-balancing loss", "Tokens per expert", "Router z-loss"]
    assert (
        len(
            plot.plot(
                {"dense": [{k: v for k, v in r.items() if not k.startswith("moe")} for r in records]},
                tmp_path / "dense.png",
            ).axes
        )
        == 6
    )  # a dense run keeps the 2 x 3 grid


def test_an_moe_family_without_moe_layers_trains_as_the_dense_model(tmp_path):
    """Issue 42 item 8: ``moe_layers: []`` on an MoE family averaged its aux and z losses over zero layers (0/0):
    a NaN loss from step 1, every update skipped, then an abort advising a lower learning rate. The model has no
    router and no experts: it is the dense llama of the same shape (the same names, so the same initial weights),
    and trains to its losses exactly."""
    common = [*SMALL, "--train.steps", "3", "--train.lr", "3e-3", "--log.progress", "false"]
    dense = launch(
        "pretrain.py",
        *common,
        "--model.family",
        "llama",
        "--model.num_experts",
        "0",
        "--train.out_dir",
        tmp_path / "dense",
    )
    assert dense.returncode == 0, dense.stdout[-2000:] + dense.stderr[-2000:]
    none = launch("pretrain.py", *common, "--model.moe_layers", "[]", "--train.out_dir", tmp_path / "none")
    assert none.returncode == 0, none.stdout[-2000:] + none.stderr[-2000:]
    assert "no layer of this mixtral model has experts, so it trains as the dense model" in none.stdout
    assert "not finite" not in none.stdout, none.stdout[-2000:]
    records = {
        name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("dense", "none")
    }
    losses = {name: [r["loss"] for r in got] for name, got in records.items()}
    assert len(losses["none"]) == 3 and losses["none"] == losses["dense"], losses
    assert losses["none"][2] != losses["none"][0], "the model did not train"
    assert not any(key.startswith("moe_") for r in records["none"] for key in r), records["none"][0]

"""``model.cuda_graphs``: the padded shapes, the preflight's refusals, and the trainer's plumbing
around the graphed body (its weights cast inside the body's own forward, only the LM head cast
outside). Recording and replaying graphs needs CUDA: ``tests/gpu/test_cuda_graphs_gpu.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.config.loading import build_config
from posttrain.errors import TrainingError
from posttrain.models import cuda_graphs
from posttrain.models.cuda_graphs import AliasedBody, GraphedBody, graph_shape
from posttrain.models.precision import compute_weights, resolve_precision
from posttrain.preflight import cuda_graphs as preflight
from posttrain.preflight.findings import Findings
from posttrain.preflight.grpo import grpo_preflight

ON = "model.cuda_graphs=true"


@pytest.mark.parametrize(
    ("rows", "length", "shape"),
    [
        (1, 1, (1, 64)),
        (6, 50, (8, 64)),
        (32, 64, (32, 64)),
        (33, 65, (64, 128)),
        (64, 1024, (64, 1024)),
        (64, 1025, (64, 1280)),
        (3, 2049, (4, 2304)),
    ],
)
def test_batches_pad_up_to_few_shapes(rows: int, length: int, shape: tuple[int, int]) -> None:
    assert graph_shape(rows, length) == shape


def test_an_empty_batch_has_no_shape() -> None:
    with pytest.raises(ValueError, match=r"at least one row and one token, got \[0, 5\]"):
        graph_shape(0, 5)


def _errors(*overrides: str, cuda_major: int | None = 13) -> list[str]:
    findings = Findings()
    preflight.check_cuda_graphs(build_config(None, list(overrides)), findings, cuda_major=cuda_major)
    return findings.errors


def test_auto_by_default_is_never_refused_and_a_plain_cuda_policy_passes(model_dir: Path) -> None:
    assert build_config(None, []).model.cuda_graphs == "auto"
    assert _errors(f"model.name_or_path={model_dir}", "model.device=cuda", "model.compile=true") == []  # auto
    assert _errors("model.cuda_graphs=false", "model.device=cpu") == []
    assert _errors(ON, f"model.name_or_path={model_dir}", "model.device=cuda") == []
    assert _errors(ON, f"model.name_or_path={model_dir}", "model.share_prompt_prefix=auto") == []


@pytest.mark.parametrize(
    ("overrides", "cuda_major", "message"),
    [
        (["model.device=cpu"], 13, "records CUDA graphs, but model.device=cpu"),
        (["model.device=auto"], None, "model.device=auto means the CPU (torch is a CPU build)"),
        (["grid.shapes.policy=[1,2]"], 13, "one policy rank only, and the grid has 2"),
        (["model.compile=true"], 13, "cannot be combined with model.compile=true"),
        (["model.lora.rank=8"], 13, "cannot be combined with LoRA (model.lora.rank > 0)"),
        (["model.gradient_checkpointing=true"], 13, "cannot be combined with model.gradient_checkpointing=true"),
        (["model.sequence_packing=true"], 13, "cannot be combined with model.sequence_packing=true"),
        (["model.share_prompt_prefix=true"], 13, "or set model.share_prompt_prefix=auto"),
    ],
)
def test_what_the_graphs_cannot_take_is_refused_by_name(
    overrides: list[str], cuda_major: int | None, message: str
) -> None:
    errors = _errors(ON, "model.device=cuda", *overrides, cuda_major=cuda_major)
    errors = [e for e in errors if message in e]
    assert len(errors) == 1 and "model.cuda_graphs=false" in errors[0], errors


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"num_local_experts": 4, "num_experts_per_tok": 2}, "is a sparse-MoE model, whose routing a graph cannot"),
        ({"vision_config": {"depth": 2}}, "is a vision-language model, whose image inputs vary per batch"),
    ],
)
def test_moe_and_vision_policies_are_refused_with_their_config_file(
    model_dir: Path, extra: dict[str, Any], message: str
) -> None:
    config = model_dir / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **extra}))
    (error,) = _errors(ON, f"model.name_or_path={model_dir}", "model.device=cuda")
    assert f"{config} {message}" in error


def test_the_run_preflight_reports_it_before_any_model_loads(model_dir: Path) -> None:
    errors = grpo_preflight(build_config(None, [ON, f"model.name_or_path={model_dir}", "model.device=cpu"])).errors
    assert any("model.cuda_graphs=true records CUDA graphs, but model.device=cpu" in e for e in errors), errors


def _choice(*overrides: str, device: str = "cuda", ranks: int = 1, **flags: bool) -> Any:
    cfg = build_config(None, list(overrides))
    kinds = {"moe": False, "vision": False, "reference": False} | flags
    return cuda_graphs.cuda_graphs_choice(cfg, device_type=device, policy_ranks=ranks, params=134_515_008, **kinds)


def test_a_cpu_policy_gets_no_graphed_body_and_the_reason(tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = build_config(None, [f"model.name_or_path={tiny_model_dir}"])
    precision = resolve_precision("float32", "auto", torch.device("cpu"))
    assert cuda_graphs.graphed_body_for(model, cfg, precision, 1, reference=False) == (
        None,
        "model.cuda_graphs=auto: off, the policy is on cpu, not CUDA",
    )
    with pytest.raises(TrainingError, match="needs the policy on one CUDA device"):
        cuda_graphs.graphed_body_for(model, build_config(None, [ON]), precision, 1, reference=False)


def test_auto_graphs_the_default_recipes_small_update_on_a_gpu() -> None:
    # the default recipe: 32 rows a micro-batch, 16 new tokens, SmolLM2-135M
    assert _choice() == (True, "model.cuda_graphs=auto: on (a small update: 6.9e+10 <= 2.5e+11)")
    assert _choice("model.cuda_graphs=true", device="cpu") == (True, "model.cuda_graphs=true")  # as set
    assert _choice("model.cuda_graphs=false") == (False, "model.cuda_graphs=false")


@pytest.mark.parametrize(
    ("overrides", "kwargs", "why"),
    [
        ([], {"device": "cpu"}, "the policy is on cpu, not CUDA"),
        ([], {"ranks": 2}, "2 policy ranks"),
        (["model.compile=true"], {}, "model.compile=true"),
        (["model.lora.rank=8"], {}, "LoRA is on"),
        (["model.gradient_checkpointing=true"], {}, "gradient checkpointing is on"),
        (["model.sequence_packing=true"], {}, "sequence packing is on"),
        (["model.share_prompt_prefix=true"], {}, "model.share_prompt_prefix=true"),
        ([], {"moe": True}, "a sparse-MoE policy"),
        ([], {"vision": True}, "a vision-language policy"),
        ([], {"reference": True}, "a KL reference runs beside it (its eager logprobs would differ"),
        (["rollout.max_tokens=256"], {}, "the update is large enough to keep the GPU busy (parameters x micro-batch"),
    ],
)
def test_auto_stays_off_where_the_graphs_do_not_pay_or_cannot_run_and_says_why(
    overrides: list[str], kwargs: dict[str, Any], why: str
) -> None:
    on, note = _choice(*overrides, **kwargs)
    assert not on and note.startswith(f"model.cuda_graphs=auto: off, {why}"), note


def _trainer(model_dir: str, compute_dtype: str, share: str = "false") -> Any:
    from transformers import AutoModelForCausalLM

    from posttrain.policy.objective import grpo_objective
    from posttrain.policy.trainer import PolicyTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    overrides = [f"model.name_or_path={model_dir}", f"model.compute_dtype={compute_dtype}"]
    overrides += [f"model.share_prompt_prefix={share}"]  # auto shares these short prompts on a CPU
    overrides += ["rl.group_size=4", "rl.batch_per_replica=8", "rl.micro_batch_per_replica=4", "rl.optimizer.lr=1e-3"]
    cfg = build_config(None, overrides)
    return PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=0)


def _batch() -> Any:
    from posttrain.policy.train_batch import TrainBatch

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (9, 13)]
    completions = [torch.randint(100, 40000, (3 + i,), generator=g).tolist() for i in range(8)]
    return TrainBatch(
        prompt_ids=[prompts[i // 4] for i in range(8)],
        completion_ids=completions,
        advantages_B=torch.randn(8, generator=g),
        in_loss_B=torch.ones(8, dtype=torch.bool),
        sampler_logprobs=[[-10.0] * len(c) for c in completions],
        group_size=4,
    )


def _grads_after_one_update(trainer: Any) -> torch.Tensor:
    grads: list[torch.Tensor] = []
    original = trainer._optimizer_step

    def recorded(step: int) -> float:
        grads.append(torch.cat([p.grad.flatten().clone() for p in trainer.model.parameters()]))
        return original(step)

    trainer._optimizer_step = recorded
    trainer.train_on(_batch(), 1)
    return grads[0]


@pytest.mark.parametrize(
    ("compute_dtype", "tolerance", "share"),
    [("float32", 1e-6, "false"), ("bfloat16", 2e-2, "false"), ("bfloat16", 2e-2, "auto")],
)
def test_the_trainer_around_the_graphed_body_computes_the_plain_update(
    tiny_model_dir: str, compute_dtype: str, tolerance: float, share: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a CPU no graph can be recorded; with no shape left to record, the graphed body runs its
    # eager path, which is the graphs' own forward: the body casting its weights inside, the
    # trainer casting the LM head only. Over two micro-batches that must give the plain update.
    # A batch that shares its prompts (auto, here) runs eagerly as before, every weight cast.
    plain = _trainer(tiny_model_dir, compute_dtype, share)
    graphed = _trainer(tiny_model_dir, compute_dtype, share)
    monkeypatch.setattr(cuda_graphs, "MAX_SHAPES", 0)
    body = graphed.model.get_decoder()
    graphed.graphs = GraphedBody(body, graphed.precision)
    casts: list[torch.dtype] = []
    body.embed_tokens.register_forward_pre_hook(lambda module, args: casts.append(module.weight.dtype))
    through_graphs: list[int] = []
    graphed.graphs.eager.register_forward_pre_hook(lambda module, args: through_graphs.append(args[0].shape[0]))
    expected = _grads_after_one_update(plain)
    got = _grads_after_one_update(graphed)
    assert ((got - expected).norm() / expected.norm()).item() <= tolerance
    shared = share == "auto"
    assert graphed._share is shared
    # each unshared micro-batch's body ran through the graphed body's path; a shared one's did not
    assert through_graphs == ([] if shared else [4, 4])
    # and every body call read weights cast to the compute dtype (a shared micro-batch: prompts, then completions)
    assert casts == [getattr(torch, compute_dtype)] * (4 if shared else 2)
    assert graphed.graphs.shapes == []


def _tiny_body(model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).get_decoder()


@pytest.mark.parametrize(("compute_dtype", "tolerance"), [("float32", 0.0), ("bfloat16", 1e-2)])
def test_the_body_over_aliases_computes_the_body_and_its_gradients_are_the_parameters(
    tiny_model_dir: str, compute_dtype: str, tolerance: float
) -> None:
    # what the graphs record: the body reading leaf aliases of its parameters, cast inside
    body = _tiny_body(tiny_model_dir)
    precision = resolve_precision("float32", compute_dtype, torch.device("cpu"))
    aliased = AliasedBody(body, precision)
    ids_BL = torch.randint(100, 40000, (3, 11), generator=torch.Generator().manual_seed(2))
    weight_BLH = torch.randn(3, 11, body.config.hidden_size, generator=torch.Generator().manual_seed(3))

    with compute_weights(body, precision):
        expected = body(input_ids=ids_BL, use_cache=False).last_hidden_state
    (expected.float() * weight_BLH).sum().backward()
    got = aliased(ids_BL)
    assert got.dtype == getattr(torch, compute_dtype)
    assert torch.equal(got, expected.detach())  # the same casts and kernels: bit for bit
    grads = torch.autograd.grad((got.float() * weight_BLH).sum(), aliased.aliases)
    for p, g in zip(aliased.params, grads):
        assert ((g - p.grad).norm() / p.grad.norm()).item() <= tolerance
    assert all(p.grad is not None for p in aliased.params)  # a parameter of the body's is each alias's
    assert all(a.data_ptr() == p.data_ptr() for a, p in zip(aliased.aliases, aliased.params))

    with torch.no_grad():  # the optimizer's in-place update is what the aliases read next
        body.norm.weight.mul_(2.0)
    assert not torch.equal(aliased(ids_BL), got)
    assert all(slot[name] is aliased.params[i] for slot, name, i in aliased._slots)  # put back after each call


def test_the_gradient_buffers_are_handed_out_zeroed_and_kept_for_the_next_step(tiny_model_dir: str) -> None:
    body = _tiny_body(tiny_model_dir)
    graphs = GraphedBody(body, resolve_precision("float32", "auto", torch.device("cpu")))
    graphs._used = {0, 1}  # what a recording's backward reported it has gradients for
    first, second, unused = graphs.aliased.params[0], graphs.aliased.params[1], graphs.aliased.params[2]
    second.grad = torch.full_like(second, 3.0)
    graphs.hand_out_grads()
    assert first.grad is not None and torch.count_nonzero(first.grad) == 0
    assert torch.all(second.grad == 3.0)  # a gradient already there moves into the buffer
    assert unused.grad is None  # no gradient for a parameter the graphs do not train, as in eager
    buffers = (first.grad, second.grad)
    first.grad.fill_(7.0)
    graphs.hand_out_grads()
    assert torch.all(first.grad == 7.0)  # mid-step: accumulated gradients are kept
    first.grad = second.grad = None  # the optimizer's zero_grad(set_to_none=True)
    graphs.hand_out_grads()
    assert first.grad is buffers[0] and second.grad is buffers[1]  # the same buffers, zeroed again
    assert torch.count_nonzero(first.grad) == 0 and torch.count_nonzero(second.grad) == 0

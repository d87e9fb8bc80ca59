"""Mixed precision (fp32 master weights, bf16 compute): the dtype choice per device, the refused
combinations, the cast-once weights against a pure-bf16 copy, ten training steps against fp32,
the rollout engines' dtype, and the CPU default computing in fp32 with nothing entered at all."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from posttrain.config.loading import build_config
from posttrain.distributed.fsdp import mixed_precision_policy
from posttrain.errors import ConfigError
from posttrain.models.precision import compute_weights, precision_conflict, resolve_precision
from posttrain.policy.objective import grpo_objective
from posttrain.policy.train_batch import TrainBatch
from posttrain.policy.trainer import PolicyTrainer, build_reference
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.factory import build_hf_engine, policy_precision, vllm_dtype
from posttrain.rollout.vllm_engine import _engine_args, as_engine_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
G = 4
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21]]
LENGTHS = [3, 5, 1, 4, 6, 2, 2, 3, 5, 5, 1, 2, 4, 4, 4, 7]
# Two mini-batches (the second one's ratio differs from 1) and a KL term: the loss depends on the
# policy's logprobs, so the loss curve shows what the compute dtype changes.
TRAIN = ["rl.batch_per_replica=16", "rl.group_size=4", "rl.mini_batch_per_replica=8", "rl.kl_beta=0.05"]
TRAIN += ["rl.optimizer.lr=1e-3", "model.share_prompt_prefix=false"]
# bf16 keeps an 8-bit significand (7 bits stored + 1 implicit): one rounding is off by at most
# u = 2**-9 ~ 2e-3 relative. Each loss here is a token mean of advantage x ratio terms (plus a small
# KL) of order 1 (|advantage| <= ~2, ratio ~ 1), so an error of one bf16 roundoff on the terms moves
# it by about u x 1 = 2e-3: the tolerance. Errors in the two logprobs of a ratio largely cancel, so
# the runs actually differ by ~2.5e-4 at most over the ten steps (an 8x margin); a wrong-dtype bug
# (bf16 master weights swallowing lr-sized updates, fp16 overflow) lands far outside it.
LOSS_ATOL = 2e-3


def _batch(step: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(step)
    comps = [torch.randint(30, 900, (n,), generator=gen).tolist() for n in LENGTHS]
    adv = torch.randn(len(comps), generator=gen)
    return TrainBatch(
        prompt_ids=[p for p in PROMPTS for _ in range(G)],
        completion_ids=comps,
        advantages_B=adv,
        in_loss_B=torch.ones(len(comps), dtype=torch.bool),
        sampler_logprobs=[[-1.0] * len(c) for c in comps],
        group_size=G,
    )


@contextmanager
def _watch_linear(model: nn.Module) -> Iterator[list[tuple[torch.dtype, bool]]]:
    """(output dtype, autocast enabled) of every forward of the first decoder layer's q projection."""
    seen: list[tuple[torch.dtype, bool]] = []
    proj = model.get_decoder().layers[0].self_attn.q_proj

    def hook(_m: nn.Module, _i: Any, out: torch.Tensor) -> None:
        seen.append((out.dtype, torch.is_autocast_enabled("cpu")))

    handle = proj.register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def _train(model_dir: str, extra: list[str], steps: int = 10) -> tuple[PolicyTrainer, list[float], list[Any]]:
    torch.manual_seed(0)
    cfg = build_config(None, [*TRAIN, *extra])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    objective = grpo_objective(cfg)
    trainer = PolicyTrainer(model, cfg, objective=objective, pad_id=2, ref_model=build_reference(model, cfg, objective))
    with _watch_linear(model) as seen:
        losses = [trainer.train_on(_batch(s), step=s)["train/loss_avg"] for s in range(1, steps + 1)]
    return trainer, losses, seen


# -- the dtype choice --------------------------------------------------------------------------


def test_defaults_per_device() -> None:
    cpu = resolve_precision("auto", "auto", CPU)
    assert (cpu.param_dtype, cpu.compute_dtype, cpu.mixed) == (torch.float32, torch.float32, False)
    gpu = resolve_precision("auto", "auto", CUDA)
    assert (gpu.param_dtype, gpu.compute_dtype, gpu.mixed) == (torch.float32, torch.bfloat16, True)
    # fp32 parameters asked for by name are master weights too: the vLLM engine then runs in bf16
    assert resolve_precision("float32", "auto", CUDA).compute_name == "bfloat16"
    # pure bf16 weights, as model.dtype=bfloat16 always meant
    pure = resolve_precision("bfloat16", "auto", CUDA)
    assert (pure.param_dtype, pure.compute_dtype, pure.mixed) == (torch.bfloat16, torch.bfloat16, False)
    full = resolve_precision("auto", "float32", CUDA)
    assert (full.compute_dtype, full.mixed) == (torch.float32, False)
    assert resolve_precision("auto", "bfloat16", CPU).mixed  # mixed on a CPU when asked for


@pytest.mark.parametrize(
    ("dtype", "compute", "words"),
    [
        ("bfloat16", "float32", "compute can only be the parameter dtype"),
        ("float16", "bfloat16", "compute can only be the parameter dtype"),
        ("auto", "float16", "needs loss scaling"),
        ("float32", "float16", "needs loss scaling"),
    ],
)
def test_contradictory_dtypes_are_refused_by_name(dtype: str, compute: str, words: str) -> None:
    message = precision_conflict(dtype, compute)
    assert message is not None and words in message
    assert f"model.compute_dtype={compute}" in message and f"model.dtype={dtype}" in message
    with pytest.raises(ConfigError, match=words):
        resolve_precision(dtype, compute, CPU)
    from posttrain.preflight.common import run_checks

    findings = run_checks(build_config(None, [f"model.dtype={dtype}", f"model.compute_dtype={compute}"]), ())
    assert message in findings.errors


def test_compatible_dtypes_pass() -> None:
    for dtype, compute in [("auto", "auto"), ("float32", "bfloat16"), ("bfloat16", "auto"), ("float16", "float16")]:
        assert precision_conflict(dtype, compute) is None


def test_fsdp_policy_reduces_in_fp32_under_mixed() -> None:
    mixed = mixed_precision_policy(torch.float32, torch.bfloat16)
    assert (mixed.param_dtype, mixed.reduce_dtype) == (torch.bfloat16, torch.float32)
    same = mixed_precision_policy(torch.float32, torch.float32)
    assert (same.param_dtype, same.reduce_dtype) == (None, None)  # FSDP2's default: nothing cast


# -- the rollout engines' dtype ------------------------------------------------------------------


def test_vllm_engine_dtype_is_the_compute_dtype() -> None:
    assert vllm_dtype(build_config(None, ["model.device=cpu"])) == "float32"  # CPU default as before
    assert vllm_dtype(build_config(None, ["model.device=cpu", "model.compute_dtype=bfloat16"])) == "bfloat16"
    assert resolve_precision("float32", "auto", CUDA).compute_name == "bfloat16"  # what a GPU run passes
    # FLASH_ATTN takes bf16 only; a float32 engine leaves the backend to vLLM
    assert _engine_args(False, None, "auto", True, False, dtype="bfloat16")["attention_backend"] == "FLASH_ATTN"
    assert "attention_backend" not in _engine_args(False, None, "auto", True, False, dtype="float32")
    assert "attention_backend" not in _engine_args(False, None, "auto", False, False, dtype="bfloat16")  # CPU


@pytest.mark.parametrize(("dtype", "backend"), [("bfloat16", "FLASH_ATTN"), ("float32", None)])
def test_a_vllm_teacher_on_cuda_takes_the_rollout_engines_attention_backend(
    monkeypatch: pytest.MonkeyPatch, dtype: str, backend: str | None
) -> None:
    """A float32 vLLM teacher on CUDA once asked for FLASH_ATTN by name, which refuses float32
    (``dtype not supported``, seen on two H200s with a TP-2 teacher, 2026-12-04)."""
    import posttrain.rollout.vllm_runtime as runtime
    from posttrain.teacher.vllm_teacher import VLLMTeacher

    seen: dict[str, Any] = {}

    class FakeLLM:
        llm_engine = type("E", (), {"model_config": type("M", (), {"get_vocab_size": lambda self: 7})()})()

        def get_tokenizer(self) -> None:
            return None

    def fake_build(vllm: Any, **engine_args: Any) -> tuple[FakeLLM, int]:
        seen.update(engine_args)
        return FakeLLM(), 1

    monkeypatch.setattr(runtime, "import_vllm", lambda: None)
    monkeypatch.setattr(runtime, "build_llm", fake_build)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    VLLMTeacher("unused", dtype=dtype)
    assert seen["dtype"] == dtype and seen.get("attention_backend") == backend


def test_weights_are_cast_to_the_engine_dtype_on_sync() -> None:
    master = torch.randn(4, 3)
    sent = as_engine_dtype(master, torch.bfloat16)
    assert sent.dtype == torch.bfloat16 and torch.equal(sent, master.to(torch.bfloat16))
    ids = torch.arange(3)
    assert as_engine_dtype(ids, torch.bfloat16) is ids  # integer buffers are not weights
    assert as_engine_dtype(master, None) is master  # dtype=auto: vLLM's loaders cast on copy
    assert as_engine_dtype(sent, torch.bfloat16) is sent


def test_hf_engine_samples_with_the_training_weights(tiny_model_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    params = SamplingParams(max_tokens=3, seed=0)
    for extra, want in ([], (torch.float32, False)), (["model.compute_dtype=bfloat16"], (torch.bfloat16, False)):
        cfg = build_config(None, ["model.device=cpu", *extra])
        engine = build_hf_engine(cfg, model, tok)
        assert engine.precision == policy_precision(cfg, model)
        with _watch_linear(model) as seen:
            engine.generate([[5, 6, 7]], 2, params)
        assert seen and set(seen) == {want}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # sampling never casts the weights


# -- training --------------------------------------------------------------------------------------


def test_cpu_default_computes_in_fp32_without_autocast(tiny_model_dir: str) -> None:
    trainer, _, seen = _train(tiny_model_dir, [], steps=1)
    assert not trainer.precision.mixed
    assert seen and set(seen) == {(torch.float32, False)}  # pi_old, reference and update passes alike
    before = [id(p) for p in trainer.model.parameters()]
    with compute_weights(trainer.model, trainer.precision):
        assert [id(p) for p in trainer.model.parameters()] == before  # nothing entered when not mixed


def test_mixed_precision_tracks_fp32_over_ten_steps(tiny_model_dir: str) -> None:
    fp32, fp32_losses, _ = _train(tiny_model_dir, [])
    assert not fp32.precision.mixed
    mixed, mixed_losses, seen = _train(tiny_model_dir, ["model.compute_dtype=bfloat16"])
    assert mixed.precision.mixed and set(seen) == {(torch.bfloat16, False)}  # bf16 weights, no autocast
    gaps = [abs(a - b) for a, b in zip(fp32_losses, mixed_losses)]
    assert max(gaps) <= LOSS_ATOL, (fp32_losses, mixed_losses)
    assert fp32_losses != mixed_losses  # bf16 compute really ran: the curves are close, not equal
    # fp32 master weights and optimizer state; the reference copy is fp32 too (read as bf16 copies)
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    assert mixed.ref_model is not None and all(p.dtype == torch.float32 for p in mixed.ref_model.parameters())
    states = [s for s in mixed.optimizer.state.values() if s]
    assert states and all(t.dtype == torch.float32 for s in states for t in s.values() if t.is_floating_point())
    assert any(t.numel() > 1 for s in states for t in s.values())  # the moments, not only the step counter


def test_gradient_checkpointing_under_mixed_precision(tiny_model_dir: str) -> None:
    _, plain, _ = _train(tiny_model_dir, ["model.compute_dtype=bfloat16"], steps=3)
    _, ckpt, seen = _train(tiny_model_dir, ["model.compute_dtype=bfloat16", "model.gradient_checkpointing=true"], 3)
    # the recomputation in backward reads the same bf16 copies as the forward it replays
    assert set(seen) == {(torch.bfloat16, False)}
    torch.testing.assert_close(torch.tensor(ckpt), torch.tensor(plain), atol=1e-6, rtol=0)


# -- the cast-once weights -----------------------------------------------------------------------


def test_compute_weights_is_a_pure_bf16_forward_with_fp32_gradients(tiny_model_dir: str) -> None:
    """Inside ``compute_weights`` the fp32 model computes exactly what its bf16 copy computes (the
    whole forward in bf16, not only the matrix products as under autocast), and the gradient lands
    on the fp32 parameters as the bf16 copy's gradient widened to fp32."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for param in bf16.parameters():  # parameters only: buffers (rotary frequencies) stay fp32 alike
        param.data = param.data.to(torch.bfloat16)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    mixed = resolve_precision("float32", "bfloat16", CPU)
    params = dict(model.named_parameters())
    with compute_weights(model, mixed):
        inner = dict(model.named_parameters())
        assert all(t.dtype == torch.bfloat16 and not isinstance(t, nn.Parameter) for t in inner.values())
        logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
    want = bf16(input_ids=ids).logits
    want.float().logsumexp(-1).sum().backward()
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, want)
    assert dict(model.named_parameters()) == params  # the fp32 Parameters are back, the same objects
    grads = {n: p.grad for n, p in bf16.named_parameters()}
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32 and param.grad is not None and param.grad.dtype == torch.float32
        torch.testing.assert_close(param.grad, grads[name].float(), atol=0, rtol=0, msg=name)
    # autocast, the path this replaced, is a different computation: fp32 residual stream and norms
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not torch.equal(model(input_ids=ids).logits.to(torch.bfloat16), want)


def test_compute_weights_casts_a_tied_weight_once_and_nests() -> None:
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    mixed = resolve_precision("float32", "bfloat16", CPU)
    with compute_weights(tied, mixed):
        assert tied[0].weight is tied[1].weight and tied[0].weight.dtype == torch.bfloat16
        copy = tied[0].weight
        with compute_weights(tied, mixed):  # an inner entry finds them cast and changes nothing
            assert tied[1].weight is copy
        assert tied[1].weight is copy
        tied(torch.tensor([1, 2])).float().sum().backward()
    assert isinstance(tied[0].weight, nn.Parameter) and tied[0].weight is tied[1].weight
    assert tied[0].weight.grad is not None and tied[0].weight.grad.dtype == torch.float32
    weight = tied[0].weight
    with pytest.raises(RuntimeError, match="forward failed"), compute_weights(tied, mixed):
        raise RuntimeError("forward failed")
    assert tied[0].weight is weight and tied[1].weight is weight  # restored on the way out of an error


def test_cudagraph_capture_size_reaches_a_cuda_engine_only() -> None:
    """rollout.cudagraph_capture_max becomes vLLM's compilation_config on CUDA; the CPU backend has no graphs."""
    from posttrain.config.schema import RolloutConfig
    from posttrain.rollout.vllm_runtime import cudagraph_args

    assert cudagraph_args(1024, cuda=True) == {"compilation_config": {"max_cudagraph_capture_size": 1024}}
    assert cudagraph_args(None, cuda=True) == {}
    assert cudagraph_args(1024, cuda=False) == {}
    with pytest.raises(ValueError, match="cudagraph_capture_max"):
        RolloutConfig(cudagraph_capture_max=0)


def _cast_per_pass(trainer: PolicyTrainer, monkeypatch: pytest.MonkeyPatch) -> None:
    """``train_on`` as it cast before the twenty-third session: a fresh entry as each pass begins
    (``_loss_inputs``), open over that pass's forward and backward, closed as the next begins or the
    mini-batch ends. (Skipping the update's entry alone would run a checkpointed chunk's recompute
    outside any entry, on the fp32 weights.)"""
    import sys
    from contextlib import ExitStack

    compute, loss_inputs = trainer._compute, trainer._loss_inputs
    open_entry = ExitStack()
    entered: list[nn.Module] = []

    @contextmanager
    def per_pass(model: nn.Module) -> Iterator[None]:
        entered[:] = [model]
        with open_entry:  # closes the last pass's entry
            yield

    def entry(model: nn.Module) -> Any:
        return per_pass(model) if sys._getframe(1).f_code.co_name == "train_on" else compute(model)

    def fresh_cast(*args: Any, **kwargs: Any) -> Any:
        open_entry.close()  # the previous pass's backward has run
        open_entry.enter_context(compute(entered[0]))
        return loss_inputs(*args, **kwargs)

    monkeypatch.setattr(trainer, "_compute", entry)
    monkeypatch.setattr(trainer, "_loss_inputs", fresh_cast)


def test_a_mini_batch_casts_its_weights_once_over_all_its_micro_batches(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The update casts the fp32 weights to bf16 once per mini-batch, not once per micro-batch (as it did
    before the twenty-third session): the micro-batches' backwards all return through the same copies
    to the fp32 gradients. Over four micro-batches that steps with exactly the gradient a fresh cast per
    micro-batch gives, which it could not if a backward after the first lost its way to the parameters."""

    import posttrain.policy.trainer as trainer_module

    casts: list[int] = []

    def counting(model: nn.Module, precision: Any) -> Any:  # an entry that finds fp32 weights casts them
        casts.append(int(any(p.dtype == torch.float32 for p in model.parameters())))
        return compute_weights(model, precision)

    monkeypatch.setattr(trainer_module, "compute_weights", counting)
    grads = {}
    for per_micro_batch in (True, False):
        torch.manual_seed(0)
        cfg = build_config(None, ["rl.batch_per_replica=16", "rl.group_size=4", "rl.micro_batch_per_replica=4"])
        # chunks of 16 tokens: the head's chunks are checkpointed, so each backward recomputes through the copies
        update = {"compute_dtype": "bfloat16", "logprob_chunk_tokens": 16}
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update=update)})
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        trainer = PolicyTrainer(model, cfg, objective=grpo_objective(cfg), pad_id=2)
        assert trainer.precision.mixed
        if per_micro_batch:  # as before: each pass casts afresh, its entry open over its backward
            _cast_per_pass(trainer, monkeypatch)
        step_grads: list[torch.Tensor] = []
        trainer.optimizer.register_step_pre_hook(
            lambda *_: step_grads.extend(p.grad.clone() for p in model.parameters())  # noqa: B023
        )
        casts.clear()
        trainer.train_on(_batch(1), step=1)
        assert sum(casts) == (4 if per_micro_batch else 1), (per_micro_batch, casts)
        grads[per_micro_batch] = step_grads
    assert len(casts) > 1  # the passes' logprob entries ran, nested in the one cast, and cast nothing more
    for once, each in zip(grads[False], grads[True], strict=True):
        assert torch.equal(once, each)

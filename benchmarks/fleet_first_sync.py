"""Where the first weight sync of engines apart goes.

    python benchmarks/fleet_first_sync.py --model /tmp/m05 --first together|alone|run [--engines 2]
        [--fragment-gib G] [--out r.json]

On one H100 (thirtieth session, docs/benchmarks.md) the first weight sync of W's two engines
(``rollout.engines_per_device=2``) took 3.44-3.76 s, where one engine apart's took 0.11-0.33 s in earlier
leases and the two engines' later syncs 0.015-0.021 s; on vLLM's CPU build two engines' first sync took
0.33 s against one's 0.16 s. Each engine's first sync maps its CUDA IPC buffer and writes the model through
vLLM's weight loaders (the copy plan is learnt from it); later ones are one foreach copy. The thirty-first
session found the cause with this script (the workers' loader writes at once time-slice the GPU), and the
fleet since writes a first sync one engine after the other.

This starts ``--engines`` engines as the fleet does (each engine core in a process of its own, on
``--gpu-memory-utilization / N`` of the device), then sends the policy's weights three times, moved a
little each time: the first sync ``together`` (every engine at once, from the fleet's threads: the
fleet's way before the thirty-first session), ``alone`` (one engine after another, each timed by itself) or
``run`` (the run's own ``receive_weights``, whichever way the fleet chooses), then two syncs the run's way.
Fast alone but slow together points at the engines contending on the device; slow alone, at the path (the
loaders, the IPC mapping). ``--engines 1`` is one engine apart. Prints one RESULT line and writes ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory (W: make_random_model.py 0.5b)")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--first", choices=("together", "alone", "run"), default="together")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--enforce-eager", action="store_true", help="skip vLLM's CUDA graphs (faster start)")
    parser.add_argument(
        "--fragment-gib", type=float, default=0.0,
        help="allocate and free this many GiB on the device before the first sync, as an update leaves the caching "
        "allocator (the shared buffer then lands inside a large cached segment, which the worker maps whole)",
    )  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from posttrain.distributed.fsdp import PolicyWeights
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine, as_engine_dtype
    from posttrain.rollout.vllm_fleet import VLLMEngineFleet

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = "bfloat16" if cuda else "float32"
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()

    def member(share: float) -> VLLMRolloutEngine:
        return VLLMRolloutEngine(
            args.model, dtype=dtype, enforce_eager=args.enforce_eager, gpu_memory_utilization=share,
            max_model_len=1024, seed=0, separate_process=True,
        )  # fmt: skip

    start = time.perf_counter()
    engines = (
        member(args.gpu_memory_utilization)
        if args.engines == 1
        else VLLMEngineFleet(member, args.engines, args.gpu_memory_utilization)
    )
    members = engines.members if isinstance(engines, VLLMEngineFleet) else [engines]
    start_s = time.perf_counter() - start

    def sync(version: int, how: str) -> dict[str, object]:
        with torch.no_grad():  # moved a little, so every sync writes new values
            for p in policy.parameters():
                p.mul_(1.0 + 1e-3)
        begin = time.perf_counter()
        if how == "run" or not isinstance(engines, VLLMEngineFleet):  # one engine: the three ways are one
            engines.receive_weights(PolicyWeights(policy), version)
        else:  # the fleet's gather and cast, then its members at once (its own threads) or one after another
            state = PolicyWeights(policy).full_state_dict()
            weights = {name: as_engine_dtype(tensor, members[0].weight_dtype) for name, tensor in state.items()}
            if how == "together":
                engines._each(lambda _i, m: m.load_weights(weights, version))
            else:
                for m in members:
                    m.load_weights(weights, version)
        return {
            "version": version,
            "how": how,
            "wall_s": round(time.perf_counter() - begin, 4),
            "each_s": [round(m.last_sync_s, 4) for m in members],
            "phases": [{k: round(v, 4) for k, v in m.last_sync_phases.items()} for m in members],
        }

    if args.fragment_gib and cuda:
        del_me = torch.empty(int(args.fragment_gib * 2**30), dtype=torch.uint8, device=device)
        del del_me  # stays in torch's cache, as an update's activations do

    syncs = [sync(1, args.first), sync(2, "run"), sync(3, "run")]
    engines.close()
    result = {
        "engines": args.engines,
        "first": args.first,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "params": sum(p.numel() for p in policy.parameters()),
        "start_s": round(start_s, 2),
        "fragment_gib": args.fragment_gib,
        "syncs": syncs,
    }
    print("RESULT " + json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""Contact and constraint peaks of the MuJoCo Warp tasks, the numbers behind their buffer sizes.

Each task runs ``--worlds`` worlds for ``--steps`` control steps twice: once with actions uniform
in [-1, 1] through ``env.step``, which clips them to its +-0.1 rad deltas (so ~90% sit at a
limit: the most violent an untrained policy can be, not a typical one), once with uniform random
servo targets over the joints' whole range (``env.simulate``, harsher than any policy). Buffers are
made large (``--njmax``, ``--nconmax``) so that nothing overflows, and the peaks that MuJoCo Warp's
kernels counted are printed: contacts per world (the largest substep's total over all worlds,
divided by the worlds) and constraints in the fullest world.

    python benchmarks/contact_peaks.py --device cpu --worlds 256 --steps 100
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def peaks(task: str, worlds: int, steps: int, device: str, njmax: int, nconmax: int, mode: str):
    from embodied.simulators.mujoco import MuJoCoConfig, make_env
    from embodied.simulators.mujoco.worlds import HIGH, LOW

    cfg = MuJoCoConfig(
        task=task, num_envs=worlds, backend="warp", device=device, njmax=njmax, nconmax=nconmax
    )
    with make_env(cfg) as env:
        env.reset(seed=0)
        low = torch.tensor(LOW, device=env.device)
        high = torch.tensor(HIGH, device=env.device)
        dims = len(env.spec.action.names)
        for _ in range(steps):
            if mode == "actions":
                env.step(torch.rand(worlds, dims, device=env.device) * 2 - 1)
            else:
                env.simulate(low + torch.rand(worlds, len(low), device=env.device) * (high - low))
        contacts, constraints = env.buffer_peaks
    return {
        "task": task,
        "mode": mode,
        "worlds": worlds,
        "steps": steps,
        "device": device,
        "contacts_per_world": contacts / worlds,
        "contacts_all_worlds": contacts,
        "constraints_one_world": constraints,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default="reach,push,pick")
    p.add_argument("--device", default="cpu")
    p.add_argument("--worlds", type=int, default=256)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--njmax", type=int, default=512, help="constraints per world while measuring")
    p.add_argument("--nconmax", type=int, default=128, help="contacts per world while measuring")
    p.add_argument("--json", help="append each row here (JSON lines)")
    args = p.parse_args()
    print("| task | actions | worlds x steps | contacts per world | constraints, fullest world |")
    print("|---|---|---|---:|---:|")
    for task in args.tasks.split(","):
        for mode in ("actions", "targets"):
            row = peaks(task, args.worlds, args.steps, args.device, args.njmax, args.nconmax, mode)
            cells = [task, mode, f"{args.worlds} x {args.steps}"]
            cells += [f"{row['contacts_per_world']:.2f}", str(row["constraints_one_world"])]
            print("| " + " | ".join(cells) + " |", flush=True)
            if args.json:  # each row as it is measured: a run cut short keeps them
                with Path(args.json).open("a") as lines:
                    lines.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

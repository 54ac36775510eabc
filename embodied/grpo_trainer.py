"""The GRPO trainer: rounds of grouped episodes -> outcome advantages -> clipped policy-gradient
epochs -> log -> evaluate per task -> checkpoint.

Each round resets the B environments in G = B / M groups of M: every member of a group gets the
group's seed (same initial state), and each environment runs one episode (chunks of K actions).
An episode's outcome is whether it succeeded at some step. Groups whose members all succeeded or
all failed are dropped (dynamic sampling) and more rounds are collected until
``groups_per_batch`` informative groups are in hand or ``max_rounds`` is reached. Every chunk of a
kept episode up to its end shares the episode's group-normalized advantage.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from embodied.algorithms import grpo_advantages, informative_groups, kl_penalty, ppo_policy_loss
from embodied.checkpoint import save_checkpoint, set_rng_state
from embodied.evaluate import evaluate_by_task, per_task
from embodied.logger import RunLogger
from embodied.rollout import EpisodeStats, collect
from embodied.schema import Observation, PolicyOutput


def _old_logprob(out, level: str) -> torch.Tensor:
    if level == "chunk":
        return out.logprob
    token = out.extras["logp_token"]  # f32 [N, K, A]
    return token.sum(-1) if level == "action" else token


def _round(env, policy, seeds: list[int], T: int):
    """One round: reset with ``seeds`` (one per env), collect T chunks. -> (rollout, success bool [B],
    valid bool [T, B]: chunks up to and including the one where the env's first episode ended)."""
    obs = env.reset(seed=seeds)
    stats = EpisodeStats.zeros(env.num_envs, env.device)
    rollout, _ = collect(env, policy, obs, num_steps=T, gamma=1.0, stats=stats)
    success = torch.zeros(env.num_envs, dtype=torch.bool)
    seen = torch.zeros(env.num_envs, dtype=torch.bool)
    for e in stats.finished:  # in the order they ended: the first one per env is its episode
        if not seen[e["env"]]:
            seen[e["env"]], success[e["env"]] = True, e["success"]
    done = (rollout.terminated | rollout.truncated).long().cpu()  # [T, B]
    ended_before = torch.cat([torch.zeros(1, done.shape[1], dtype=torch.long), done.cumsum(0)[:-1]])
    valid = ended_before == 0
    if not bool(seen.all()):
        raise RuntimeError(
            f"{int((~seen).sum())} environments did not finish an episode in {T} chunks; "
            "GRPO needs episodes that end (set env.max_episode_steps)"
        )
    return rollout, success, valid


def _evaluate(env, policy, episodes: int, run, seed: int) -> dict[str, dict]:
    names = getattr(env, "names", ["all"])
    with tqdm(
        total=episodes * len(names),
        desc="evaluating",
        unit="ep",
        leave=False,
        disable=not run.progress,
        mininterval=0.1 if sys.stderr.isatty() else 30.0,
    ) as progress:
        return evaluate_by_task(env, policy, episodes=episodes, seed=seed, progress=progress)


def _collect(env, policy, cfg, iteration: int, counters: dict, G: int, T: int):
    """Rounds of grouped episodes until enough informative groups (or max_rounds).
    -> (batches [(rollout, valid, kept groups)], outcomes per kept episode, kept groups, rounds, success of all)."""
    alg = cfg.algorithm
    B, M = env.num_envs, alg.group_size
    batches, outcomes, kept_groups, rounds, all_success = [], [], 0, 0, []
    while kept_groups < alg.groups_per_batch and rounds < alg.max_rounds:
        base = (
            cfg.seed + ((iteration - 1) * alg.max_rounds + rounds) * G
        )  # fresh initial states every round
        seeds = [base + g for g in range(G) for _ in range(M)]
        with torch.no_grad():
            rollout, success, valid = _round(env, policy, seeds, T)
        rounds += 1
        counters["env_steps"] += B * T * cfg.policy.chunk_size
        counters["episodes"] += B
        all_success.append(success)
        keep = (
            informative_groups(rewards=success.float(), group_size=M)
            if alg.dynamic_sampling
            else torch.ones(G, dtype=torch.bool)
        )
        if bool(keep.any()):
            batches.append((rollout, valid, keep))
            outcomes.append(success.float().view(G, M)[keep].reshape(-1))
            kept_groups += int(keep.sum())
    return batches, outcomes, kept_groups, rounds, torch.cat(all_success)


def _log_eval(logger, results: dict, step: int, bar, label: str) -> None:
    for task, r in results.items():
        logger.log(per_task(task, r), step=step)
        bar.write(
            f"{label} {task}: success {r['eval/success_rate']:.2f} over {r['eval/episodes']} episodes"
        )


def train_grpo(cfg, env, run_dir: Path, resume: dict | None) -> dict:
    from embodied.trainer import init_policy, run_meta, time_left

    alg, run = cfg.algorithm, cfg.runner
    B, M = env.num_envs, alg.group_size
    if B % M:
        raise ValueError(f"algorithm.group_size={M} must divide env.num_envs={B}")
    G = B // M
    device = env.device if run.device == "auto" else torch.device(run.device)
    policy = init_policy(cfg, env, device)
    if alg.exploration_log_std is not None:
        if not hasattr(getattr(policy, "head", None), "log_std"):
            raise ValueError(
                "algorithm.exploration_log_std: the policy has no Gaussian head with a log_std"
            )
        with torch.no_grad():
            policy.head.log_std.fill_(alg.exploration_log_std)
    K = cfg.policy.chunk_size
    T = math.ceil(env.spec.max_episode_steps / K)  # chunks per episode
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=alg.learning_rate, eps=1e-5)
    reference = copy.deepcopy(policy).eval().requires_grad_(False) if alg.kl_coef > 0 else None
    counters = {"iteration": 0, "env_steps": 0, "episodes": 0, "train_seconds": 0.0, "evals": []}
    if resume is not None:
        policy.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        set_rng_state(resume["rng"])
        counters = resume["counters"]
    logger = RunLogger(run_dir)
    meta = run_meta(cfg, env.spec)
    num_iterations = max(1, math.ceil(run.total_env_steps / (B * T * K)))
    bar = tqdm(
        total=num_iterations,
        initial=counters["iteration"],
        unit="it",
        desc=run.name,
        disable=not run.progress,
        dynamic_ncols=True,
        mininterval=0.1 if sys.stderr.isatty() else 30.0,
    )
    if counters["iteration"] == 0:  # success before RL, on the evaluation seeds
        before = _evaluate(env, policy, run.eval_episodes, run, cfg.seed)
        counters["evals"].append({"iteration": 0, "env_steps": 0, "minutes": 0.0, "tasks": before})
        _log_eval(logger, before, 0, bar, "before RL")
    start = time.time() - counters["train_seconds"]
    saved = counters["iteration"]
    try:
        for iteration in range(counters["iteration"] + 1, num_iterations + 1):
            t0 = time.time()
            batches, outcomes, kept_groups, rounds, all_success = _collect(
                env, policy, cfg, iteration, counters, G, T
            )
            rollout_time = time.time() - t0
            metrics = {
                "grpo/rounds": rounds,
                "grpo/kept_groups": kept_groups,
                "episode/success_once": all_success.float().mean().item(),
            }
            if batches:
                metrics.update(_update(policy, reference, optimizer, batches, outcomes, alg, M, G))
            counters["iteration"] = iteration
            counters["train_seconds"] = time.time() - start
            metrics.update(
                {
                    "time/rollout_s": rollout_time,
                    "time/update_s": time.time() - t0 - rollout_time,
                    "time/minutes": counters["train_seconds"] / 60,
                }
            )
            logger.log(metrics, step=counters["env_steps"], iteration=iteration)
            bar.update(1)
            bar.set_postfix(
                succ=f"{metrics['episode/success_once']:.2f}",
                kept=kept_groups,
                rounds=rounds,
                **time_left(run, counters),
            )
            out_of_time = (
                run.max_minutes is not None and counters["train_seconds"] >= run.max_minutes * 60
            )
            last = iteration == num_iterations or out_of_time
            if run.eval_every and iteration % run.eval_every == 0 and not last:
                results = _evaluate(env, policy, run.eval_episodes, run, cfg.seed)
                counters["evals"].append(
                    {
                        "iteration": iteration,
                        "env_steps": counters["env_steps"],
                        "minutes": counters["train_seconds"] / 60,
                        "tasks": results,
                    }
                )
                _log_eval(logger, results, counters["env_steps"], bar, f"iter {iteration}")
            if last or (run.save_every and iteration % run.save_every == 0):
                save_checkpoint(
                    run_dir,
                    iteration,
                    model=policy,
                    optimizer=optimizer,
                    counters=counters,
                    meta=meta,
                )
                saved = iteration
            if out_of_time:
                bar.write(
                    f"stopping after {counters['train_seconds'] / 60:.1f} min (runner.max_minutes={run.max_minutes})"
                )
                break
    except KeyboardInterrupt:  # keep what was learned since the last checkpoint
        if counters["iteration"] > saved:
            save_checkpoint(
                run_dir,
                counters["iteration"],
                model=policy,
                optimizer=optimizer,
                counters=counters,
                meta=meta,
            )
        bar.close()
        logger.close()
        raise
    bar.close()
    final = _evaluate(env, policy, run.final_eval_episodes, run, cfg.seed)
    _log_eval(logger, final, counters["env_steps"], bar, "after RL")
    summary = {
        "run_dir": str(run_dir),
        "before": counters["evals"][0]["tasks"] if counters["evals"] else None,
        "final": final,
        "evals": counters["evals"],
        "env_steps": counters["env_steps"],
        "episodes": counters["episodes"],
        "minutes": counters["train_seconds"] / 60,
    }
    (run_dir / "metrics.json").write_text(json.dumps(summary, indent=2))
    logger.close()
    return summary


def _update(
    policy, reference, optimizer, batches, outcomes, alg, M: int, G: int
) -> dict[str, float]:
    """Clipped policy-gradient epochs over every valid chunk of the kept episodes."""
    adv, adv_metrics = grpo_advantages(
        rewards=torch.cat(outcomes), group_size=M, scale_by_std=alg.scale_by_std
    )
    obs_parts, out_parts, adv_parts, offset = [], [], [], 0
    for rollout, valid, keep in batches:
        B = valid.shape[1]
        kept_envs = torch.arange(B).view(G, M)[keep].reshape(-1)  # env columns of the kept groups
        env_adv = adv[offset : offset + len(kept_envs)]
        offset += len(kept_envs)
        mask = torch.zeros_like(valid)
        mask[:, kept_envs] = valid[:, kept_envs]
        flat = mask.reshape(-1).nonzero().squeeze(1)  # indices t*B + b of the chunks that count
        obs, out = rollout.flat(flat)
        col_adv = torch.zeros(B)
        col_adv[kept_envs] = env_adv
        obs_parts.append(obs), out_parts.append(out), adv_parts.append(col_adv[flat % B])
    obs_all, out_all, adv_all = (
        Observation.cat(obs_parts),
        _cat_outputs(out_parts),
        torch.cat(adv_parts),
    )
    n = len(adv_all)
    mb = max(1, n // alg.num_minibatches)
    sums: dict[str, float] = {}
    count = 0
    policy.train()
    for _ in range(alg.update_epochs):
        perm = torch.randperm(n)
        for lo in range(0, n - mb + 1, mb):
            idx = perm[lo : lo + mb]
            obs, out = obs_all.index(idx), _select(out_all, idx)
            logprob, entropy, _ = policy.evaluate(obs, out, level=alg.logprob_level)
            old = _old_logprob(out, alg.logprob_level)
            a = adv_all[idx].view(-1, *([1] * (logprob.dim() - 1))).expand_as(logprob)
            loss, m = ppo_policy_loss(
                logprob=logprob,
                old_logprob=old,
                advantages=a,
                clip_low=alg.clip_coef,
                clip_high=alg.clip_coef_high,
            )
            if reference is not None:
                with torch.no_grad():
                    ref, _, _ = reference.evaluate(obs, out, level=alg.logprob_level)
                kl, m_kl = kl_penalty(logprob=logprob, ref_logprob=ref)
                loss = loss + alg.kl_coef * kl
                m.update(m_kl)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), alg.max_grad_norm)
            optimizer.step()
            m.update(
                {"policy/entropy": entropy.mean().item(), "policy/grad_norm": grad_norm.item()}
            )
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
            count += 1
    policy.eval()
    out = {k: v / max(1, count) for k, v in sums.items()}
    out.update(adv_metrics)
    out["grpo/samples"] = n
    return out


def _select(out: PolicyOutput, idx: torch.Tensor) -> PolicyOutput:
    return PolicyOutput(
        actions=out.actions[idx],
        logprob=out.logprob[idx],
        value=None if out.value is None else out.value[idx],
        extras={k: v[idx] for k, v in out.extras.items()},
    )


def _cat_outputs(outs: list[PolicyOutput]) -> PolicyOutput:
    return PolicyOutput(
        actions=torch.cat([o.actions for o in outs]),
        logprob=torch.cat([o.logprob for o in outs]),
        value=None if outs[0].value is None else torch.cat([o.value for o in outs]),
        extras={k: torch.cat([o.extras[k] for o in outs]) for k in outs[0].extras},
    )

"""An RL-style rollout over sandboxes: act, hibernate while "waiting for inference", wake, and
grade in a fork.

Each agent gets a toy task in its sandbox (``/home/user/task.txt``: numbers to add; the answer
goes to ``/home/user/answer``). A scripted policy stands in for the LLM: it emits one shell
command per step, run as the sandbox's unprivileged user;
agent ``i`` with ``i % 3 == 2`` makes an arithmetic slip, so rewards differ. Between steps every
agent is hibernated (no process, no memory) for the "inference" wait, as K3's sandboxes are for
~98% of their life, then woken to run the next command. The reward check runs in a fork of the
finished agent, as root, from a root-owned script the agent's commands cannot change: the grader
is destructive (it deletes the answer and leaves a marker), and the original sandbox is verified
untouched afterwards.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from k3lab.agentenv.sandbox import Sandbox, SandboxPool

GRADER = """#!/bin/sh
want=$(awk '{s+=$1} END {print s}' /home/user/task.txt)
got=$(cat /home/user/answer 2>/dev/null)
rm -f /home/user/answer; echo graded > /home/user/graded; sync
[ "$got" = "$want" ] && echo 1 || echo 0
"""


def policy(agent: int, step: int) -> str:
    """The scripted stand-in for an LLM: the shell command agent ``agent`` runs at ``step``."""
    if step == 0:
        return "cat /home/user/task.txt | wc -l"
    if step == 1:
        slip = " + 1" if agent % 3 == 2 else ""
        return f"awk '{{s+=$1}} END {{print s{slip}}}' /home/user/task.txt > /home/user/answer; cat /home/user/answer"
    return "ls /home/user"


@dataclass
class RolloutResult:
    """What :func:`run_rollout` returns.

    Attributes:
        rewards (list[int]): 1 if agent i's answer was right, else 0.
        outputs (list[list[str]]): each agent's stdout per step.
        events (list[tuple]): (agent, kind, t_start_s, t_end_s) with kind in "exec", "hibernated",
            "wake", "hibernate", "fork+grade"; seconds since the agents were ready.
        untouched (list[bool]): after grading, the original still has its answer and no marker.
        waiting_fraction (float): share of the agents' time (n_agents x wall) spent hibernated.
        max_live_processes_while_waiting (int): VM processes alive during the inference waits.
    """

    rewards: list[int]
    outputs: list[list[str]]
    events: list[tuple]
    untouched: list[bool]
    waiting_fraction: float
    max_live_processes_while_waiting: int = 0
    timings: dict = field(default_factory=dict)


def run_rollout(pool: SandboxPool, n_agents: int = 3, steps: int = 3, inference_s: float = 1.0,
                seed: int = 0) -> RolloutResult:
    """Run the rollout.

    Args:
        pool (SandboxPool): agents are created from its base snapshot (own RAM, so hibernation is cheap).
        n_agents (int): >= 1. steps (int): policy steps per agent, >= 2 (the answer is step 1).
        inference_s (float): the simulated inference wait per step, >= 0 seconds.
        seed (int): picks the task numbers.

    Raises:
        ValueError: arguments out of range.
    """
    if n_agents < 1 or steps < 2 or inference_s < 0:
        raise ValueError(f"need n_agents >= 1, steps >= 2, inference_s >= 0; got {n_agents}, {steps}, {inference_s}")
    events: list[tuple] = []
    agents: list[Sandbox] = []
    try:
        for i in range(n_agents):
            sb = pool.create(cow=False)
            nums = [(seed * 7919 + i * 104729 + k * 1299709) % 97 + 1 for k in range(5 + i)]
            sb.write_file("/home/user/task.txt", "".join(f"{x}\n" for x in nums))
            sb.write_file("/root/grade.sh", GRADER, mode=0o700, root=True)
            agents.append(sb)
        t0 = time.perf_counter()
        now = lambda: time.perf_counter() - t0  # noqa: E731
        outputs: list[list[str]] = [[] for _ in agents]
        asleep_since = [0.0] * n_agents
        max_live = 0

        def wake(i: int) -> None:
            a = now()
            events.append((i, "hibernated", asleep_since[i], a))
            agents[i].wake()
            events.append((i, "wake", a, now()))

        for step in range(steps):
            for i, sb in enumerate(agents):
                if sb.state == "hibernated":
                    wake(i)
                a = now()
                r = sb.exec(policy(i, step), timeout=30)
                events.append((i, "exec", a, now()))
                outputs[i].append(r.text.strip())
                a = now()
                sb.hibernate()
                asleep_since[i] = now()
                events.append((i, "hibernate", a, asleep_since[i]))
            # every agent now waits for the policy's next action, holding no process or memory
            max_live = max(max_live, sum(len(sb.pids()) for sb in agents))
            time.sleep(inference_s)
        rewards, untouched = [], []
        for i, sb in enumerate(agents):
            wake(i)
            a = now()
            (grader,) = sb.fork(1)
            rewards.append(int(grader.exec("sh /root/grade.sh", timeout=30, root=True).text.strip()))
            grader.destroy()
            events.append((i, "fork+grade", a, now()))
            check = sb.exec("cat /home/user/answer && test ! -e /home/user/graded && echo clean", timeout=30)
            untouched.append(check.ok and check.text.strip().endswith("clean"))
        total = now()
        waited = sum(t1 - t0_ for _, kind, t0_, t1 in events if kind == "hibernated")
        return RolloutResult(rewards=rewards, outputs=outputs, events=events, untouched=untouched,
                             waiting_fraction=waited / (n_agents * total) if total else 0.0,
                             max_live_processes_while_waiting=max_live,
                             timings={"total_s": total, "agent_s_hibernated": waited})
    finally:
        for sb in agents:
            sb.destroy()

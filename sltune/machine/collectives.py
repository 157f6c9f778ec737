"""All-gather and reduce-scatter per world size, over the process group a trial uses (gloo on the CPU, NCCL on
GPUs): ranks in processes of their own on this machine, timed in step (each sample starts when rank 0 says so), the
slowest rank's time counted, as a collective finishes when its last rank does."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sltune.loopback import free_port
from sltune.machine.rates import Rate
from sltune.machine.timing import MAX_SAMPLES, MIN_SAMPLES
from sltune.runtime.sharding import all_gather, reduce_scatter

COLLECTIVE_BYTES = 16 << 20      # the gathered tensor: a layer's weights in bfloat16 at a few hundred million
TIMEOUT_S = 120.0


def collectives(world: int, device: str, budget_s: float, processes: Any) -> dict[str, Rate]:
    """{"all_gather.W": bytes/s, "reduce_scatter.W": bytes/s} (the whole gathered tensor per second) for `world`
    ranks started from `processes` (a multiprocessing context: the caller's, which sltune.machine does not pick)."""
    port = free_port()
    pipes = [processes.Pipe(duplex=False) for _ in range(world)]
    ranks = [processes.Process(target=_rank, args=(r, world, port, device, budget_s, pipes[r][1]), daemon=True)
             for r in range(world)]
    for p in ranks:
        p.start()
    try:
        answers = _answers([recv for recv, _ in pipes], ranks, TIMEOUT_S + budget_s)
    finally:
        for p in ranks:
            p.join(1)
            if p.is_alive():
                p.kill()
                p.join(5)
    failed = [a for a in answers if isinstance(a, str)]
    if failed:
        raise RuntimeError(f"the {world}-rank collectives failed: {failed[0]}")
    out = {}
    for name in answers[0]:
        slowest = [max(a[name][i] for a in answers) for i in range(len(answers[0][name]))]
        out[f"{name}.{world}"] = Rate.of([COLLECTIVE_BYTES / s for s in slowest], "bytes")
    return out


def _answers(pipes: list[Any], ranks: list[Any], timeout_s: float) -> list[Any]:
    """Every rank's answer, or at the first failure (a rank's error, a rank that died without answering, silence past
    `timeout_s`) that failure alone: the other ranks, waiting in a collective for the failed one, are not waited
    for."""
    answers: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(answers) < len(ranks):
        for r, (recv, proc) in enumerate(zip(pipes, ranks)):
            if r in answers:
                continue
            if recv.poll(0):
                answers[r] = recv.recv()
                if isinstance(answers[r], str):
                    return [answers[r]]
            elif not proc.is_alive():
                return [f"rank {r} exited with code {proc.exitcode} before answering"]
        if time.monotonic() > deadline:
            return [f"rank {min(set(range(len(ranks))) - set(answers))} gave no answer in {timeout_s:.0f}s"]
        time.sleep(0.05)
    return [answers[r] for r in range(len(ranks))]


def _rank(rank: int, world: int, port: int, device: str, budget_s: float, send: Any) -> None:
    """One rank: joins the group, times each collective in samples every rank starts together (as many as rank 0
    decides), sends its times."""
    try:
        cuda = device.startswith("cuda")
        dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
        whole = torch.zeros(COLLECTIVE_BYTES // 4, device=dev)
        part = torch.ones(whole.numel() // world, device=dev)
        ops = {"all_gather": lambda: all_gather(whole[:part.numel() * world], part),
               "reduce_scatter": lambda: reduce_scatter(part, whole[:part.numel() * world])}
        times = {}
        for name, op in ops.items():
            op()                                            # the warm-up: connections, buffers
            samples: list[float] = []
            deadline = time.perf_counter() + budget_s / len(ops)
            go = torch.zeros(1, device=dev)
            while True:
                # rank 0's clock decides whether another sample runs, and every rank hears it: ranks that counted
                # their own samples would disagree, and one would wait in a collective the others never join
                go.fill_(float(len(samples) < MAX_SAMPLES and (len(samples) < MIN_SAMPLES
                                                               or time.perf_counter() < deadline)))
                dist.broadcast(go, src=0)                   # also the start line: every rank times from here
                if not go.item():
                    break
                start = time.perf_counter()
                op()
                if cuda:
                    torch.cuda.synchronize(dev)
                samples.append(time.perf_counter() - start)
            times[name] = samples
        dist.destroy_process_group()
        send.send(times)
    except Exception as err:  # noqa: BLE001 - the caller says which rank failed and how
        send.send(f"rank {rank}: {type(err).__name__}: {err}")
    finally:
        send.close()

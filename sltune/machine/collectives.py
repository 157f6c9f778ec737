"""All-gather and reduce-scatter per world size, over the process group a trial uses (gloo on the CPU, NCCL on
GPUs): ranks in processes of their own on this machine, timed in step (a barrier before each sample), the slowest
rank's time counted, as a collective finishes when its last rank does."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from sltune.machine.rates import Rate
from sltune.machine.timing import MAX_SAMPLES, MIN_SAMPLES
from sltune.runtime.sharding import all_gather, reduce_scatter

COLLECTIVE_BYTES = 16 << 20      # the gathered tensor: a layer's weights in bfloat16 at a few hundred million
TIMEOUT_S = 120.0


def collectives(world: int, device: str, budget_s: float, processes: Any) -> dict[str, Rate]:
    """{"all_gather.W": bytes/s, "reduce_scatter.W": bytes/s} (the whole gathered tensor per second) for `world`
    ranks started from `processes` (a multiprocessing context: the caller's, which sltune.machine does not pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pipes = [processes.Pipe(duplex=False) for _ in range(world)]
    ranks = [processes.Process(target=_rank, args=(r, world, port, device, budget_s, pipes[r][1]), daemon=True,
                               name=str(r)) for r in range(world)]
    for p in ranks:
        p.start()
    try:
        answers = [_answer(recv, proc, TIMEOUT_S + budget_s) for (recv, _), proc in zip(pipes, ranks)]
    finally:
        for p in ranks:
            p.join(10)
            if p.is_alive():
                p.kill()
    failed = [a for a in answers if isinstance(a, str)]
    if failed:
        raise RuntimeError(f"the {world}-rank collectives failed: {failed[0]}")
    out = {}
    for name in answers[0]:
        slowest = [max(a[name][i] for a in answers) for i in range(len(answers[0][name]))]
        out[f"{name}.{world}"] = Rate.of([COLLECTIVE_BYTES / s for s in slowest], "bytes")
    return out


def _answer(recv: Any, proc: Any, timeout_s: float) -> Any:
    """A rank's answer; a rank that died without one, or went silent past `timeout_s`, is an error at once."""
    deadline = time.monotonic() + timeout_s
    while not recv.poll(0.2):
        if not proc.is_alive() and not recv.poll(0):
            return f"rank {proc.name} exited with code {proc.exitcode} before answering"
        if time.monotonic() > deadline:
            return f"rank {proc.name} gave no answer in {timeout_s:.0f}s"
    return recv.recv()



def _rank(rank: int, world: int, port: int, device: str, budget_s: float, send: Any) -> None:
    """One rank: joins the group, times each collective in samples every rank starts together, sends its times."""
    try:
        cuda = device.startswith("cuda")
        dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        whole = torch.zeros(COLLECTIVE_BYTES // 4, device=dev)
        part = torch.ones(whole.numel() // world, device=dev)
        ops = {"all_gather": lambda: all_gather(whole[:part.numel() * world], part),
               "reduce_scatter": lambda: reduce_scatter(part, whole[:part.numel() * world])}
        times = {}
        for name, op in ops.items():
            op()                                            # the warm-up: connections, buffers
            samples = []
            deadline = time.perf_counter() + budget_s / len(ops)
            while len(samples) < MAX_SAMPLES and (len(samples) < MIN_SAMPLES or time.perf_counter() < deadline):
                dist.barrier()
                start = time.perf_counter()
                op()
                if cuda:
                    torch.cuda.synchronize(dev)
                samples.append(time.perf_counter() - start)
            n = torch.tensor([len(samples)])
            dist.all_reduce(n, op=dist.ReduceOp.MIN)        # every rank keeps as many as the one that took fewest
            times[name] = samples[:int(n)]
        dist.destroy_process_group()
        send.send(times)
    except Exception as err:  # noqa: BLE001 - the caller says which rank failed and how
        send.send(f"rank {rank}: {type(err).__name__}: {err}")
    finally:
        send.close()

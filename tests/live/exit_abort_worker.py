"""Worker of tests/live/test_exit_abort.py: a few steps with ``ElasticSession``, then
``finish()``, and local rank 0 dies of SIGABRT after (or before) ``close()``.

The seam: ``os.abort()`` stands in for torch's gloo teardown aborting an interpreter's
exit ("terminate called without an active exception"), which happens now and then (2 of
30 exits of a bare 2-rank FSDP2 script on torch 2.13) and cannot be caused on demand.
After ``close()``, rank 0 first waits for rank 1's closed mark, as when both reach their
exit together; the agent's reaction is what the test checks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

from slurm_elastic.channel import NodeChannel
from slurm_elastic.live import ElasticSession
from slurm_elastic.live.roster import closed_pid


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--dataset-size", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--abort", choices=["after_close", "before_close"], required=True)
    args, _ = p.parse_known_args()  # LiveRun's other flags (ledger, out, step time)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(args.dataset_size, 4)
    session = ElasticSession(
        model, opt, dataset_size=args.dataset_size, global_batch_size=args.global_batch
    )
    while not session.finished(steps=args.steps):
        for _ in session.batches():
            with session.step() as s:
                loss = session.model(x[s.indices]).pow(2).sum() * s.loss_scale
                opt.zero_grad()
                loss.backward()
                opt.step()
            if session.interrupted or session.reached(steps=args.steps):
                break
    session.finish()
    first = int(os.environ["LOCAL_RANK"]) == 0
    if first and args.abort == "before_close":
        os.abort()
    session.close()
    if first:
        channel = NodeChannel.from_environ()
        assert channel is not None
        deadline = time.monotonic() + 30
        while closed_pid(channel, 1) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        os.abort()
    return 0


if __name__ == "__main__":
    sys.exit(main())

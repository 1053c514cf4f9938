"""1F1B (PipeDream-flush), as a student writes it: each rank's forwards and backwards, in order.

Rank r first runs p-1-r forwards (the warm-up), then alternates one forward and one backward, then
runs the backwards left. paralab adds the sends and receives, checks the lists (complete, in order,
free of deadlock) and runs them:

    paralab train pipeline --schedule examples/schedules/one_f_one_b.py --workers 2 --microbatches 4 --dataset synthetic --width 0.125 --num-batches 3 --batch-size 32 --eval-batches 1 --norm none --check
"""
from paralab.strategies.pipeline.actions import Action


def one_f_one_b(p, m):
    ranks = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [Action("forward", mb, stage=r) for mb in range(warmup)]
        for j in range(m - warmup):
            order += [Action("forward", warmup + j, stage=r), Action("backward", j, stage=r)]
        order += [Action("backward", mb, stage=r) for mb in range(m - warmup, m)]
        ranks.append(order)
    return ranks

"""Node communication health: correctness and bus bandwidth of the main collectives per message size."""

from distcheck import scenario

# float32 elements per message: 4 KiB, 256 KiB, 4 MiB
SIZES = (1 << 10, 1 << 16, 1 << 20)
WARMUP, ITERS = 2, 5
# nccl-tests' bus bandwidth factors: what each rank's links carry relative to the message
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def _run(op, n, rank, count, dev):
    import torch
    import torch.distributed as dist

    if op == "all_reduce":
        t = torch.full((count,), float(rank + 1), device=dev)
        dist.all_reduce(t)
        return bool((t == n * (n + 1) / 2).all())
    if op == "all_gather":
        out = torch.empty(count * n, device=dev)
        dist.all_gather_into_tensor(out, torch.full((count,), float(rank), device=dev))
        return bool((out.view(n, count) == torch.arange(n, device=dev).view(n, 1).float()).all())
    t = torch.full((count,), float(rank), device=dev)
    dist.broadcast(t, src=0)
    return bool((t == 0).all())


def _time(op, n, rank, count, dev):
    """Seconds per call on the slowest rank (what every rank waits for), and whether results were right."""
    import time

    import torch
    import torch.distributed as dist

    ok = all(_run(op, n, rank, count, dev) for _ in range(WARMUP))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(ITERS):
        ok &= _run(op, n, rank, count, dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    per_call = torch.tensor([(time.perf_counter() - start) / ITERS])
    dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
    return per_call.item(), ok


@scenario(expect="pass")
def comm_health(ctx):
    """Checks all_reduce, all_gather and broadcast results and measures their bus bandwidth per message
    size (nccl-tests' formulas); --min-busbw GB/s fails the node below a floor."""
    n, rank, dev = ctx.world_size, ctx.rank, ctx.device
    rows, worst = [], {}
    for count in SIZES:
        nbytes = count * 4
        for op, factor in BUS_FACTOR.items():
            seconds, ok = _time(op, n, rank, count, dev)
            algbw = nbytes / seconds / 1e9
            busbw = algbw * factor(n)
            rows.append([nbytes, count, op, round(seconds * 1e6, 1), round(algbw, 3), round(busbw, 3),
                         "ok" if ok else "WRONG"])
            ctx.require(f"{op} correct at {nbytes} B", ok, f"{op} of {nbytes} bytes returned wrong values")
            if count == SIZES[-1]:
                worst[op] = busbw
    ctx.report_table(
        f"Bus bandwidth ({ctx.backend}, {n} ranks, {dev.type})",
        ["size (B)", "count", "op", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "result"], rows)
    floor = ctx.options.get("min_busbw")
    if floor is not None:
        for op, busbw in worst.items():
            ctx.require(f"{op} busbw", busbw >= floor,
                        f"{op} bus bandwidth {busbw:.3f} GB/s at {SIZES[-1] * 4} bytes is below the "
                        f"--min-busbw floor of {floor:g} GB/s", op=op, busbw=busbw, floor=floor)

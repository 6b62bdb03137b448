"""Every collective the backend offers, each checked numerically against what it must produce."""

from distcheck import scenario


def _supported(fn):
    """Run one collective; a backend that lacks it says so the same way on every rank."""
    try:
        fn()
        return True
    except RuntimeError as exc:
        text = str(exc).lower()
        if "not supported" in text or "does not support" in text or "unsupported" in text:
            return False
        raise


@scenario(expect="pass")
def collectives_sanity(ctx):
    """all_reduce SUM/MAX/MIN, all_gather(_into_tensor), broadcast, reduce, gather, scatter, all_to_all,
    reduce_scatter, send/recv, barrier and the object collectives, each checked numerically."""
    import torch
    import torch.distributed as dist

    r, n, dev = ctx.rank, ctx.world_size, ctx.device
    ranks = torch.arange(n, dtype=torch.float32)

    t = torch.full((4,), float(r + 1), device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    ctx.check_close("all_reduce SUM", t, torch.full((4,), float(n * (n + 1) / 2)))

    t = torch.tensor([float(r)], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    ctx.check_close("all_reduce MAX", t, torch.tensor([float(n - 1)]))

    t = torch.tensor([float(r)], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    ctx.check_close("all_reduce MIN", t, torch.tensor([0.0]))

    out = [torch.zeros(2, device=dev) for _ in range(n)]
    dist.all_gather(out, torch.full((2,), float(r), device=dev))
    ctx.check_close("all_gather", torch.stack(out).cpu(), ranks.repeat_interleave(2).view(n, 2))

    flat = torch.zeros(n * 2, device=dev)
    if _supported(lambda: dist.all_gather_into_tensor(flat, torch.full((2,), float(r), device=dev))):
        ctx.check_close("all_gather_into_tensor", flat, ranks.repeat_interleave(2))

    t = torch.full((3,), float(r), device=dev)
    dist.broadcast(t, src=n - 1)
    ctx.check_close("broadcast", t, torch.full((3,), float(n - 1)))

    t = torch.tensor([float(r + 1)], device=dev)
    dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)
    if r == 0:
        ctx.check_close("reduce", t, torch.tensor([float(n * (n + 1) / 2)]))

    t = torch.tensor([float(r)], device=dev)
    gathered = [torch.zeros(1, device=dev) for _ in range(n)] if r == 0 else None
    if _supported(lambda: dist.gather(t, gather_list=gathered, dst=0)) and r == 0:
        ctx.check_close("gather", torch.cat(gathered).cpu(), ranks)

    t = torch.zeros(1, device=dev)
    parts = [torch.tensor([float(i * 10)], device=dev) for i in range(n)] if r == 0 else None
    if _supported(lambda: dist.scatter(t, scatter_list=parts, src=0)):
        ctx.check_close("scatter", t, torch.tensor([float(r * 10)]))

    inp = torch.arange(n, dtype=torch.float32, device=dev) + r * n
    outp = torch.zeros(n, device=dev)
    if _supported(lambda: dist.all_to_all_single(outp, inp)):
        ctx.check_close("all_to_all_single", outp, torch.arange(n, dtype=torch.float32) * n + r)

    out = torch.zeros(1, device=dev)
    chunks = [torch.tensor([float(r + i)], device=dev) for i in range(n)]
    if _supported(lambda: dist.reduce_scatter(out, chunks)):
        ctx.check_close("reduce_scatter", out, torch.tensor([float(sum(k + r for k in range(n)))]))

    # ring: even ranks send first, odd ranks receive first (no deadlock on any backend)
    right, left = (r + 1) % n, (r - 1) % n
    buf = torch.zeros(1, device=dev)
    msg = torch.tensor([float(r)], device=dev)
    if r % 2 == 0:
        dist.send(msg, dst=right)
        dist.recv(buf, src=left)
    else:
        dist.recv(buf, src=left)
        dist.send(msg, dst=right)
    ctx.check_close("send/recv ring", buf, torch.tensor([float(left)]))

    dist.barrier()

    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r})
    ctx.check_close("all_gather_object", torch.tensor([o["rank"] for o in objs]), ranks)

    box = [f"hello from {n - 1}" if r == n - 1 else None]
    dist.broadcast_object_list(box, src=n - 1)
    ctx.check_close("broadcast_object_list", torch.tensor([box[0] == f"hello from {n - 1}"]), torch.tensor([True]))
